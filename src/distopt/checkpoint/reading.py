"""DCP's reader for distopt's loads: each saved tensor read from its file straight into the
tensor the load fills.

[Note: direct reads]
DCP's ``FileSystemReader`` reads each saved item with ``torch.load``: a new tensor of the item's
size, read into, then copied into the tensor the load fills (a box of a live flat shard, a
state tensor). The new tensor is fresh memory each time, so every page of it is faulted in
and zeroed by the kernel before the read fills it, and freed after the copy: at 300M params
over 4 ranks, most of a load's time on a busy 2-core machine (benchmarks/README.md, "torch's
checkpoint road and distopt's"). ``DirectReader`` reads the item's zip structure alone
(``torch.load`` onto the meta device: the saved dtype, shape, strides and where the values lie
in the file) and, where the load wants the whole saved tensor and fills a contiguous CPU tensor
of the same dtype and shape, reads the values with one ``readinto`` into that tensor's memory.
Everything else (objects, a part of a saved tensor after a change of DP size, other devices,
other dtypes, a file of the other byte order, storage transforms) goes through DCP's own
reading. The bytes read are the same either way, and every file was checked against the
manifest's CRC32 before (load.py), so what a direct read installs is what was saved.

Files are read in offset order, one open per file.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_NATIVE = sys.byteorder.encode()  # the byte order this machine's tensors hold


class DirectReader(dcp.FileSystemReader):
    """DCP's file reader with direct reads ([Note: direct reads]); it reuses metadata already
    read (and checked) instead of reading it again."""

    def __init__(self, path: Path, metadata: Metadata | None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self.direct_reads = 0  # items read straight into their targets, for the tests

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        rest: list[ReadItem] = []
        for relative_path, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with open(Path(self.path) / relative_path, "rb", buffering=0) as stream:
                for item in items:
                    if _read_direct(self, stream, item, planner):
                        self.direct_reads += 1
                    else:
                        rest.append(item)
        if rest:
            return super().read_data(LoadPlan(rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_direct(reader: DirectReader, stream: Any, item: ReadItem,
                 planner: LoadPlanner) -> bool:
    """Read ``item`` from ``stream`` straight into its target where it can (see [Note: direct
    reads]); False, having changed nothing, where DCP's own reading must."""
    info = reader.storage_data[item.storage_index]
    if (item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None)
            or any(item.storage_offsets)):
        return False
    target = planner.resolve_tensor(item).detach()
    if target.device.type != "cpu" or not target.is_contiguous():
        return False
    try:
        # Bytes in this machine's order only (a file without the record is, as torch.load
        # takes it); torch.load swaps the others.
        records = torch._C.PyTorchFileReader(reader._slice_file(stream, info))
        if records.has_record("byteorder") and records.get_record("byteorder") != _NATIVE:
            return False
        saved = torch.load(reader._slice_file(stream, info), map_location="meta",
                           weights_only=True)
        at = saved.untyped_storage()._checkpoint_offset
    except Exception:  # anything the structure read does not expect: DCP reads it
        return False
    if (not isinstance(saved, torch.Tensor) or not isinstance(at, int)
            or saved.dtype != target.dtype or saved.shape != target.shape
            or tuple(item.lengths) != tuple(saved.shape) or saved.storage_offset() != 0
            or not saved.is_contiguous() or saved.untyped_storage().nbytes() != target.nbytes
            or at + target.nbytes > info.length):
        return False
    if target.nbytes:
        stream.seek(info.offset + at)
        # The tensor's bytes as a writable buffer (ctypes, as numpy is not one of torch's
        # requirements); the tensor outlives the read.
        into = memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")
        while into.nbytes:
            got = stream.readinto(into)
            if not got:
                raise OSError(f"{Path(reader.path) / info.relative_path} ended early: the "
                              "file is truncated")
            into = into[got:]
    planner.commit_tensor(item, target)
    return True
