"""Async saves: the writer thread, the one save in flight, and the handle the caller gets.

[Note: async saves]
``save_checkpoint(..., async_save=True)`` does on the calling thread what must see the state as
it is: the checks, rank 0's preparation of the temporary directory, and the copy of what this
rank writes into its staging buffer ([Note: async staging] in staging.py). It then returns an
``AsyncCheckpoint`` while a writer thread does the rest, exactly as a synchronous save does it:
DCP writes the staged tensors, the ranks agree on every rank's outcome, rank 0 commits
([Note: atomic checkpoints], [Note: failed saves] in files.py). So ``latest`` moves only once
every rank's files are complete, and a crash, a full disk or a lost rank during the write
leaves the previous checkpoint the latest; the next save removes the debris.

Why a thread running DCP's synchronous ``save`` rather than ``dcp.async_save``: the background
work is more than DCP's write. The agreement and the commit must follow it in the background
too, or ``latest`` would wait for the training loop to come back and publish it, and
``async_save`` returns a future of the write alone (its thread runs ``dcp.save`` and nothing
after it). Its default stager copies every tensor into storages it caches per source storage,
which for distopt's views of the param and state buffers would mean copies of whole buffers;
distopt stages its own parts. Its process executor would add a process per rank, a second
process group to rendezvous and shared-memory transfers, for work that spends its time in file
writes, fsyncs and CRC32s, which release the GIL.

The thread's collectives go over a process group of their own, gloo over the same ranks
(``writer_group``), created once per set of ranks: collectives issued by two threads on one
group could pair differently on different ranks, and the training loop keeps using its groups
meanwhile. With NCCL training, gloo is also the CPU backend DCP's planning needs.

[Note: writer groups]
A writer group over every rank (pipelined, tensor-parallel and hierarchical models, and a DP
group that is the world) is made by every rank, as any ``new_group``: torch names it after the
count of groups made so far, which every rank advances alike, members or not. A writer group
over a proper subset (the DP group of a model-parallel layout) is made by its ranks alone
(``use_local_synchronization``), and torch names such a group after its ranks and the number
of groups the rank belongs to. That number differs between ranks that joined different
subgroups before, as the group of a tie held by some pipeline stages only (the first and last
of four: [Note: tied stage params] in optim/tied.py), and ranks with different names for one
group wait for each other until the timeout: over every rank, the local path is not taken.

At most one save is in flight in a process. A save (or a load) that finds one waits for it
before it starts: skipping would silently drop a checkpoint the caller asked for (the last one
of a run, or the one before a preemption), and waiting keeps one staging buffer's worth of
memory and the order of the checkpoints. The time waited is reported on the new handle
(``waited_s``); a save that waits often is saving more often than the disk can write.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .files import CheckpointError


class AsyncCheckpoint:
    """A checkpoint that ``save_checkpoint(..., async_save=True)`` is writing in the background.

    ``wait()`` returns its directory once every rank's write is complete and ``latest`` names
    it, or raises the ``CheckpointError`` of a save that could not complete (the same on every
    rank when the ranks could agree on it; nothing of it is kept). Wait for it before the
    process group is destroyed.

    ``save_checkpoint`` makes it; a program only reads it.

    Args:
        path: the checkpoint directory the save is published as (``path`` below).
        waited_s: seconds the save waited for the save in flight before it (``waited_s``
            below).
    """

    def __init__(self, path: Path, waited_s: float) -> None:
        self.path = path
        """The checkpoint directory it is published as."""
        self.waited_s = waited_s
        """Seconds the save waited for the save in flight before it."""
        self.stall_s = 0.0
        """Seconds the ``save_checkpoint`` call held the caller, waiting included."""
        self._future: Future[Path] = Future()
        self._observed = False

    def done(self) -> bool:
        """Whether the background write has ended (published or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """The published checkpoint's directory; raises CheckpointError if the save failed,
        TimeoutError if it is still being written after ``timeout`` seconds (None, the
        default: wait as long as it takes)."""
        try:
            path = self._future.result(timeout)
        except CheckpointError:
            self._observed = True
            raise
        self._observed = True
        return path

    def __repr__(self) -> str:
        state = "in flight" if not self.done() else (
            "failed" if self._future.exception() else "published")
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


_in_flight: AsyncCheckpoint | None = None
_writer_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


def wait_for_in_flight() -> float:
    """Wait for the save in flight in this process, if any; return the seconds waited. Its
    failure stays its handle's to raise, with a warning if nobody has looked at it."""
    global _in_flight
    pending, start = _in_flight, time.perf_counter()
    if pending is None:
        return 0.0
    observed = pending._observed
    try:
        pending.wait()
    except CheckpointError as error:
        pending._observed = observed  # seen here, not by the caller
        if not observed:
            warnings.warn(f"the async save of {pending.path} failed: {error}", stacklevel=3)
    _in_flight = None
    return time.perf_counter() - start


def writer_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of ``group``, for the writer threads; one per set of ranks
    (created by the first async save over them, collectively)."""
    if group is None:
        return None
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(world), ranks)
    if key not in _writer_groups:
        # Over every rank, every rank makes it and all name it alike: [Note: writer groups].
        local = len(ranks) < dist.get_world_size()
        # The world is kept with its group, so that its id names it while the entry exists.
        _writer_groups[key] = (world, dist.new_group(
            list(ranks), timeout=_timeout_of(group), backend="gloo",
            use_local_synchronization=local))
    return _writer_groups[key][1]


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group``'s collectives wait for a peer, for the writer group to wait as
    long (a lost peer fails the write within it); None where torch does not say."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def start(handle: AsyncCheckpoint, work: Callable[[], Path], failed: Callable[[Exception], str]
          ) -> AsyncCheckpoint:
    """Run ``work`` (write, agree, commit) on a writer thread; ``failed`` words an error that
    ``work`` did not turn into a CheckpointError (a peer lost mid-write)."""
    global _in_flight

    def run() -> None:
        try:
            handle._future.set_result(work())
        except CheckpointError as error:
            handle._future.set_exception(error)
        except Exception as error:  # a lost peer, a broken group: say what is kept
            handle._future.set_exception(CheckpointError(failed(error)))

    # Not a daemon: a process that ends while a save is in flight finishes it first.
    threading.Thread(target=run, name=f"distopt-checkpoint-{handle.path.name}").start()
    _in_flight = handle
    return handle
