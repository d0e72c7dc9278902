"""Stateless wrappers around the torch.distributed collectives distopt issues.

Each takes the process group explicitly, skips communication when the group has one rank (so
world size 1 runs the same code), and records what it sent in an optional ``CommStats``, so
tests and benchmarks can count collectives and bytes instead of guessing them.

[Note: collectives on gloo]
Gloo has no reduce-scatter of its own: torch's gloo backend clones the input, all-reduces the
clone and copies one chunk out, so a reduce-scatter there costs a whole all-reduce plus two
copies; its all-gather goes through a temporary output and a copy, and composing either from
per-chunk ``reduce`` or ``broadcast`` calls costs one ring collective per rank. On gloo distopt
therefore builds both from point-to-point messages, which gloo sends straight between the
ranks' buffers: in the reduce-scatter each rank sends chunk j of the bucket to rank j and
receives the d - 1 others' copies of its own chunk into a temporary of (d - 1)/d of the bucket,
which it adds to its chunk and divides by d once they have all arrived; in the all-gather each
rank sends its chunk to every other rank and receives theirs in place. Each rank sends (d-1)/d
of the bucket in each, so the two together move exactly one all-reduce's worth of bytes, as on
NCCL. Only the owned chunk of a reduced bucket is meaningful afterwards. On a 2-core machine
each takes about half the time of gloo's own reduce-scatter or all-gather
(``distopt bench --collectives``; see benchmarks/README.md). Each blocking wait costs a
wake-up of gloo's thread and a round trip to the peer, so a caller with several buckets starts
all of their collectives before waiting for any (``finish_grad_sync``, ``start_param_sync``):
waited for one by one, the MLP benchmark's 8 buckets' gathers took 1.8-4.3x as long as started
together (benchmarks/bucket_collectives.py).

[Note: fp32-accumulated reduce-scatter]
A reduce-scatter of bf16 or fp16 grads sums in their dtype: a ring (NCCL) rounds the partial
sum at each of its d - 1 hops, and the point-to-point version on gloo after each chunk it adds.
The error of the average therefore grows with d, and most where the ranks' grads cancel: a
partial sum can be far larger than the final one, and its roundings then swamp the result.
With ``reduce_scatter_with_fp32_accumulation`` the grads still travel in their own dtype (the
same bytes as the plain reduce-scatter), but the summation moves to the receiver: each rank
receives the d copies of its own chunk (one ``all_to_all_single``; on gloo the point-to-point
messages above), adds them in fp32 in rank order 0, 1, ..., d - 1, divides the fp32 sum by d,
and rounds once into its shard. The division happens in fp32, before that one rounding:
dividing each chunk by d before sending would round every term (unless d is a power of two),
and dividing the rounded sum would round twice. So the shard is exactly
``(sum_r float(chunk_r) / d).to(grad dtype)``, the correctly rounded fp32 average: within half
an ulp of the grads' dtype of the exact average, plus the fp32 sum's own error (d - 1 fp32
roundings, 2**16 times finer than bf16's). Summing in rank order makes the result the same on
every backend and whichever rank owns the chunk, so it can be recomputed exactly. With fp16
grads the sum no longer overflows where the average fits. The price is a transient per bucket
in flight, freed when its reduction is waited for: the received chunks in the grads' dtype
(the whole bucket with ``all_to_all_single``, (d - 1)/d of it on gloo) and an fp32 accumulator
of one shard.

On a hierarchical mesh (see [Note: hierarchical data parallelism] in parallel/groups.py) the reduced
chunk is then averaged over the r replicas, and a plain all-reduce of it would sum in bf16 again
(a ring rounds at each of its hops, and with one rank per shard group nothing was summed in fp32
at all). With the option that second stage is ``all_reduce_avg_fp32_accum``: every replica
gathers the r rounded chunks and adds them in fp32 in replica order, divides by r and rounds
once. The average is thus rounded once per stage, twice in all (once when the shard group is
one rank), whatever d; exactly ``fp32 average over replicas of (fp32 average over the shard
group, rounded)``, the same on every rank. Keeping the first stage's fp32 sums unrounded would
double the bytes that cross nodes. The gather sends r - 1 chunks per rank, the bytes of the
ring all-reduce at r = 2 and r/2 times them beyond, with a transient of r - 1 received chunks.

[Note: a stuck rank]
A rank that stops (SIGSTOP, a hang, a dead host) leaves its peers waiting in the next
collective. On gloo every wait is bounded by the process group's timeout
(``init_process_group(timeout=...)``, ``distopt train --timeout``); the waits on bucket
collectives and control values run inside ``failures_named``, so what the timeout raises is a
``CollectiveError`` that names the collective, the bucket and the seconds waited, not gloo's bare
"Timed out waiting ... for recv". On NCCL the watchdog aborts the process after the timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the single-tensor collectives; keep working on the older names. Looked
# up at call time, so that wrappers installed later (benchmarks counting peers' collectives)
# see them.
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else (
    "reduce_scatter_tensor"
)
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else (
    "all_gather_into_tensor"
)


# gloo matches point-to-point messages by (peer, tag) in the order they were posted. Tags of
# distopt's own keep its reductions, its gathers and a user's own messages on the same group
# from ever matching each other.
_GATHER_TAG = 0x6469
_REDUCE_TAG = 0x6470


class CollectiveError(dist.DistBackendError):
    """A collective that failed or timed out on this rank, named with what it was moving."""


@contextlib.contextmanager
def failures_named(op: str, what: str) -> Iterator[None]:
    """Re-raise a failure of collective ``op`` on ``what`` (e.g. "bucket 3 (4096 fp32
    elements)") as a CollectiveError naming both; see [Note: a stuck rank]."""
    start = time.monotonic()
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"{op} of {what} failed on rank {rank} after {time.monotonic() - start:.1f} s: "
            f"{exc}. Another rank stopped, hung or died before this collective; the process "
            "group's timeout (init_process_group(timeout=...), distopt train --timeout) bounds "
            "the wait"
        ) from exc


class _Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


@dataclass(slots=True)
class CommStats:
    """What distopt's collectives did: calls, bytes and, when ``timed``, seconds of waiting.

    Every DDP wrapper owns one (``ddp.comm_stats``) and passes it to each collective it issues,
    so tests and benchmarks count and time communication through this object alone. ``bytes``
    is the size of the full (unsharded) tensor each call covered. With ``timed`` set, each op
    also adds to ``seconds`` the time this rank spent blocked on it: a synchronous call's whole
    duration, an asynchronous one's ``wait()``; ``synchronize`` (e.g. ``torch.cuda.synchronize``)
    is called before the clock stops, so that device time is counted too. Off by default: the
    hot path then only checks one flag.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    timed: bool = False
    synchronize: Callable[[], Any] | None = None

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()

    def _stop_clock(self, op: str, start: float) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.seconds[op] += time.perf_counter() - start


class _TimedWait:
    """A handle whose ``wait()`` adds the time it blocked to ``stats.seconds[op]``."""

    __slots__ = ("_handle", "_stats", "_op")

    def __init__(self, handle: Any, stats: CommStats, op: str) -> None:
        self._handle, self._stats, self._op = handle, stats, op

    def wait(self) -> Any:
        start = time.perf_counter()
        result = self._handle.wait()
        self._stats._stop_clock(self._op, start)
        return result

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def _timed(stats: CommStats | None, op: str, async_op: bool, call: Callable[[], Any]) -> Any:
    """Run ``call`` (which issues collective ``op``) and time it when ``stats.timed``."""
    if stats is None or not stats.timed:
        return call()
    start = time.perf_counter()
    handle = call()
    if not async_op:
        stats._stop_clock(op, start)
        return handle
    return _TimedWait(handle, stats, op)


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` has several ranks and communicates over gloo."""
    return group_size(group) > 1 and dist.get_backend(group) == "gloo"


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def reduce_scatter_avg(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
):
    """Average ``full`` over the group into this rank's chunk ``shard`` (may alias ``full``)."""
    return _reduce_scatter(shard, full, group, async_op, stats,
                           gloo=_gloo_reduce_scatter_avg, other=_backend_reduce_scatter_avg)


def reduce_scatter_avg_fp32_accum(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
):
    """``reduce_scatter_avg`` of bf16 or fp16 ``full`` with the d chunks of this rank's
    ``shard`` summed in fp32 and the average rounded once; see
    [Note: fp32-accumulated reduce-scatter]. Counted as a reduce-scatter of ``full``."""
    return _reduce_scatter(shard, full, group, async_op, stats,
                           gloo=_gloo_reduce_scatter_fp32, other=_all_to_all_reduce_scatter_fp32)


def _reduce_scatter(shard, full, group, async_op: bool, stats: CommStats | None, *, gloo, other):
    # What every reduce-scatter shares: nothing to send on one rank, counting, timing.
    if group_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full)
        return DONE
    if stats is not None:
        stats.record("reduce_scatter", full)
    implementation = gloo if is_gloo(group) else other
    call = lambda: implementation(shard, full, group, async_op=async_op)
    return _timed(stats, "reduce_scatter", async_op, call)


def _backend_reduce_scatter_avg(shard, full, group, *, async_op: bool):
    return getattr(dist, _REDUCE_SCATTER)(
        shard, full, op=dist.ReduceOp.AVG, group=group, async_op=async_op
    )


def all_reduce_avg(
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
    op: str = "all_reduce",
):
    """Average ``full`` in place over the group; ``op`` names it in ``stats``."""
    if group_size(group) == 1:
        return DONE
    if stats is not None:
        stats.record(op, full)
    call = lambda: dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    return _timed(stats, op, async_op, call)


def all_gather(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
):
    """Gather every rank's ``shard`` into ``full`` (``shard`` may be this rank's chunk of it)."""
    if group_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        return DONE
    if stats is not None:
        stats.record("all_gather", full)
    if is_gloo(group):
        call = lambda: _gloo_all_gather(full, shard, group, async_op=async_op)
    else:
        call = lambda: getattr(dist, _ALL_GATHER)(full, shard, group=group, async_op=async_op)
    return _timed(stats, "all_gather", async_op, call)


def all_reduce_avg_fp32_accum(
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
    op: str = "all_reduce",
):
    """``all_reduce_avg`` of bf16 or fp16 ``full`` with the r copies of the group summed in
    fp32 in rank order and the average rounded once, the same bits on every rank. Each rank
    gathers the others' copies: it sends r - 1 copies' bytes, as much as a ring all-reduce
    (2 (r - 1)/r) at r = 2, r/2 times as much beyond. See
    [Note: fp32-accumulated reduce-scatter]; ``op`` names it in ``stats``."""
    if group_size(group) == 1:
        return DONE
    if stats is not None:
        stats.record(op, full)
    implementation = _gloo_all_reduce_fp32 if is_gloo(group) else _all_gather_all_reduce_fp32
    call = lambda: implementation(full, group, async_op=async_op)
    return _timed(stats, op, async_op, call)


def _all_gather_all_reduce_fp32(full, group, *, async_op: bool):
    # Row r of ``received`` is rank r's copy.
    size = group_size(group)
    received = torch.empty(size * full.numel(), dtype=full.dtype, device=full.device)
    work = getattr(dist, _ALL_GATHER)(received, full, group=group, async_op=True)
    rows = list(received.view(size, -1))
    return _Composite([work], lambda: _average_in_fp32(full, rows)).finish(async_op)


def _gloo_all_reduce_fp32(full, group, *, async_op: bool):
    # See [Note: collectives on gloo]: this rank's copy to every peer, theirs into ``received``.
    size, rank = group_size(group), group_rank(group)
    received = torch.empty((size - 1, full.numel()), dtype=full.dtype, device=full.device)
    works, rows = [], []
    for peer in range(size):
        if peer == rank:
            rows.append(full)
            continue
        row = received[peer if peer < rank else peer - 1]
        works.append(dist.isend(full, group_dst=peer, group=group, tag=_REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=_REDUCE_TAG))
        rows.append(row)
    # ``full`` is overwritten only after every send of it has completed.
    return _Composite(works, lambda: _average_in_fp32(full, rows)).finish(async_op)


class _Composite:
    """Handle of several collectives, with a last local step run once all have finished."""

    __slots__ = ("_works", "_then")

    def __init__(self, works: list, then=None) -> None:
        self._works, self._then = works, then

    def wait(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def finish(self, async_op: bool) -> _Composite | None:
        """The handle for an async call; a synchronous one waits now and returns None, as
        torch.distributed does."""
        if async_op:
            return self
        self.wait()
        return None


def _gloo_reduce_scatter_avg(shard, full, group, *, async_op: bool):
    # See [Note: collectives on gloo]. A bucket's numel is a multiple of d (layout/elementwise.py).
    size, rank = group_size(group), group_rank(group)
    chunks = full.chunk(size)
    mine = chunks[rank]
    received = torch.empty((size - 1, mine.numel()), dtype=full.dtype, device=full.device)
    works = []
    peers = [peer for peer in range(size) if peer != rank]
    for row, peer in zip(received, peers, strict=True):
        works.append(dist.isend(chunks[peer], group_dst=peer, group=group, tag=_REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=_REDUCE_TAG))

    def average() -> None:
        if shard.data_ptr() != mine.data_ptr():
            shard.copy_(mine)
        for row in received:
            shard.add_(row)
        shard.div_(size)

    return _Composite(works, average).finish(async_op)


def _average_in_fp32(shard: torch.Tensor, chunks: list[torch.Tensor]) -> None:
    # See [Note: fp32-accumulated reduce-scatter]: sum in rank order, divide, round once.
    total = chunks[0].to(torch.float32, copy=True)
    for chunk in chunks[1:]:
        total.add_(chunk)
    shard.copy_(total.div_(len(chunks)))


def _all_to_all_reduce_scatter_fp32(shard, full, group, *, async_op: bool):
    # Row r of ``received`` is rank r's copy of this rank's chunk. The bucket's numel is a
    # multiple of d (layout/elementwise.py).
    size = group_size(group)
    received = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    work = dist.all_to_all_single(received, full, group=group, async_op=True)
    rows = list(received.view(size, -1))
    return _Composite([work], lambda: _average_in_fp32(shard, rows)).finish(async_op)


def _gloo_reduce_scatter_fp32(shard, full, group, *, async_op: bool):
    # The messages of _gloo_reduce_scatter_avg; only the summation differs.
    size, rank = group_size(group), group_rank(group)
    chunks = full.chunk(size)
    received = torch.empty((size - 1, chunks[rank].numel()), dtype=full.dtype,
                           device=full.device)
    works, rows = [], []
    for peer in range(size):
        if peer == rank:
            rows.append(chunks[rank])
            continue
        row = received[peer if peer < rank else peer - 1]
        works.append(dist.isend(chunks[peer], group_dst=peer, group=group, tag=_REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=_REDUCE_TAG))
        rows.append(row)
    return _Composite(works, lambda: _average_in_fp32(shard, rows)).finish(async_op)


def _gloo_all_gather(full, shard, group, *, async_op: bool):
    # See [Note: collectives on gloo].
    size, rank = group_size(group), group_rank(group)
    chunks = full.chunk(size)
    mine = chunks[rank]
    if shard.data_ptr() != mine.data_ptr():
        mine.copy_(shard)
    works = []
    for peer in range(size):
        if peer != rank:
            works.append(dist.isend(mine, group_dst=peer, group=group, tag=_GATHER_TAG))
            works.append(dist.irecv(chunks[peer], group_src=peer, group=group, tag=_GATHER_TAG))
    return _Composite(works).finish(async_op)


def broadcast_from_first_ranks(
    tensors: list[torch.Tensor], groups: list[dist.ProcessGroup | None]
) -> None:
    """Give every rank the values of ``tensors`` on the rank at coordinate 0 of every group,
    going through the groups last to first (replicate group, then shard group)."""
    for group in reversed(groups):
        if group_size(group) == 1:
            continue
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=src, group=group)


def broadcast_coalesced(
    tensors: list[torch.Tensor],
    groups: list[tuple[str, dist.ProcessGroup | None]],
    stats: CommStats | None = None,
) -> None:
    """``broadcast_from_first_ranks`` with one broadcast per dtype and group instead of one per
    tensor: the tensors of each dtype travel in one flat copy, copied back into them once it
    has arrived. ``groups`` are (name, group) in the order to go through them; the name is the
    op counted in ``stats``."""
    groups = [(op, group) for op, group in groups if group_size(group) > 1]
    if not groups or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:  # the same order on every rank: the model check compared them
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            alone = len(same_dtype) == 1 and same_dtype[0].is_contiguous()
            flat = (same_dtype[0].view(-1) if alone
                    else torch.cat([t.reshape(-1) for t in same_dtype]))
            for op, group in groups:
                if stats is not None:
                    stats.record(op, flat)
                with failures_named("broadcast", f"{len(same_dtype)} {flat.dtype} tensors "
                                                 f"({flat.numel()} elements)"):
                    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
            if not alone:
                for tensor, arrived in zip(same_dtype, flat.split([t.numel() for t in same_dtype]),
                                           strict=True):
                    tensor.copy_(arrived.view_as(tensor))


def all_reduce_small(
    tensor: torch.Tensor,
    op: dist.ReduceOp,
    groups: list[dist.ProcessGroup | None],
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Reduce a small control tensor (a norm, a flag) in place over each group in turn."""
    for group in groups:
        if group_size(group) > 1:
            if stats is not None:
                stats.record("all_reduce_small", tensor)
            with failures_named("all_reduce", f"a control value ({tensor.numel()} elements)"):
                dist.all_reduce(tensor, op=op, group=group)
    return tensor


# ---------------------------------------------------------------------- small Python objects


def broadcast_object(obj: object, group: dist.ProcessGroup | None) -> object:
    """The group's first rank's ``obj``, on every rank of ``group`` (pickled: for small
    control values such as a verdict or a path)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every rank's ``obj``, in group rank order (pickled: for small control values)."""
    if group_size(group) == 1:
        return [obj]
    gathered: list[object] = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
