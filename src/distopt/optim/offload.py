"""The offload tier: main params and optimizer state kept in a file, read for each bucket's step.

[Note: the offload tier]
``DistributedOptimizer(..., offload_dir=DIR)`` keeps what only the step reads, this rank's fp32
main params (or, with ``store_param_remainders``, their int16 remainders) and the optimizer's
state tensors, in one file per rank under ``DIR`` (NVMe in practice) rather than in RAM. What
the forward and backward read stays in RAM: the params (whole, or this rank's shard), the grads
and the step counters. fp32 params are their own masters and stay in RAM too: the tier then
holds the state alone.

*How the bytes move.* The file is mapped into the process (``mmap``, shared), and every
offloaded tensor is a view of the mapping, so the step, torch's optimizers, checkpoints and
``opt.state`` read and write them as they would tensors in RAM: the kernel reads a page from the
file at its first touch, and a written page goes back to the file. The tier decides only *when*
pages move, which is what bounds RAM:

1. The step goes one bucket's shard at a time (one step chunk, [Note: step chunks] in
   optim/step.py). Before chunk ``i`` is stepped the tier asks the kernel to read chunk ``i + 1``
   ahead (``posix_fadvise(WILLNEED)``, on a thread), so the next bucket's read overlaps this
   bucket's step.
2. After chunk ``i`` is stepped (its masters written back to the params, its state narrowed to
   ``state_dtype``), the chunk's state is placed in its slots in the file (at the first step,
   where torch created it in RAM: one copy; later the step updates the slots in place), and
   its pages leave the process (``madvise(DONTNEED)``: written pages stay in the page cache,
   dirty, so nothing is lost). A thread then writes them to the file
   (``sync_file_range``) and drops them from the page cache (``posix_fadvise(DONTNEED)``).
3. Before chunk ``i`` is stepped, the write of chunk ``i - WINDOW`` must be done. So RAM holds
   at most the chunk being stepped (with its fp32 temporaries, as in memory), the chunk read
   ahead, and ``WINDOW`` chunks being written: a bounded window of buckets, whatever the model's
   size. Anything else that read the tier (a checkpoint, ``adopt_param_writes``) is dropped from
   the process when it is done (``release``).

*Exact.* The step computes on the same values in the same order as in RAM; only where the bytes
rest between uses differs, so an offloaded run ends bitwise where the same run in memory ends
(tests/test_offload.py, in each sharding mode).

*Sized before the first step.* Each chunk's region is reserved when the optimizer is built:
its masters, and the state its optimizer class keeps for its pieces under their groups'
options and ``state_dtype`` (``kinds.state_bytes``, the estimate ``distopt memory`` prints),
each tensor aligned to 64 bytes. ``posix_fallocate`` reserves the whole file then, so a disk
too small is an error at construction, agreed on every rank before any collective, and no step
can run out of room half-way. A class whose state distopt does not know is refused.

*The file* is unlinked as soon as it is mapped: it lives as long as the process, even one
that crashes, and never outlives it. It holds scratch, not a checkpoint: save with
``distopt.save_checkpoint`` (which reads the tier like memory) to keep a run.

On a GPU the same window would stream state between pinned host memory and the device, the
copies on their own stream; distopt's offload runs on the CPU today (refused elsewhere).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..host_memory import _libc
from ..parallel.dtensor import local_tensor
from .kinds import state_bytes, state_keys

WINDOW = 2
"""Chunks whose write to the file may still be running when another chunk is stepped."""
ALIGN = 64
"""Every offloaded tensor starts on a multiple of this many bytes (any dtype's alignment)."""
PAGE = mmap.PAGESIZE

_MADV_DONTNEED = 4
_SYNC_FILE_RANGE = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: this range, on disk


def align(nbytes: int, to: int = ALIGN) -> int:
    return -(-nbytes // to) * to


class OffloadError(ValueError):
    """The offload tier cannot be set up (no directory, no room): raised before any step."""


class OffloadTier:
    """One rank's file of offloaded tensors, one region per step chunk."""

    def __init__(self, directory: str | os.PathLike[str], name: str,
                 region_bytes: Sequence[int], device: torch.device) -> None:
        """Reserve ``region_bytes[i]`` (rounded up to pages) for chunk ``i`` in a new file
        ``name`` under ``directory``; raises ``OffloadError`` naming the problem and the fix."""
        if device.type != "cpu":
            raise OffloadError(
                f"offload_dir= keeps the state in a file for a step on the CPU; these params "
                f"are on {device}: train on the CPU, or drop offload_dir")
        directory = Path(directory)
        if not directory.is_dir():
            raise OffloadError(
                f"offload_dir={str(directory)!r} is not a directory on this rank: create it "
                "(on a local disk, NVMe for speed) or pass one that exists")
        self.directory = directory
        self.regions: list[tuple[int, int]] = []  # (offset, bytes) per chunk
        offset = 0
        for nbytes in region_bytes:
            size = align(nbytes, PAGE)
            self.regions.append((offset, size))
            offset += size
        self.nbytes = offset
        path = directory / name
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise OffloadError(
                f"offload_dir={str(directory)!r}: cannot create {path.name} there "
                f"({error.strerror}): pass a directory this process may write") from error
        try:
            if self.nbytes:
                os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as error:
            os.close(self._fd)
            path.unlink(missing_ok=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
                raise OffloadError(
                    f"offload_dir={str(directory)!r} has {free / 2**30:.2f} GiB free, and this "
                    f"rank's tier needs {self.nbytes / 2**30:.2f} GiB (every rank on the disk "
                    "needs as much; `distopt memory --offload` predicts it): free space, or "
                    "pass a larger disk") from error
            raise OffloadError(f"offload_dir={str(directory)!r}: cannot reserve "
                               f"{self.nbytes} bytes ({error.strerror})") from error
        self._map = (mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE) if self.nbytes else None)
        path.unlink()  # the mapping and the descriptor keep it: see [Note: the offload tier]
        weakref.finalize(self, os.close, self._fd)
        self._base = (torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None
                      else torch.empty(0, dtype=torch.uint8))
        self._used = [0] * len(self.regions)  # bytes handed out of each region
        self._slots: dict[tuple[int, str], torch.Tensor] = {}  # (id of main, key) -> view
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="distopt-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="distopt-offload-write")
        self._written: dict[int, Future[None]] = {}
        self._read: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0
        self.bytes_read = 0

    # ------------------------------------------------------------------ placing tensors

    def allocate(self, chunk: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new view of ``shape`` and ``dtype`` in chunk ``chunk``'s region (zeros at first)."""
        offset, size = self.regions[chunk]
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        start = self._used[chunk]
        if start + nbytes > size:
            raise RuntimeError(
                f"the offload tier reserved {size} bytes for step chunk {chunk} and its state "
                f"needs more ({start + nbytes}); the estimate of its optimizer's state is short "
                "(distopt.optim.kinds.state_bytes): report it, and train without offload_dir")
        self._used[chunk] = align(start + nbytes)
        view = self._base[offset + start: offset + start + nbytes]
        return view.view(dtype).view(tuple(shape))

    def place_state(self, chunk: int, mains: Sequence[nn.Parameter],
                    state: Any) -> None:
        """Make every state tensor of ``mains`` (step counters aside) a view of the tier,
        copying those that are not yet; see [Note: the offload tier]."""
        for main in mains:
            entries = state.get(main)
            if not entries:
                continue
            for key, value in list(entries.items()):
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                slot = self._slots.get((id(main), key))
                if slot is None or slot.dtype != value.dtype or slot.shape != value.shape:
                    slot = self.allocate(chunk, value.shape, value.dtype)
                    self._slots[id(main), key] = slot
                if slot.data_ptr() != value.data_ptr():
                    slot.copy_(value)
                    entries[key] = slot

    # ------------------------------------------------------------------ moving pages

    def read_ahead(self, chunk: int) -> None:
        """Start reading chunk ``chunk`` into the page cache, if not started."""
        if 0 <= chunk < len(self.regions) and chunk not in self._read:
            self._read[chunk] = self._reader.submit(self._advise_read, chunk)

    def before_step(self, chunk: int) -> None:
        """Chunk ``chunk`` is about to be stepped: its read started, the next one's too, and
        the window's oldest write done."""
        self.read_ahead(chunk)
        self.read_ahead(chunk + 1)
        for done in [c for c in self._written if c <= chunk - WINDOW or c == chunk]:
            self._written.pop(done).result()

    def after_step(self, chunk: int, mains: Sequence[nn.Parameter], state: Any) -> None:
        """Chunk ``chunk`` was stepped: its state into the tier, its pages out of the
        process, and their write to the file started."""
        self.place_state(chunk, mains, state)
        self._read.pop(chunk, None)
        offset, size = self.regions[chunk]
        self._drop_from_process(offset, size)
        self._written[chunk] = self._writer.submit(self._write_back, chunk)

    def finish_step(self) -> None:
        """After the step: the reads of chunks not stepped (none, or the last read ahead)
        forgotten; the writes go on in the background, waited for by the next step."""
        self._read.clear()

    def release(self) -> None:
        """Drop every page of the tier from the process (after a checkpoint or another
        reader touched it); the written ones reach the file as the kernel writes them."""
        if self.nbytes:
            self._drop_from_process(0, self.nbytes)

    def wait(self) -> None:
        """Every write started so far is on the file."""
        for chunk in list(self._written):
            self._written.pop(chunk).result()

    def storage_key(self) -> int:
        """The data pointer of the storage every offloaded tensor is a view of."""
        return self._base.untyped_storage().data_ptr()

    def disk_bytes(self) -> int:
        """Bytes the file takes on the disk."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        """Wait for the writes and stop the threads (the file goes with the tier)."""
        self.wait()
        self._reader.shutdown()
        self._writer.shutdown()

    def _drop_from_process(self, offset: int, size: int) -> None:
        libc = _libc()
        address = self._base.data_ptr() + offset
        if libc is None or libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size),
                                        _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the tier")

    def _advise_read(self, chunk: int) -> None:
        offset, size = self.regions[chunk]
        os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_WILLNEED)
        with self._lock:
            self.bytes_read += size

    def _write_back(self, chunk: int) -> None:
        offset, size = self.regions[chunk]
        libc = _libc()
        sync_range = None if libc is None else getattr(libc, "sync_file_range", None)
        if sync_range is None or sync_range(self._fd, ctypes.c_int64(offset),
                                            ctypes.c_int64(size), _SYNC_FILE_RANGE) != 0:
            os.fdatasync(self._fd)
        os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_written += size


def master_bytes_per_element(param_dtype: torch.dtype, store_remainders: bool) -> int:
    """Bytes the masters take per element apart from the params: int16 remainders, an fp32
    copy of bf16/fp16 params, nothing for fp32 params (their own masters)."""
    return 2 if store_remainders else 0 if param_dtype == torch.float32 else 4


StateOptions = tuple[type[torch.optim.Optimizer] | None, dict[str, Any]]
"""The class that steps a model param and its group's options (None: no group steps it)."""


def region_bytes(buffers: Sequence[Any], *, sharded: bool, store_remainders: bool,
                 stepped_by: dict[nn.Parameter, StateOptions],
                 whole_params: frozenset[nn.Parameter], state_dtypes: dict[str, torch.dtype],
                 block_size: int) -> list[int]:
    """The bytes each step chunk (each bucket's shard of each buffer, in the step's order)
    reserves in the tier: its masters and its pieces' state, each tensor aligned; see
    [Note: the offload tier]. Raises ``OffloadError`` for a class whose state is unknown."""
    sizes = []
    for buffer in buffers:
        regions = [b.param_shard if sharded else b.param_data for b in buffer.buckets]
        master_bytes = master_bytes_per_element(buffer.param_dtype, store_remainders)
        per_bucket = [align(r.numel() * master_bytes) for r in regions]
        pieces = (buffer.layout.shard_pieces(buffer.dp_rank) if sharded
                  else buffer.layout.whole_pieces())
        for piece in pieces:
            param = buffer.params[piece.param_index]
            cls, options = stepped_by.get(param, (None, {}))
            if cls is None:
                continue
            keys = state_keys(cls)
            if keys is None:
                raise OffloadError(
                    f"offload_dir= reserves each bucket's optimizer state before the first step, "
                    f"and distopt does not know what {cls.__name__} keeps: train it without "
                    "offload_dir, or use an optimizer class whose state distopt knows "
                    "(torch.optim's)")
            shape = (tuple(local_tensor(param).shape) if param in whole_params
                     else (piece.param_range.size,))
            tensors = 2 * len(keys) + 2  # values and block exponents, matrix statistics
            per_bucket[piece.bucket] += align(int(state_bytes(
                cls, shape, options, state_dtypes, block_size))) + ALIGN * tensors
        sizes += per_bucket
    return sizes
