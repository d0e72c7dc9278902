"""Bucket and shard arithmetic, checked by hand and by exhaustive coverage checks."""

from __future__ import annotations

import random

import pytest

from distopt.layout.elementwise import SHARD_ALIGN, Range, build_layout, default_bucket_size


def _pieces_by_param(layout, rank):
    return {p.param_index: p for p in layout.shard_pieces(rank)}


def test_seed_picture_16_elements_4_ranks():
    # The distributed-optimizer picture: four params (3, 5, 4, 4 elements) in one bucket of 16,
    # four ranks of 4 elements; the second param has 1 element on rank 0 and 4 on rank 1.
    layout = build_layout([3, 5, 4, 4], bucket_size=16, dp_size=4, shard_align=1)
    assert layout.numel == 16 and len(layout.buckets) == 1
    assert layout.buckets[0].shard_size == 4
    r0, r1 = _pieces_by_param(layout, 0), _pieces_by_param(layout, 1)
    assert (r0[1].world_range, r0[1].local_range, r0[1].param_range) == (
        Range(3, 4), Range(3, 4), Range(0, 1))
    assert (r1[1].world_range, r1[1].local_range, r1[1].param_range) == (
        Range(4, 8), Range(0, 4), Range(1, 5))
    assert set(r1) == {1}
    assert [p.param_index for p in layout.shard_pieces(2)] == [2]
    assert [p.param_index for p in layout.shard_pieces(3)] == [3]
    assert r0[0].param_range == Range(0, 3)


def test_param_split_across_three_ranks():
    layout = build_layout([2, 9, 1], bucket_size=100, dp_size=3, shard_align=1)
    assert layout.numel == 12
    owners = {r: _pieces_by_param(layout, r)[1].param_range for r in range(3)}
    assert owners == {0: Range(0, 2), 1: Range(2, 6), 2: Range(6, 9)}
    assert _pieces_by_param(layout, 2)[2].local_range == Range(3, 4)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 5, 7, 8])
def test_odd_dp_sizes_pad_and_align(dp_size):
    layout = build_layout([5, 7, 11, 1000, 3], bucket_size=30, dp_size=dp_size)
    for bucket in layout.buckets:
        size = bucket.buffer_range.size
        assert size % (dp_size * SHARD_ALIGN) == 0
        assert bucket.buffer_range.start % (dp_size * SHARD_ALIGN) == 0
        assert 0 <= size - bucket.num_param_elements < dp_size * SHARD_ALIGN
        for rank in range(dp_size):
            # Each shard starts SHARD_ALIGN-aligned: 64 bytes for any dtype of >= 1 byte.
            shard = bucket.shard_range(rank).shifted(bucket.buffer_range.start)
            assert shard.start % SHARD_ALIGN == 0


def test_buckets_close_before_overflow_and_big_params_stand_alone():
    layout = build_layout([10, 10, 25, 10, 4], bucket_size=20, dp_size=1, shard_align=1)
    assert [b.param_indices for b in layout.buckets] == [(0, 1), (2,), (3, 4)]
    for slot in layout.params:
        bucket = layout.buckets[slot.bucket].buffer_range
        assert bucket.start <= slot.buffer_range.start < slot.buffer_range.end <= bucket.end


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cover_every_element_exactly_once(seed):
    rng = random.Random(seed)
    numels = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
    dp_size = rng.randint(1, 9)
    layout = build_layout(numels, bucket_size=rng.randint(1, 600), dp_size=dp_size,
                          shard_align=rng.choice([1, 4, 64]))
    covered = {i: [] for i in range(len(numels))}
    for rank in range(dp_size):
        shard_total = 0
        for piece in layout.shard_pieces(rank):
            bucket = layout.buckets[piece.bucket]
            slot = layout.params[piece.param_index]
            shard = bucket.shard_range(rank)
            # The three ranges describe the same elements.
            assert piece.world_range == piece.local_range.shifted(shard.start)
            assert piece.world_range == piece.param_range.shifted(slot.bucket_range.start)
            assert piece.local_range.end <= bucket.shard_size
            covered[piece.param_index].append(piece.param_range)
            shard_total += piece.world_range.size
        assert shard_total <= layout.numel // layout.dp_size
    for index, ranges in covered.items():
        ranges.sort(key=lambda r: r.start)
        assert ranges[0].start == 0 and ranges[-1].end == numels[index]
        assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    whole = layout.whole_pieces()
    assert [p.param_range for p in whole] == [Range(0, n) for n in (
        numels[i] for b in layout.buckets for i in b.param_indices)]


def test_default_bucket_size_scales_with_model_and_group():
    assert default_bucket_size(2, 100) == 2 * 65_536  # tiny model: floor per rank
    assert default_bucket_size(2, 8_000_000) == 2_000_000  # about four buckets
    assert default_bucket_size(8, 10**10) == 40_000_000  # Megatron's cap
    assert default_bucket_size(64, 10**10) == 64_000_000  # 1M elements per rank
    assert default_bucket_size(2, 8_000_000, target_buckets=2) == 4_000_000  # gloo: two


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_size"):
        build_layout([1], bucket_size=1, dp_size=0)
    with pytest.raises(ValueError, match="bucket_size"):
        build_layout([1], bucket_size=0, dp_size=1)
    with pytest.raises(ValueError, match="at least one element"):
        build_layout([0], bucket_size=1, dp_size=1)
