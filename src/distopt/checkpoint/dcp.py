"""torch.distributed.checkpoint (DCP) for distopt's uneven shards: chunks, reader, writer.

Importing this module imports DCP, which is slow to import; the package imports it only
inside the functions that save, load or export (see [Note: one-way imports]).

[Note: flat shards in DCP]
DCP reshards by chunks: at save each rank declares which box of a global tensor it writes, at
load which box it wants, and each rank reads exactly the saved chunks that overlap its own. A
distopt piece is such a box of the flattened parameter (1-D, from the piece's start), but at
offsets that no DTensor placement describes. ``_DcpFlat`` is a tensor subclass with the global
1-D shape that implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) for one piece (``piece_as_dcp``), or for
the several runs a tensor-parallel piece covers (see [Note: TP checkpoints]); an empty chunk is
not declared. Replicated values (model params, step counts, options) are plain tensors and
objects, which DCP writes once however many ranks hold them.

The state dicts given to DCP are flat (keys such as ``main/l1.weight``), so both planners run
with flattening off.

[Note: staging by torch's stagers]
``dcp.async_save`` first copies the state dict with its stager, then writes the copy in the
background. torch's default stager (``StateDictStager``) copies a tensor as
``x.new_empty(...)`` and, for a tensor without storage of its own as a ``_DcpFlat`` is, a deep
copy of its attributes set on that. So ``new_empty`` gives an empty ``_DcpFlat`` of the
requested device and dtype, and the chunks' deep copy (``_Chunks.__deepcopy__``) copies each
box into host memory of exactly its bytes: the staged copy owns them, so the steps after
``async_save`` returns change nothing it writes, and it holds what this rank writes, never the
whole flat buffers the boxes view (the stager's copy of a plain view copies its whole storage).
The flat shard a load installs is not copied: a staged copy is written, never loaded into.
torch's other stager, ``BlockingAsyncStager`` (``dcp.async_save`` with a ``FileSystemWriter``
as its ``storage_writer``), makes its copy with ``torch.zeros_like(x, device="cpu")`` and fills
it with ``copy_``, again and again into the same copy with ``cache_staged_state_dict=True``:
``zeros_like`` gives boxes at the same offsets in zeroed memory of their own, and ``copy_``
copies box by box.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..parallel.tensor_parallel import TensorParallelMesh
from .format import FlatShard, OwnedPiece
from .reading import DirectReader
from .tp_runs import piece_runs
from .writing import _Writer


class _Chunks(dict):
    """A ``_DcpFlat``'s boxes (global offset -> values) and, for boxes of torch's layout, the
    flat shard they view (``shard``, what a load installs). A deep copy is a staged copy; see
    [Note: staging by torch's stagers]; it keeps where the shard lies (``span``), so that a
    copy still loads."""

    shard: Any
    span: tuple[int, int]
    owner: str  # the piece's param, for boxes of opt.state_dict() (checkpoint/reshardable.py)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Chunks:
        out = _Chunks({offset: _host_copy(box) for offset, box in self.items()})
        out.__dict__.update(self.marks())
        return out

    def marks(self) -> dict[str, Any]:
        """What a copy keeps of the shard (where it lies) and of its owner."""
        shard = self.__dict__.get("shard")
        marks = {k: v for k, v in self.__dict__.items() if k in ("span", "owner")}
        if shard is not None:
            marks["span"] = (shard.offset, shard.numel)
        return marks


def _host_copy(box: torch.Tensor) -> torch.Tensor:
    """``box``'s values in host memory of exactly its bytes, shared with nothing."""
    return torch.empty(box.shape, dtype=box.dtype).copy_(box)


class _DcpFlat(torch.Tensor):
    """Chunks of a tensor as DCP sees them: a tensor of ``shape`` (1-D: the flattened param) of
    which this rank holds ``chunks``, each a box at a global offset (an int for 1-D)."""

    _chunks: _Chunks

    @staticmethod
    def __new__(cls, chunks: list[tuple[Any, torch.Tensor]], shape: int | tuple[int, ...],
                like: torch.Tensor) -> _DcpFlat:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=like.dtype, device=like.device
        )
        out._chunks = _Chunks({(offset,) if isinstance(offset, int) else tuple(offset): local
                               for offset, local in chunks if local.numel()})
        return out

    @property
    def shard(self) -> Any:
        """The flat shard these boxes view (torch_layout's boxes), or for a copy of such boxes
        their values joined into one; no attribute otherwise."""
        chunks = self._chunks
        if "shard" in chunks.__dict__:
            return chunks.shard
        if "span" in chunks.__dict__:  # a copy: its boxes, in flat order, are the piece
            offset, numel = chunks.span
            local = torch.cat([box.reshape(-1) for box in chunks.values()]) if chunks else (
                torch.empty(0, dtype=self.dtype))
            return FlatShard(local, offset, numel)
        raise AttributeError("shard")

    @shard.setter
    def shard(self, value: Any) -> None:
        self._chunks.shard = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _DcpFlat:
        """A copy holding its own bytes, as torch's stager makes (``copy.deepcopy`` of a
        state dict holding boxes, before a later ``load_state_dict``)."""
        out = _DcpFlat([], tuple(self.shape), torch.empty(0, dtype=self.dtype))
        out._chunks = copy.deepcopy(self._chunks, memo)
        return out

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its boxes (and the flat shard they view, whose storage torch.save and
        multiprocessing write once): ``torch.save`` of a state dict holding boxes, read back by
        the default ``torch.load``, and ``dcp.async_save``'s checkpointing process."""
        chunks = self._chunks
        return (_rebuild_boxes, (list(chunks.items()), tuple(self.shape), self.dtype,
                                 chunks.__dict__.get("shard"), chunks.marks()))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.new_empty.default:
            return _staged_shell(args[0], tuple(args[1]), **kwargs)
        if func is torch.ops.aten.zeros_like.default:
            return _zeroed_like(args[0], **kwargs)
        if func is torch.ops.aten.copy_.default and all(isinstance(a, _DcpFlat) for a in args[:2]):
            return _copy_boxes(args[0], args[1], *args[2:], **kwargs)
        raise NotImplementedError(f"{func} on a distopt checkpoint shard; use its FlatShard")

    def __repr__(self) -> str:  # type: ignore[override]
        spans = ", ".join(f"{list(o)} + {list(t.shape)}" for o, t in self._chunks.items())
        return f"_DcpFlat({list(self.shape)}: {spans})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._chunks[offset]),
                    size=self.shape,
                ),
            )
            for offset, chunk in zip(self._chunks, self.__create_chunk_list__(), strict=True)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offset), sizes=t.shape)
            for offset, t in self._chunks.items()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return _own_bytes(self._chunks[tuple(index.offset)])


def _rebuild_boxes(chunks: list[tuple[tuple[int, ...], torch.Tensor]], shape: tuple[int, ...],
                   dtype: torch.dtype, shard: Any, marks: dict[str, Any]) -> _DcpFlat:
    """A pickled ``_DcpFlat`` (``__reduce_ex__``)."""
    out = _DcpFlat(chunks, shape, torch.empty(0, dtype=dtype))
    out._chunks.__dict__.update(marks)
    if shard is not None:
        out.shard = shard
    return out


# The default torch.load (weights_only) reads pickled boxes; see ``_DcpFlat.__reduce_ex__``.
torch.serialization.add_safe_globals([_rebuild_boxes])


def _staged_shell(source: _DcpFlat, shape: tuple[int, ...], *, dtype: Any = None,
                  device: Any = None, **_: Any) -> _DcpFlat:
    """What ``source.new_empty(shape, device=...)`` gives: a ``_DcpFlat`` of no chunks, which
    torch's stager then fills with a deep copy of ``source``'s attributes."""
    like = torch.empty(0, dtype=dtype or source.dtype, device=device or source.device)
    return _DcpFlat([], shape, like)


def _zeroed_like(source: _DcpFlat, *, dtype: Any = None, device: Any = None, **_: Any
                 ) -> _DcpFlat:
    """What ``torch.zeros_like(source, device=...)`` gives: boxes at ``source``'s offsets, of
    their own zeroed memory, for ``copy_`` to fill (torch's ``BlockingAsyncStager``)."""
    dtype, device = dtype or source.dtype, device or source.device
    return _DcpFlat([(offset, torch.zeros(box.shape, dtype=dtype, device=device))
                     for offset, box in source._chunks.items()], tuple(source.shape),
                    torch.empty(0, dtype=dtype, device=device))


def _copy_boxes(target: _DcpFlat, source: _DcpFlat, non_blocking: bool = False) -> _DcpFlat:
    """``target.copy_(source)`` box by box: both must hold boxes at the same offsets (a staged
    copy made of ``source``, or of the same rank's boxes at an earlier save)."""
    if list(target._chunks) != list(source._chunks) or any(
            t.shape != source._chunks[o].shape for o, t in target._chunks.items()):
        raise ValueError(
            f"cannot copy {source!r} into {target!r}: a distopt checkpoint shard copies into "
            "boxes at the same offsets only; stage the state dict afresh (the layout of the "
            "rank's pieces changed since the copy was made)")
    for offset, box in target._chunks.items():
        box.copy_(source._chunks[offset], non_blocking=non_blocking)
    return target


def _own_bytes(box: torch.Tensor) -> torch.Tensor:
    """``box`` (a contiguous view of a larger flat shard) as a tensor on a storage of exactly
    its bytes, aliasing them (a load still reads into the live tensor). DCP's FileSystemWriter
    clones any tensor whose storage is larger (torch.save would write the whole storage) and
    keeps each key's last clone until the rank's file is written: with torch's
    ``dcp.save`` of the boxes of torch_layout.py, a copy of most of the rank's state (5.67 GiB
    against 4.15 for distopt's own save at 1.0B, d = 4; 4.13 with this, benchmarks/README.md)."""
    storage = box.untyped_storage()
    if storage.nbytes() == box.nbytes:
        return box
    start = box.storage_offset() * box.element_size()
    return torch.empty(0, dtype=box.dtype, device=box.device).set_(
        storage[start : start + box.nbytes], 0, box.shape, box.stride())


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes (offset, size, flat start) that cover elements ``[lo, hi)`` of a row-major
    tensor of ``shape``: a partial first row, the whole rows, a partial last row, each partial
    row cut the same way one dimension down (at most two boxes per dimension)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo)]
    inner = math.prod(shape[1:])
    first_whole, end_whole = -(-lo // inner), hi // inner
    out = []

    def within(row: int, start: int, end: int) -> None:
        out.extend(((row, *o), (1, *z), f + row * inner)
                   for o, z, f in flat_range_boxes(shape[1:], start, end))

    if first_whole > end_whole:  # inside one row
        row = lo // inner
        within(row, lo - row * inner, hi - row * inner)
        return out
    if lo < first_whole * inner:
        within(first_whole - 1, lo - (first_whole - 1) * inner, inner)
    if first_whole < end_whole:
        out.append(((first_whole, *[0] * (len(shape) - 1)),
                    (end_whole - first_whole, *shape[1:]), first_whole * inner))
    if end_whole * inner < hi:
        within(end_whole, 0, hi - end_whole * inner)
    return out


def param_boxes(param: torch.Tensor, shard: FlatShard | None, like: torch.Tensor) -> torch.Tensor:
    """``shard`` (a range of ``param`` flattened) as DCP's boxes of ``param``'s shape, views of
    the shard's values; no box without a shard. See [Note: torch's layout from flat shards] in
    torch_layout.py."""
    shape = tuple(param.shape)
    chunks = []
    if shard is not None:
        # A DTensor param's piece is a range of its local shard: runs of the global tensor
        # ([Note: TP checkpoints] in tp_runs.py), each cut into boxes of the global shape.
        for at_run, global_start, length in piece_runs(param, shard.offset, shard.end):
            for offset, size, start in flat_range_boxes(shape, global_start,
                                                        global_start + length):
                at = at_run + start - global_start
                chunks.append((offset, shard.local[at : at + math.prod(size)].view(size)))
        like = shard.local
    out = _DcpFlat(chunks, shape, like)
    out.shard = shard  # what a load of these boxes installs
    return out


def range_as_dcp(shape: tuple[int, ...], start: int, values: torch.Tensor) -> torch.Tensor:
    """``values``, the elements ``[start, start + values.numel())`` of a flattened tensor of
    ``shape``, as the boxes of that tensor DCP writes (a model param written from the shards
    of sharded params, with the param's own shape in the checkpoint)."""
    values = values.reshape(-1)
    boxes = flat_range_boxes(tuple(shape), start, start + values.numel())
    return _DcpFlat([(offset, values[f - start : f - start + math.prod(size)].view(size))
                     for offset, size, f in boxes], tuple(shape), values)


def piece_as_dcp(tp: TensorParallelMesh | None, owned: OwnedPiece, values: torch.Tensor,
                 writing: bool, part: tuple[int, int] | None = None) -> torch.Tensor:
    """``values`` (laid out like ``owned``'s piece: 1-D, or the param's shape for a param
    owned whole) as chunks of the flattened global parameter, for DCP to write or to read
    into; see [Note: TP checkpoints]. ``part``: only elements ``[lo, hi)`` of the piece's
    range, the part this rank writes ([Note: each byte written once] in parts.py)."""
    numel = owned.param.numel()
    values = values.view(-1)  # a view, so that a load reads into the live tensor
    start, end = part or (owned.start, owned.end)
    values = values[start - owned.start : end - owned.start]
    if tp is None:
        return _DcpFlat([(start, values)], numel, values)
    if writing and not tp.counts_once(owned.param):
        return _DcpFlat([], numel, values)  # TP coordinate 0 writes it
    runs = piece_runs(owned.param, start, end)
    return _DcpFlat([(g, values[i : i + n]) for i, g, n in runs], numel, values)


def _no_dist(group: dist.ProcessGroup | None) -> bool:
    return group is None


# DCP's notice that it runs in one process is what a group of None means here. A filter, not
# catch_warnings() around each call, which is not thread-safe: async saves write from a thread
# (see [Note: async saves] in background.py) while the training loop may use warnings too.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming "
    r"the intent is to (save|load) in a single process")


class WriteFailed(Exception):
    """Some rank could not write its part of a checkpoint; raised on every rank alike."""


def save(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None,
         nested: bool = False) -> dict[str, dict[str, int]]:
    """Write ``state`` into ``directory``; every file is fsynced before this returns; returns
    the size and CRC32 of this rank's file. ``nested``: ``state`` is nested as torch's
    ``dcp.save`` is given it, and DCP flattens it and records the nesting, as there.

    DCP gathers every rank's outcome of each phase, so a rank that fails to write (a full disk)
    makes ``WriteFailed`` rise on all ranks, naming the ranks that failed and why."""
    writer = _Writer(directory, sync_files=True)
    planner = dcp.DefaultSavePlanner(flatten_state_dict=nested, flatten_sharded_tensors=False)
    try:
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=_no_dist(group))
    except CheckpointException as exc:  # a BaseException; DCP raises it on every rank
        raise WriteFailed("; ".join(
            f"rank {rank}: {type(error).__name__}: {error}"
            for rank, (error, _) in sorted(exc.failures.items())
        )) from None
    return writer.checksums


def load(
    state: dict[str, Any],
    directory: Path,
    group: dist.ProcessGroup | None,
    metadata: Metadata | None = None,
) -> None:
    """Fill ``state`` in place: tensors are written into, other values replaced."""
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(state, storage_reader=DirectReader(directory, metadata), planner=planner,
             process_group=group, no_dist=_no_dist(group))


def read_metadata(directory: Path) -> Metadata:
    return dcp.FileSystemReader(directory).read_metadata()


def flat_chunks(value: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]] | None:
    """The (global offset, values) chunks of a tensor ``piece_as_dcp`` made, else None."""
    return list(value._chunks.items()) if isinstance(value, _DcpFlat) else None


def with_chunks(value: torch.Tensor, chunks: list[tuple[tuple[int, ...], torch.Tensor]]
                ) -> torch.Tensor:
    """``value`` (from ``piece_as_dcp``) with other tensors in place of its chunks: the same
    global offsets, shape and dtype."""
    assert isinstance(value, _DcpFlat)
    return _DcpFlat(chunks, tuple(value.shape), chunks[0][1] if chunks else value)
