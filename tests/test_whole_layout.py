"""Whole-tensor layouts: invariants, pieces, balance against round-robin, bad input.

Run as a script to print the balance and padding of a small GPT's matrices at d = 1..4.
"""

from __future__ import annotations

import math
import random

import pytest

from distopt.layout.balance import balance_report
from distopt.layout.elementwise import SHARD_ALIGN, Range, build_layout, default_bucket_size, pad_to
from distopt.layout.whole import build_mixed_layout, newton_schulz_cost


def gpt_params(d_model: int = 256, layers: int = 4, vocab: int = 1024, seq: int = 256):
    """(shape, whole) of a small GPT's params in reverse registration order (about backward's):
    the block matrices are owned whole, embeddings, norms and biases are element-wise."""
    registered = [((vocab, d_model), False), ((seq, d_model), False)]
    for _ in range(layers):
        registered += [
            ((d_model,), False), ((d_model,), False),  # ln_1
            ((3 * d_model, d_model), True), ((3 * d_model,), False),  # qkv
            ((d_model, d_model), True), ((d_model,), False),  # proj
            ((d_model,), False), ((d_model,), False),  # ln_2
            ((4 * d_model, d_model), True), ((4 * d_model,), False),  # fc
            ((d_model, 4 * d_model), True), ((d_model,), False),  # fc2
        ]
    registered += [((d_model,), False), ((d_model,), False)]  # ln_f
    return registered[::-1]


def gpt_case(d_model=256, layers=4):
    params = gpt_params(d_model, layers)
    numels = [math.prod(shape) for shape, _ in params]
    costs = [newton_schulz_cost(*shape) if whole else None for shape, whole in params]
    return numels, costs


def huge_case():
    """The GPT's matrices and one 2048 x 2048 matrix whose cost exceeds all others together."""
    numels, costs = gpt_case()
    numels.insert(7, 2048 * 2048)
    costs.insert(7, newton_schulz_cost(2048, 2048))
    return numels, costs


def round_robin(layout, numels, costs, shard_align=SHARD_ALIGN):
    """Per-rank cost and whole-bucket padding if the same buckets' whole params went to ranks
    0, 1, 2, ... in turn over the model."""
    d = layout.dp_size
    cost, padding, turn = [0.0] * d, 0, 0
    for bucket in layout.buckets:
        if not bucket.whole_tensor:
            continue
        used = [0] * d
        for index in bucket.param_indices:
            used[turn % d] += numels[index]
            cost[turn % d] += costs[index]
            turn += 1
        padding += d * pad_to(max(used), shard_align) - sum(used)
    return cost, padding


def check_layout(layout, numels, costs, shard_align):
    d = layout.dp_size
    align = d * shard_align
    assert [slot.index for slot in layout.params] == list(range(len(numels)))
    placed = sorted(i for bucket in layout.buckets for i in bucket.param_indices)
    assert placed == list(range(len(numels)))  # every param in exactly one bucket
    offset = 0
    for position, bucket in enumerate(layout.buckets):
        assert bucket.index == position
        assert bucket.buffer_range.start == offset  # buckets tile the buffer
        offset = bucket.buffer_range.end
        assert bucket.buffer_range.start % align == 0 and bucket.buffer_range.size % align == 0
        assert list(bucket.param_indices) == sorted(bucket.param_indices)
        assert all((costs[i] is not None) == bucket.whole_tensor for i in bucket.param_indices)
        slots = [layout.params[i] for i in bucket.param_indices]
        assert bucket.num_param_elements == sum(numels[i] for i in bucket.param_indices)
        ranges = sorted((s.bucket_range for s in slots), key=lambda r: r.start)
        assert all(a.end <= b.start for a, b in zip(ranges, ranges[1:], strict=False))
        for slot in slots:
            assert slot.bucket == bucket.index
            assert slot.bucket_range.size == numels[slot.index]
            assert slot.buffer_range == slot.bucket_range.shifted(bucket.buffer_range.start)
            assert slot.bucket_range.end <= bucket.buffer_range.size
        if bucket.whole_tensor:
            used = [0] * d
            for slot in slots:
                # Whole inside its owner's shard.
                shard = bucket.shard_range(slot.owner)
                assert shard.start <= slot.bucket_range.start < slot.bucket_range.end <= shard.end
                used[slot.owner] += numels[slot.index]
            for rank in range(d):  # each rank's params back to back from its shard's start
                mine = sorted((s for s in slots if s.owner == rank), key=lambda s: s.index)
                starts = [s.bucket_range.start for s in mine]
                ends = [bucket.shard_range(rank).start] + [s.bucket_range.end for s in mine]
                assert starts == ends[:-1]
            # Padding: only what rounds the largest rank up to shard_align.
            assert 0 <= bucket.shard_size - max(used) < shard_align
        else:
            assert all(slot.owner is None for slot in slots)
            assert 0 <= bucket.buffer_range.size - bucket.num_param_elements < align
    assert layout.numel == offset


def check_pieces(layout, numels, costs):
    covered = {i: [] for i in range(len(numels))}
    for rank in range(layout.dp_size):
        for piece in layout.shard_pieces(rank):
            bucket = layout.buckets[piece.bucket]
            slot = layout.params[piece.param_index]
            shard = bucket.shard_range(rank)
            assert piece.world_range == piece.local_range.shifted(shard.start)
            assert piece.world_range == piece.param_range.shifted(slot.bucket_range.start)
            if bucket.whole_tensor:
                assert slot.owner == rank
                assert piece.param_range == Range(0, numels[piece.param_index])
            covered[piece.param_index].append(piece.param_range)
    for index, ranges in covered.items():
        ranges.sort(key=lambda r: r.start)
        if costs[index] is not None:
            assert len(ranges) == 1  # one piece, on the owner only
        assert ranges[0].start == 0 and ranges[-1].end == numels[index]
        assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))


def random_case(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    numels = [rng.randint(1, 400) for _ in range(n)]
    costs = [None if rng.random() < 0.4 else rng.choice([0, rng.uniform(0, 1e6), numels[i]])
             for i in range(n)]
    return numels, costs, rng.randint(1, 9), rng.randint(1, 1500), rng.choice([1, 4, 64])


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_keep_every_invariant(seed):
    numels, costs, d, bucket_size, shard_align = random_case(seed)
    layout = build_mixed_layout(
        numels, costs, bucket_size=bucket_size, dp_size=d, shard_align=shard_align
    )
    check_layout(layout, numels, costs, shard_align)
    check_pieces(layout, numels, costs)
    for bucket in layout.buckets:
        if bucket.whole_tensor:  # within capacity, see [Note: whole-tensor layout]
            largest = max(numels[i] for i in bucket.param_indices)
            assert bucket.num_param_elements <= max(bucket_size, (d + 1) * largest)
    report = balance_report(layout, costs)
    assert sum(report.padding) == layout.numel - sum(numels)  # every padding element, once
    assert report.whole_padding <= sum(report.padding)
    assert math.isclose(sum(report.cost), sum(c for c in costs if c is not None), abs_tol=1e-6)
    assert report.max_cost >= report.bound * (1 - 1e-12) or report.mean_cost == 0


def test_hand_drawn_bucket():
    # Costs equal to sizes, two ranks, shard_align 1: the two 3s back to back on rank 0 (the
    # costlier part goes to the first of the equally loaded ranks), the 5 alone on rank 1 with
    # one element of padding after it; the element-wise 2 gets its own bucket, which param 3
    # completes, so it comes second, and is split over both ranks as usual.
    layout = build_mixed_layout(
        [5, 3, 3, 2], [5, 3, 3, None], bucket_size=100, dp_size=2, shard_align=1
    )
    whole, flat = layout.buckets
    assert whole.whole_tensor and not flat.whole_tensor
    assert whole.param_indices == (0, 1, 2) and whole.shard_size == 6
    assert [(s.owner, s.bucket_range) for s in layout.params[:3]] == [
        (1, Range(6, 11)), (0, Range(0, 3)), (0, Range(3, 6))]
    assert layout.params[3].buffer_range == Range(12, 14) and layout.numel == 14
    assert [p.param_index for p in layout.shard_pieces(0)] == [1, 2, 3]
    assert [p.param_index for p in layout.shard_pieces(1)] == [0, 3]
    report = balance_report(layout, [5, 3, 3, None])
    assert report.cost == (6.0, 5.0) and report.padding == (0, 1) and report.whole_padding == 1


@pytest.mark.parametrize("seed", range(10))
def test_elementwise_buckets_are_build_layouts(seed):
    numels, costs, d, bucket_size, shard_align = random_case(seed)
    layout = build_mixed_layout(
        numels, costs, bucket_size=bucket_size, dp_size=d, shard_align=shard_align
    )
    flat_indices = [i for i, c in enumerate(costs) if c is None]
    alone = build_layout([numels[i] for i in flat_indices], bucket_size=bucket_size,
                         dp_size=d, shard_align=shard_align) if flat_indices else None
    mixed = [b for b in layout.buckets if not b.whole_tensor]
    assert len(mixed) == (len(alone.buckets) if alone else 0)
    for ours, theirs in zip(mixed, alone.buckets if alone else [], strict=True):
        assert ours.param_indices == tuple(flat_indices[j] for j in theirs.param_indices)
        assert ours.buffer_range.size == theirs.buffer_range.size
        assert ours.num_param_elements == theirs.num_param_elements
        for j in theirs.param_indices:
            assert layout.params[flat_indices[j]].bucket_range == alone.params[j].bucket_range


def test_no_whole_params_is_build_layout():
    numels = [5, 7, 11, 1000, 3]
    for d in (1, 3, 8):
        assert build_mixed_layout(numels, [None] * 5, bucket_size=30, dp_size=d) == build_layout(
            numels, bucket_size=30, dp_size=d)


def test_buckets_ordered_by_the_grad_that_completes_them():
    numels, costs = gpt_case()
    layout = build_mixed_layout(numels, costs, bucket_size=300_000, dp_size=4)
    lasts = [b.param_indices[-1] for b in layout.buckets]
    assert lasts == sorted(lasts)
    assert {b.whole_tensor for b in layout.buckets} == {True, False}


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_gpt_matrices_balance_perfectly_and_beat_round_robin(d):
    numels, costs = gpt_case()
    layout = build_mixed_layout(
        numels, costs, bucket_size=default_bucket_size(d, sum(numels)), dp_size=d
    )
    check_layout(layout, numels, costs, SHARD_ALIGN)
    report = balance_report(layout, costs)
    rr_cost, rr_padding = round_robin(layout, numels, costs)
    # Four layers of equal matrices: an exact split exists at every d <= 4, and we find it.
    assert report.imbalance == pytest.approx(1.0)
    assert report.max_cost <= max(rr_cost)
    assert report.whole_padding <= rr_padding


@pytest.mark.parametrize(("d", "imbalance"), [(8, 1.0), (64, 4 / 3)])
def test_many_ranks_few_matrices(d, imbalance):
    # 24 layers of 4 matrices: at 64 ranks, 1.5 matrices per rank; the buckets are filled
    # evenly so that the owners have room to balance.
    numels, costs = gpt_case(d_model=1024, layers=24)
    layout = build_mixed_layout(
        numels, costs, bucket_size=default_bucket_size(d, sum(numels)), dp_size=d
    )
    check_layout(layout, numels, costs, SHARD_ALIGN)
    report = balance_report(layout, costs)
    rr_cost, rr_padding = round_robin(layout, numels, costs)
    assert report.imbalance == pytest.approx(imbalance)
    assert report.max_cost <= max(rr_cost) and report.whole_padding <= rr_padding


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_one_huge_matrix(d):
    numels, costs = huge_case()
    layout = build_mixed_layout(numels, costs, bucket_size=1_000_000, dp_size=d)
    check_layout(layout, numels, costs, SHARD_ALIGN)
    check_pieces(layout, numels, costs)
    report = balance_report(layout, costs)
    huge = newton_schulz_cost(2048, 2048)
    assert report.bound == huge  # the huge matrix's rank is the step's floor
    assert report.max_cost == huge  # and nothing else lands on it
    rr_cost, _ = round_robin(layout, numels, costs)
    assert report.max_cost <= max(rr_cost)


@pytest.mark.parametrize("seed", range(20))
def test_never_worse_than_round_robin(seed):
    numels, costs, d, bucket_size, _ = random_case(seed)
    costs = [None if c is None else n for n, c in zip(numels, costs, strict=True)]
    layout = build_mixed_layout(numels, costs, bucket_size=bucket_size, dp_size=d)
    if not any(b.whole_tensor for b in layout.buckets):
        return
    rr_cost, _ = round_robin(layout, numels, costs)
    assert balance_report(layout, costs).max_cost <= max(rr_cost)


def test_deterministic():
    numels, costs = huge_case()
    layouts = [
        build_mixed_layout(list(numels), list(costs), bucket_size=500_000, dp_size=3)
        for _ in range(3)
    ]
    assert layouts[0] == layouts[1] == layouts[2]


def test_bad_input():
    with pytest.raises(ValueError, match="parameter 1 has a whole-tensor cost but no elements"):
        build_mixed_layout([4, 0], [None, 1.0], bucket_size=8, dp_size=2)
    with pytest.raises(ValueError, match="at least one element"):
        build_mixed_layout([4, 0], [None, None], bucket_size=8, dp_size=2)
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        build_mixed_layout([4], [1.0], bucket_size=8, dp_size=0)
    with pytest.raises(ValueError, match="whole_costs has 1 entries for 2 parameters"):
        build_mixed_layout([4, 4], [1.0], bucket_size=8, dp_size=1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        build_mixed_layout([4], [-1.0], bucket_size=8, dp_size=1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        build_mixed_layout([4], [math.nan], bucket_size=8, dp_size=1)
    with pytest.raises(ValueError, match="bucket_size"):
        build_mixed_layout([4], [1.0], bucket_size=0, dp_size=1)
    with pytest.raises(ValueError, match="whole_bucket_size"):
        build_mixed_layout([4], [1.0], bucket_size=8, dp_size=1, whole_bucket_size=0)
    with pytest.raises(ValueError, match="no owner"):
        balance_report(build_layout([4], bucket_size=8, dp_size=1), [1.0])


def test_newton_schulz_cost():
    assert newton_schulz_cost(768, 256) == newton_schulz_cost(256, 768) == 768 * 256 * 256


def main() -> None:
    numels, costs = gpt_case()
    for whole_scale in (1, 2):
        for d in range(1, 5):
            bucket_size = default_bucket_size(d, sum(numels))
            layout = build_mixed_layout(
                numels, costs, bucket_size=bucket_size, dp_size=d,
                whole_bucket_size=whole_scale * bucket_size,
            )
            report = balance_report(layout, costs)
            rr_cost, rr_padding = round_robin(layout, numels, costs)
            whole = sum(b.whole_tensor for b in layout.buckets)
            print(f"d={d} bucket_size={bucket_size:,d} whole_bucket_size="
                  f"{whole_scale * bucket_size:,d} ({whole} whole-tensor buckets)")
            print(report.format())
            print(f"round-robin: imbalance {max(rr_cost) / report.mean_cost:.4f},"
                  f" {rr_padding:,d} padding in whole-tensor buckets\n")


if __name__ == "__main__":
    main()
