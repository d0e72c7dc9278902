"""DCP's file writer for distopt's saves: one file per rank, one item in memory at a time, each
file's digest taken as it is written.

[Note: bounded writes]
DCP's FileSystemWriter keeps every tensor it wrote to a file referenced until the file is
closed, and for views (a piece of the param buffer) and device tensors those are CPU copies:
the rank's whole share of the model and state at once. ``_Writer`` writes the same files, in
the same format (each item torch.save'd at a recorded offset, so DCP's reader reads them), but
holds one item at a time.

[Note: one digest per byte]
A save takes each file's digest (digest.py) from the bytes as they are written
(``_ErrorKeepingFile``), for the manifest that every load checks first. ``torch.save`` takes a
CRC32 of each zip record too, which torch's reader never checks (``torch.load`` reads a record
with a damaged byte as it is): a second pass of arithmetic over every byte, a second or so per
GB on a busy 2-core machine (benchmarks/README.md, "torch's checkpoint road and distopt's").
``_save_tensor`` writes the same zip records without it (their CRC fields left 0), read by
DCP's reader and ``torch.load`` alike.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import digest


class _ErrorKeepingFile:
    """A file whose write errors survive ``torch.save``, which reports them as an unrelated
    "unexpected pos" RuntimeError: a full disk must say that the disk is full."""

    __slots__ = ("_file", "error", "digest")

    def __init__(self, file: io.BufferedIOBase) -> None:
        self._file, self.error = file, None
        self.digest = digest.StreamDigest()  # of every byte written through it, for the manifest

    def write(self, data: Any) -> int:
        self.digest.update(data)
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def _save_tensor(tensor: torch.Tensor, stream: _ErrorKeepingFile) -> None:
    """``torch.save(tensor, stream)`` without the zip records' own CRC32s; see [Note: one digest
    per byte]. Where this torch's writer takes no such option, ``torch.save``."""
    try:
        save = torch.serialization._save
        writer = torch._C.PyTorchFileWriter(
            stream, compute_crc32=False,
            storage_alignment=torch.serialization._get_storage_alignment())
    except (AttributeError, TypeError):
        torch.save(tensor, stream)
        return
    save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


class _Writer(dcp.FileSystemWriter):
    """One file per rank, one item in memory at a time; see [Note: bounded writes]. The
    digest of each file is taken from the bytes as they are written (``checksums``: the
    manifest's entries), so a save never reads its files back; see [Note: one digest per
    byte]."""

    checksums: dict[str, dict[str, int]]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            kept = _ErrorKeepingFile(stream)
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    kept.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # torch.save writes a view's whole storage
                    try:
                        _save_tensor(tensor, kept)
                    except RuntimeError:
                        if kept.error is not None:
                            raise kept.error from None
                        raise
                    del tensor
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                del data
            stream.flush()
            os.fsync(stream.fileno())
            self.checksums = {name: {"bytes": stream.tell(),
                                     digest.KEY: kept.digest.intdigest()}}
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future
