"""What a whole-tensor layout costs each rank: the optimizer work it owns and the padding its
shards hold, against the bound no assignment can beat. Pure arithmetic; see
[Note: whole-tensor layout] in layout/whole.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .elementwise import BufferLayout


@dataclass(frozen=True, slots=True)
class BalanceReport:
    """What whole-tensor ownership costs in one layout: the optimizer cost each rank owns, and
    the padding each rank's shards hold."""

    dp_size: int
    cost: tuple[float, ...]  # per rank: the whole-tensor cost it owns
    whole_elements: tuple[int, ...]  # per rank: elements of the whole-tensor params it owns
    padding: tuple[int, ...]  # per rank: elements of its shards, all buckets, in no param
    whole_padding: int  # all ranks: padding of the whole-tensor buckets
    param_elements: int  # every parameter's elements
    bound: float  # no assignment gives the busiest rank less: the mean or the largest cost

    @property
    def max_cost(self) -> float:
        return max(self.cost)

    @property
    def mean_cost(self) -> float:
        return sum(self.cost) / self.dp_size

    @property
    def imbalance(self) -> float:
        """Busiest rank's cost over the mean: how much longer the step's whole-tensor work runs
        than with a perfect split (1.0 is perfect)."""
        return self.max_cost / self.mean_cost if self.mean_cost > 0 else 1.0

    @property
    def best_imbalance(self) -> float:
        """The imbalance no assignment can beat (a matrix whose cost exceeds the mean)."""
        return self.bound / self.mean_cost if self.mean_cost > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        """Padding over all elements of the buffer."""
        total_padding = sum(self.padding)
        return total_padding / (self.param_elements + total_padding)

    def format(self) -> str:
        lines = [f"{'rank':>4} {'cost':>14} {'whole elements':>15} {'padding':>10}"]
        for rank in range(self.dp_size):
            lines.append(
                f"{rank:>4} {self.cost[rank]:>14.4g} {self.whole_elements[rank]:>15,d}"
                f" {self.padding[rank]:>10,d}"
            )
        lines.append(
            f"imbalance max/mean {self.imbalance:.4f} (best possible {self.best_imbalance:.4f}),"
            f" padding {sum(self.padding):,d} elements = {self.padding_fraction:.2%} of the"
            f" buffer, {self.whole_padding:,d} in whole-tensor buckets"
        )
        return "\n".join(lines)


def balance_report(layout: BufferLayout, whole_costs: Sequence[float | None]) -> BalanceReport:
    """The cost and padding per rank of ``layout`` for the costs it was built with."""
    if len(whole_costs) != len(layout.params):
        raise ValueError(
            f"whole_costs has {len(whole_costs)} entries for {len(layout.params)} parameters"
        )
    dp_size = layout.dp_size
    cost, elements = [0.0] * dp_size, [0] * dp_size
    for slot, param_cost in zip(layout.params, whole_costs, strict=True):
        if param_cost is None:
            continue
        if slot.owner is None:
            raise ValueError(f"parameter {slot.index} has a cost but no owner in this layout")
        cost[slot.owner] += param_cost
        elements[slot.owner] += slot.bucket_range.size
    padding = []
    for rank in range(dp_size):
        owned = sum(piece.world_range.size for piece in layout.shard_pieces(rank))
        padding.append(sum(b.shard_size for b in layout.buckets) - owned)
    whole_padding = sum(
        b.buffer_range.size - b.num_param_elements for b in layout.buckets if b.whole_tensor
    )
    known = [c for c in whole_costs if c is not None]
    return BalanceReport(
        dp_size=dp_size,
        cost=tuple(cost),
        whole_elements=tuple(elements),
        padding=tuple(padding),
        whole_padding=whole_padding,
        param_elements=sum(slot.bucket_range.size for slot in layout.params),
        bound=max(sum(known) / dp_size, max(known, default=0.0)),
    )
