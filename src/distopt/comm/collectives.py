"""Stateless wrappers around the torch.distributed collectives distopt issues.

Each takes the process group explicitly, skips communication when the group has one rank (so
world size 1 runs the same code), and records what it sent in an optional ``CommStats``, so
tests and benchmarks can count collectives and bytes instead of guessing them. On gloo the
reduce-scatter, the all-gather and the fp32-summed all-reduce are distopt's own, built from
point-to-point messages (gloo.py, [Note: collectives on gloo]); the fp32 sums of the other
backends are in sums.py; failures are named by errors.py ([Note: a stuck rank]).

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

On a hierarchical mesh (see [Note: hierarchical data parallelism] in parallel/process_groups.py) the
reduced chunk is then averaged over the r replicas, and a plain all-reduce of it would sum in bf16
again (a ring rounds at each of its hops, and with one rank per shard group nothing was summed in
fp32 at all). With the option that second stage is ``all_reduce_avg_fp32_accum``: every replica
gathers the r rounded chunks and adds them in fp32 in replica order, divides by r and rounds once.
The average is thus rounded once per stage, twice in all (once when the shard group is one rank),
whatever d; exactly ``fp32 average over replicas of (fp32 average over the shard group, rounded)``,
the same on every rank. Keeping the first stage's fp32 sums unrounded would double the bytes that
cross nodes. The gather sends r - 1 chunks per rank, the bytes of the ring all-reduce at r = 2 and
r/2 times them beyond, with a transient of r - 1 received chunks.
"""


from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import gate, gloo, sums
from .errors import CollectiveError, failures_named
from .handles import DONE
from .stats import CommStats, timed

__all__ = [
    "DONE", "CollectiveError", "CommStats", "all_gather", "all_gather_object",
    "all_gather_small", "all_reduce_avg",
    "all_reduce_avg_fp32_accum", "all_reduce_small", "broadcast_coalesced",
    "broadcast_from_first_ranks", "broadcast_object", "failures_named", "group_rank",
    "group_size", "is_gloo", "reduce_scatter_avg", "reduce_scatter_avg_fp32_accum",
]

# torch >= 2.10 renamed the single-tensor collectives; keep working on the older names. Looked
# up at call time, so that wrappers installed later (benchmarks counting peers' collectives)
# see them.
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else (
    "reduce_scatter_tensor"
)
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else (
    "all_gather_into_tensor"
)


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
                           on_gloo=gloo.reduce_scatter_avg, elsewhere=_backend_reduce_scatter_avg)


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
                           on_gloo=gloo.reduce_scatter_avg_fp32,
                           elsewhere=sums.all_to_all_reduce_scatter_fp32)


def _reduce_scatter(shard, full, group, async_op: bool, stats: CommStats | None, *,
                    on_gloo, elsewhere):
    # What every reduce-scatter shares: nothing to send on one rank, counting, timing.
    gate.settle()
    if group_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full)
        return DONE
    if stats is not None:
        stats.record("reduce_scatter", full, group)
    implementation = on_gloo if is_gloo(group) else elsewhere
    call = lambda: implementation(shard, full, group, async_op=async_op)
    return timed(stats, "reduce_scatter", async_op, call)


def _backend_reduce_scatter_avg(shard, full, group, *, async_op: bool):
    return getattr(dist, REDUCE_SCATTER)(
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
    gate.settle()
    if group_size(group) == 1:
        return DONE
    if stats is not None:
        stats.record(op, full, group)
    call = lambda: dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    return timed(stats, op, async_op, call)


def all_gather(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
):
    """Gather every rank's ``shard`` into ``full`` (``shard`` may be this rank's chunk of it)."""
    gate.settle()
    if group_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        return DONE
    if stats is not None:
        stats.record("all_gather", full, group)
    if is_gloo(group):
        call = lambda: gloo.all_gather(full, shard, group, async_op=async_op)
    else:
        call = lambda: getattr(dist, ALL_GATHER)(full, shard, group=group, async_op=async_op)
    return timed(stats, "all_gather", async_op, call)


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
    gate.settle()
    if group_size(group) == 1:
        return DONE
    if stats is not None:
        stats.record(op, full, group)
    implementation = gloo.all_reduce_avg_fp32 if is_gloo(group) else sums.all_gather_all_reduce_fp32
    call = lambda: implementation(full, group, async_op=async_op)
    return timed(stats, op, async_op, call)


def broadcast_from_first_ranks(
    tensors: list[torch.Tensor], groups: list[dist.ProcessGroup | None]
) -> None:
    """Give every rank the values of ``tensors`` on the rank at coordinate 0 of every group,
    going through the groups last to first (replicate group, then shard group)."""
    gate.settle()
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
    gate.settle()
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
                    stats.record(op, flat, group)
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
    gate.settle()
    for group in groups:
        if group_size(group) > 1:
            if stats is not None:
                stats.record("all_reduce_small", tensor, group)
            with failures_named("all_reduce", f"a control value ({tensor.numel()} elements)"):
                dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_small(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Every rank's small 1-D control tensor (a few statistics per param), stacked in the
    group's rank order: ``[group size, numel]``, the same on every rank, so that each rank
    combines them in one order (and a max keeps a nan, which a MAX all-reduce may drop)."""
    out, handle = all_gather_small_async(tensor, group, stats)
    if handle is not None:
        with failures_named("all_gather", f"a control value ({tensor.numel()} elements)"):
            handle.wait()
    return out.view(group_size(group), -1)


def all_gather_small_async(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    op: str = "all_gather_small",
) -> tuple[torch.Tensor, Any]:
    """``all_gather_small`` started and not waited for: ``(out, handle)``, where ``out`` is
    ``[group size * numel]`` in the group's rank order once ``handle.wait()`` returned (a
    handle of None: nothing to wait for). torch's own all-gather, so ordered with the group's
    other collectives apart from distopt's point-to-point ones on gloo (comm/gloo.py)."""
    gate.settle()
    size = group_size(group)
    if size == 1:
        return tensor.clone(), None
    out = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    if stats is not None:
        stats.record(op, out, group)
    with failures_named("all_gather", f"a control value ({tensor.numel()} elements)"):
        handle = timed(stats, op, True, lambda: getattr(dist, ALL_GATHER)(
            out, tensor, group=group, async_op=True))
    return out, handle


# ---------------------------------------------------------------------- small Python objects


def broadcast_object(obj: object, group: dist.ProcessGroup | None) -> object:
    """The group's first rank's ``obj``, on every rank of ``group`` (pickled: for small
    control values such as a verdict or a path)."""
    gate.settle()
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Every rank's ``obj``, in group rank order (pickled: for small control values)."""
    gate.settle()
    if group_size(group) == 1:
        return [obj]
    gathered: list[object] = [None] * group_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
