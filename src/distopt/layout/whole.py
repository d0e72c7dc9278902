"""Layouts in which chosen parameters are each owned whole by one data-parallel rank. Pure
arithmetic like layout/elementwise.py: no torch.distributed, no tensors.

[Note: whole-tensor layout]
Some optimizers need each matrix whole: Muon orthogonalises every 2-D update with Newton-Schulz
iterations, Adafactor keeps row and column statistics. For them the caller gives a cost per
chosen parameter (``newton_schulz_cost`` for Muon) and every other parameter ``None``.

* Element-wise parameters (``None``) form buckets exactly as ``build_layout`` would form them
  from that subsequence alone ([Note: layout rule]): same groups, same ranges in each bucket.
* Whole-tensor parameters form their own buckets. Inside such a bucket each rank owns a set of
  whole parameters, placed back to back in the given order at the start of its shard; every
  shard is padded at its end to the bucket's common shard size, the largest rank's elements
  rounded up to ``shard_align``. So the reduce-scatter and the all-gather of the bucket stay
  the ordinary equal-chunk collectives, and a rank's shard pieces are exactly its parameters,
  whole. The padding, ``dp_size`` shards minus the params, is held by every rank's param and
  grad buffers and sent by every collective of the bucket, and it is decided by which params
  share a bucket: the buckets are cut, params kept in the given order, for the least padding
  ([Note: whole-tensor bucketing] in layout/packing.py). A bucket's shard is at least its
  largest parameter, so the bucket carries at least ``dp_size`` times that; its capacity is
  ``whole_bucket_size`` (default ``bucket_size``) or ``dp_size + 1`` times its largest
  parameter, whichever is more: up to ``dp_size`` times, params fill padding the bucket would
  carry anyway, and one largest param more lets the cut even out a remainder that does not
  tile the shards (with exactly ``dp_size`` times, the GPT ``small`` under Adafactor at d = 4
  on NCCL's default buckets cuts into four buckets padded 22%; with one more, three buckets
  padded 3.7%). A larger bucket launches its reduction later, as it waits for more grads.
* Buckets of both kinds are ordered by the position of their last parameter: that grad
  completes the bucket, so this is the order in which backward makes buckets ready.

Who owns what: all buckets' optimizer work runs in one step, so the step waits for the rank
with the largest TOTAL cost over the model; a single bucket's balance matters only through the
padding it costs (the shard size is set by the bucket's largest rank). Three stages:

1. Each bucket is cut into ``dp_size`` parts that fit its shard, largest cost first onto the
   part with the least cost so far among those it fits in (ties: fewest elements); where that
   leaves a param out, the parts the cut was priced with.
2. Which rank takes which part is free: it changes no shard size. Bucket by bucket, the part
   with the most cost goes to the rank with the least cost over the buckets before, the next
   part to the next rank, so one bucket's excess is paid back in the following ones.
3. A local search then lowers the busiest rank's total: it moves one parameter, or swaps two,
   or swaps two ranks' whole parts, between the busiest rank and another inside one bucket,
   whenever that narrows their gap and neither rank outgrows the bucket's shard size. Padding
   never grows, and the sum of squared totals falls at every move, so the search ends (and
   ``MAX_SEARCH_MOVES_PER_PARAM`` bounds its time).

Balancing each bucket alone (stage 1 without 2 and 3) lets every bucket's rounding fall on the
same ranks; balancing the model alone, ignoring buckets, piles a bucket's parameters on a few
ranks and pads every other shard to match. Shards cut tight for padding can leave the search
no room: so the layout is also built by the cut by size alone (``build_layout``'s closing rule
with a capacity of ``dp_size`` times the largest param gives the number of buckets ``k``, a
second pass closes a bucket once it holds ``1/k`` of the elements; stage 1 then splits each
bucket by cost alone, which fixes its shard). The packed layout is kept if its busiest rank
does no more than that one's; else its owners get room over the tight shards, in steps
(``SHARD_GROWTH``), until it does; else the cut by size stands. So the padding never exceeds
the cut by size's, nor the busiest rank's cost. On the GPT ``small`` (``distopt memory --model
small --optimizer muon|adafactor --dp D``) the padding falls from 13.7% (Muon, d = 2 or 4 by
the bucket size) and 26% (Adafactor, d = 4) to 0% and 3.7-4.0%; the balance is unchanged or
better. What no cut can beat is each rank's elements: with ``T`` the most elements a rank owns,
the buckets' shards sum to at least ``T``, so the padding is at least ``dp_size T`` minus the
params. Sixteen matrices of 4, 4, 3 and 1 units on 8 ranks give some rank 7 units for a mean
of 6 (14% of the buffer in one bucket; 24% in the two that its capacity allows).
``balance_report`` (layout/balance.py) prints what the result costs: the cost per rank against
the bound no assignment can beat (the mean, or the costliest matrix), and the padding per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .elementwise import (
    SHARD_ALIGN,
    BucketLayout,
    BufferLayout,
    ParamSlot,
    Range,
    build_layout,
    check_layout_inputs,
    pad_to,
)
from .packing import cut_buckets

SHARD_GROWTH = (0.0, 1 / 256, 1 / 64, 1 / 16, 1 / 4)
"""How much room over the least padded shards the owners get, tried in turn, when the least
padded cut balances worse than the cut by size alone."""

MAX_SEARCH_MOVES_PER_PARAM = 8
"""The local search (stage 3) stops after this many moves per whole-tensor parameter at most."""


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Cost of Newton-Schulz on a ``rows x cols`` matrix, up to a constant: its matrix products
    take ``max * min**2`` multiply-adds."""
    small, large = sorted((rows, cols))
    return large * small * small


def build_mixed_layout(
    numels: Sequence[int],
    whole_costs: Sequence[float | None],
    *,
    bucket_size: int,
    dp_size: int,
    shard_align: int = SHARD_ALIGN,
    whole_bucket_size: int | None = None,
    units: Sequence[int] | None = None,
) -> BufferLayout:
    """Lay out element-wise and whole-tensor parameters; see [Note: whole-tensor layout].
    ``units``: each parameter's gather unit, which element-wise buckets do not straddle (see
    ``build_layout``); whole-tensor buckets are planned by their owners' costs alone.

    ``whole_costs[i]`` is the optimizer's cost for parameter ``i`` if it is owned whole, or
    ``None`` if its elements are sharded like ``build_layout``'s. Every ``ParamSlot`` of a
    whole-tensor parameter names its ``owner``; its buckets have ``whole_tensor=True``.
    """
    whole_bucket_size = bucket_size if whole_bucket_size is None else whole_bucket_size
    _check(numels, whole_costs, bucket_size, whole_bucket_size, dp_size, shard_align)

    elementwise = [i for i, cost in enumerate(whole_costs) if cost is None]
    whole = [i for i, cost in enumerate(whole_costs) if cost is not None]
    # Kept as (last param, position) so that sorting orders buckets by completion.
    plans: list[tuple[int, int, BucketLayout | list[list[int]]]] = []
    if elementwise:
        flat = build_layout(
            [numels[i] for i in elementwise],
            bucket_size=bucket_size,
            dp_size=dp_size,
            shard_align=shard_align,
            units=None if units is None else [units[i] for i in elementwise],
        )
        for bucket in flat.buckets:
            plans.append((elementwise[bucket.param_indices[-1]], len(plans), bucket))
    else:
        flat = None
    if whole:
        costs = {i: float(whole_costs[i]) for i in whole}  # type: ignore[arg-type]
        for owned in _whole_buckets(whole, numels, costs, whole_bucket_size, dp_size, shard_align):
            plans.append((max(i for part in owned for i in part), len(plans), owned))
    plans.sort(key=lambda plan: plan[:2])

    buckets: list[BucketLayout] = []
    slots: list[ParamSlot | None] = [None] * len(numels)
    offset = 0
    for bucket_index, (_, _, plan) in enumerate(plans):
        if isinstance(plan, BucketLayout):
            assert flat is not None
            indices = tuple(elementwise[j] for j in plan.param_indices)
            for j, index in zip(plan.param_indices, indices, strict=True):
                inner = flat.params[j].bucket_range
                slots[index] = ParamSlot(
                    index=index,
                    bucket=bucket_index,
                    bucket_range=inner,
                    buffer_range=inner.shifted(offset),
                )
            size, used = plan.buffer_range.size, plan.num_param_elements
        else:
            shard_size = pad_to(max(sum(numels[i] for i in part) for part in plan), shard_align)
            for rank, part in enumerate(plan):
                start = rank * shard_size
                for index in sorted(part):
                    inner = Range(start, start + numels[index])
                    slots[index] = ParamSlot(
                        index=index,
                        bucket=bucket_index,
                        bucket_range=inner,
                        buffer_range=inner.shifted(offset),
                        owner=rank,
                    )
                    start = inner.end
            indices = tuple(sorted(index for part in plan for index in part))
            size, used = dp_size * shard_size, sum(numels[i] for i in indices)
        buckets.append(
            BucketLayout(
                index=bucket_index,
                buffer_range=Range(offset, offset + size),
                num_param_elements=used,
                param_indices=indices,
                dp_size=dp_size,
                whole_tensor=not isinstance(plan, BucketLayout),
            )
        )
        offset += size
    assert all(slot is not None for slot in slots)
    return BufferLayout(
        dp_size=dp_size,
        numel=offset,
        buckets=tuple(buckets),
        params=tuple(slot for slot in slots if slot is not None),
    )


def _whole_buckets(
    whole: list[int],
    numels: Sequence[int],
    costs: dict[int, float],
    whole_bucket_size: int,
    dp_size: int,
    shard_align: int,
) -> list[list[list[int]]]:
    """For each whole-tensor bucket, the params each rank owns; see [Note: whole-tensor layout]."""

    def capacity(largest: int) -> int:
        return max(whole_bucket_size, (dp_size + 1) * largest)

    # The cut by size alone, each bucket split by cost alone: the balance to keep.
    groups = _whole_groups(whole, numels, whole_bucket_size, dp_size)
    split = [_split_by_cost(group, numels, costs, dp_size) for group in groups]
    sized = _assign(split, numels, costs, [max(_sum(p, numels) for p in s) for s in split])
    target = _max_load(sized, costs) * (1 + 1e-12)
    # The cut with the least padding (layout/packing.py), its owners given more room in turn
    # until its busiest rank does no more.
    cut = cut_buckets([numels[i] for i in whole], capacity, dp_size, shard_align)
    candidates = [sized]
    for growth in SHARD_GROWTH:
        shards, parts = [], []
        for positions, shard, bins in cut:
            room = pad_to(shard + int(shard * growth), shard_align)
            shards.append(room)
            parts.append(_split_by_cost([whole[k] for k in positions], numels, costs, dp_size, room)
                         or [[whole[k] for k in part] for part in bins])
        candidates.append(_assign(parts, numels, costs, shards))
        if _max_load(candidates[-1], costs) <= target:
            break
    return min(
        (c for c in candidates if _max_load(c, costs) <= target),
        key=lambda c: (_padding(c, numels, shard_align), _max_load(c, costs)),
    )


def _max_load(owned: list[list[list[int]]], costs: dict[int, float]) -> float:
    dp_size = len(owned[0])
    return max(sum(_sum(bucket[r], costs) for bucket in owned) for r in range(dp_size))


def _padding(owned: list[list[list[int]]], numels: Sequence[int], shard_align: int) -> int:
    return sum(
        len(bucket) * pad_to(int(max(_sum(part, numels) for part in bucket)), shard_align)
        - int(sum(_sum(part, numels) for part in bucket))
        for bucket in owned
    )


def _split_by_cost(
    group: list[int],
    numels: Sequence[int],
    costs: dict[int, float],
    dp_size: int,
    shard: int | None = None,
) -> list[list[int]] | None:  # None only when a shard is given
    """``group`` cut into ``dp_size`` parts, costliest param first onto the part with the least
    cost (ties: fewest elements) among those it fits in within ``shard`` elements; None if a
    param fits in none."""
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    part_cost, part_numel = [0.0] * dp_size, [0] * dp_size
    for index in sorted(group, key=lambda i: (-costs[i], -numels[i], i)):
        fitting = [k for k in range(dp_size)
                   if shard is None or part_numel[k] + numels[index] <= shard]
        if not fitting:
            return None
        k = min(fitting, key=lambda k: (part_cost[k], part_numel[k], k))
        parts[k].append(index)
        part_cost[k] += costs[index]
        part_numel[k] += numels[index]
    return parts


def _whole_groups(
    whole: list[int], numels: Sequence[int], whole_bucket_size: int, dp_size: int
) -> list[list[int]]:
    """The whole-tensor params of each bucket, in order; see [Note: whole-tensor layout]."""
    fill = _fill(whole, numels, whole_bucket_size, dp_size, target=None)
    if len(fill) < 2:
        return fill
    # As many buckets, of about equal size: full buckets leave the owners no room.
    total = sum(numels[i] for i in whole)
    return _fill(whole, numels, whole_bucket_size, dp_size, target=-(-total // len(fill)))


def _fill(
    whole: list[int],
    numels: Sequence[int],
    whole_bucket_size: int,
    dp_size: int,
    target: int | None,
) -> list[list[int]]:
    groups: list[list[int]] = []
    current: list[int] = []
    used = largest = 0
    for index in whole:
        numel = numels[index]
        capacity = max(whole_bucket_size, dp_size * max(largest, numel))
        if current and (used + numel > capacity or (target is not None and used >= target)):
            groups.append(current)
            current, used, largest = [], 0, 0
        current.append(index)
        used += numel
        largest = max(largest, numel)
    if current:
        groups.append(current)
    return groups


def _check(
    numels: Sequence[int],
    whole_costs: Sequence[float | None],
    bucket_size: int,
    whole_bucket_size: int,
    dp_size: int,
    shard_align: int,
) -> None:
    if whole_bucket_size < 1:
        raise ValueError(f"whole_bucket_size must be >= 1 element, got {whole_bucket_size}")
    if len(whole_costs) != len(numels):
        raise ValueError(
            f"whole_costs has {len(whole_costs)} entries for {len(numels)} parameters"
        )
    for index, (numel, cost) in enumerate(zip(numels, whole_costs, strict=True)):
        if cost is not None and numel < 1:
            raise ValueError(f"parameter {index} has a whole-tensor cost but no elements")
        if cost is not None and not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"parameter {index} has cost {cost}; costs must be finite and >= 0")
    check_layout_inputs(numels, bucket_size=bucket_size, dp_size=dp_size,
                        shard_align=shard_align)


def _assign(
    cut: list[list[list[int]]],
    numels: Sequence[int],
    costs: dict[int, float],
    shards: list[int],
) -> list[list[list[int]]]:
    """For each bucket, given cut into parts (stage 1), the whole-tensor params each rank owns
    within the bucket's ``shards`` elements; see [Note: whole-tensor layout]."""
    dp_size = len(cut[0])
    # Stage 2: the bucket's costliest part to the rank with the least cost so far.
    load = [0.0] * dp_size
    owned: list[list[list[int]]] = []
    for parts in cut:
        by_cost = sorted(parts, key=lambda p: (-_sum(p, costs), -_sum(p, numels), p))
        by_load = sorted(range(dp_size), key=lambda r: (load[r], r))
        bucket: list[list[int]] = [[] for _ in range(dp_size)]
        for part, rank in zip(by_cost, by_load, strict=True):
            bucket[rank] = part
            load[rank] += _sum(part, costs)
        owned.append(bucket)

    _search(owned, numels, costs, load, shards)
    return owned


def _search(
    owned: list[list[list[int]]],
    numels: Sequence[int],
    costs: dict[int, float],
    load: list[float],
    shard: list[int],
) -> None:
    """Stage 3: narrow the busiest rank's gap to the others inside the buckets' ``shard``
    sizes, changing ``owned`` and ``load`` in place."""
    dp_size = len(load)
    part_cost = [[_sum(part, costs) for part in bucket] for bucket in owned]
    part_numel = [[int(_sum(part, numels)) for part in bucket] for bucket in owned]
    # Gaps below this are rounding: the search must not chase them.
    tolerance = 1e-9 * max(load) if max(load) > 0 else 0.0
    for _ in range(MAX_SEARCH_MOVES_PER_PARAM * len(costs)):
        busiest = max(range(dp_size), key=lambda r: (load[r], -r))
        # (gain, bucket, rank, given, taken); a move of cost delta across a gap lowers the sum
        # of squared loads by 2 * delta * (gap - delta), which we call the gain (halved).
        best: tuple[float, int, int, list[int], list[int]] | None = None
        for rank in sorted(range(dp_size), key=lambda r: (load[r], r)):
            gap = load[busiest] - load[rank]
            # Lighter ranks come first, and no move across a gap gains more than gap**2 / 4.
            if gap <= tolerance or (best is not None and best[0] >= gap * gap / 4):
                break
            low, high = tolerance, gap - tolerance  # the deltas that narrow the gap
            best_gain = -1.0 if best is None else best[0]
            for b, bucket in enumerate(owned):
                mine, theirs = bucket[busiest], bucket[rank]
                # How many elements may cross to them (positive) or to us (negative).
                most = shard[b] - part_numel[b][rank]
                least = part_numel[b][busiest] - shard[b]
                delta = part_cost[b][busiest] - part_cost[b][rank]  # the two parts swapped
                if low < delta < high and delta * (gap - delta) > best_gain:
                    best_gain = delta * (gap - delta)
                    best = (best_gain, b, rank, mine, theirs)
                for give in mine:
                    cost, numel = costs[give], numels[give]
                    if cost <= low:
                        continue  # nothing this param takes part in narrows the gap
                    if cost < high and numel <= most and cost * (gap - cost) > best_gain:
                        best_gain = cost * (gap - cost)
                        best = (best_gain, b, rank, [give], [])
                    for take in theirs:
                        delta = cost - costs[take]
                        if low < delta < high and least <= numel - numels[take] <= most:
                            gain = delta * (gap - delta)
                            if gain > best_gain:
                                best_gain = gain
                                best = (gain, b, rank, [give], [take])
        if best is None:
            return
        _, b, rank, given, taken = best
        delta = _sum(given, costs) - _sum(taken, costs)
        moved = int(_sum(given, numels) - _sum(taken, numels))
        bucket = owned[b]
        bucket[busiest] = sorted(set(bucket[busiest]) - set(given) | set(taken))
        bucket[rank] = sorted(set(bucket[rank]) - set(taken) | set(given))
        for r, sign in ((busiest, -1), (rank, 1)):
            load[r] += sign * delta
            part_cost[b][r] += sign * delta
            part_numel[b][r] += sign * moved


def _sum(indices: list[int], values: Sequence[float] | Sequence[int] | dict[int, float]) -> float:
    return sum(values[i] for i in indices)
