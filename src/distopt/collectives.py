"""Stateless wrappers around the torch.distributed collectives distopt issues.

Each takes the process group explicitly, skips communication when the group has one rank (so
world size 1 runs the same code), and records what it sent in an optional ``CommStats``, so
tests and benchmarks can count collectives and bytes instead of guessing them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the single-tensor collectives; keep working on the older names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


@dataclass(slots=True)
class CommStats:
    """Counts of collectives issued and the bytes of the full (unsharded) tensor each covered."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


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
    if group_size(group) == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full)
        return DONE
    if stats is not None:
        stats.record("reduce_scatter", full)
    return _reduce_scatter(shard, full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


def all_reduce_avg(
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool,
    stats: CommStats | None = None,
):
    """Average ``full`` in place over the group."""
    if group_size(group) == 1:
        return DONE
    if stats is not None:
        stats.record("all_reduce", full)
    return dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)


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
    return _all_gather(full, shard, group=group, async_op=async_op)


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
            dist.all_reduce(tensor, op=op, group=group)
    return tensor
