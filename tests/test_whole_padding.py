"""The padding of whole-tensor buckets on the demo GPT ``small`` under Muon (the recipe of
``distopt train --optimizer muon``) and Adafactor (every param owned whole), at d = 2, 4 and 8,
with the default bucket sizes of gloo and of NCCL: pure arithmetic on a meta-device model, by
the planner the DDP runs (``predict_plan``). See [Note: whole-tensor bucketing].

Run as a script to print the padding and balance before (the cut by size alone) and after.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_whole_layout import check_layout, check_pieces

from distopt.layout import whole
from distopt.layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO, default_bucket_size
from distopt.optim.recipes import muon_param_groups
from distopt.plan.ownership import predict_plan
from distopt.train.model import GPT, gpt_config

UNIT = 256 * 256
"""Every matrix of the GPT ``small`` is 1, 3 or 4 of these (n_embd = vocab = seq_len = 256)."""
N_PARAMS = 3_290_624
"""The GPT ``small``'s elements: 48 units of hidden matrices, 2 of embeddings, 0.21 of vectors."""
BACKENDS = {"gloo": TARGET_BUCKETS_GLOO, "nccl": TARGET_BUCKETS}
CASES = list(itertools.product(("muon", "adafactor"), BACKENDS, (2, 4, 8)))


def _model() -> torch.nn.Module:
    with torch.device("meta"):  # shapes only
        return GPT(gpt_config("small", seq_len=256))


def _plan(optimizer: str, backend: str, d: int):
    model = _model()
    if optimizer == "muon":
        cls, groups = torch.optim.Muon, muon_param_groups(model, lr=1.0)
    else:
        cls, groups = torch.optim.Adafactor, None
    return predict_plan(model, cls, groups, dp_size=d, target_buckets=BACKENDS[backend])


def _by_size_alone(monkeypatch: pytest.MonkeyPatch, *case):
    """The layout of the cut by size alone: the packed cut never tried."""
    with monkeypatch.context() as patch:
        patch.setattr(whole, "SHARD_GROWTH", ())
        return _plan(*case)


def _fits(units: list[int], loads: list[int], most: int) -> bool:
    """Whether ``units`` (largest first) fit onto ranks of ``loads`` with at most ``most`` each."""
    if not units:
        return True
    tried = set()
    for r, load in enumerate(loads):
        if load + units[0] <= most and load not in tried:
            tried.add(load)
            loads[r] += units[0]
            if _fits(units[1:], loads, most):
                return True
            loads[r] -= units[0]
    return False


def _least_busiest(units: list[int], d: int) -> int:
    """The fewest units the busiest of ``d`` ranks can own, each matrix whole (exhaustive)."""
    units = sorted(units, reverse=True)
    most = -(-sum(units) // d)
    while not _fits(units, [0] * d, most):
        most += 1
    return most


def _matrix_units(plan) -> list[int]:
    """The whole-tensor matrices of the plan's buffer in units, in layout (backward) order."""
    buffer = plan.buffers[0]
    matrices = [math.prod(shape) for shape, cost in zip(buffer.shapes, buffer.whole_costs,
                                                         strict=True)
                if cost is not None and len(shape) == 2]
    assert all(n % UNIT == 0 for n in matrices)
    return [n // UNIT for n in matrices]


def _floor(plan) -> int:
    """Padding no layout can go below, whatever fills the shards: a bucket's shards are of
    equal size and a whole matrix lies in one rank's shard, so every rank's shards sum to at
    least the matrices of the busiest rank (``_least_busiest``), every rank holds as much, and
    the buffer holds at least ``d`` times that. Every param counts against it: element-wise
    pieces (biases, norms, the embeddings Muon leaves to AdamW) may fill what the matrices
    leave, and the floor holds for any cut into buckets and any order."""
    busiest = _least_busiest(_matrix_units(plan), plan.dp_size) * UNIT
    return max(0, plan.dp_size * busiest - plan.num_params)


def _floor_within_capacity(plan, backend: str) -> int:
    """``_floor`` for buckets of consecutive matrices (each bucket is ready when its last grad
    is, so buckets keep backward's order) of at most the layout's capacity, ``bucket_size`` or
    ``d + 1`` times its largest matrix: the least sum of shards over every such cut, by dynamic
    programming over the cut points, each bucket's shard the least that holds its matrices
    whole. Counting only the matrices against the capacity admits more cuts, so it is a floor
    too, whatever fills the shards."""
    units, d = _matrix_units(plan), plan.dp_size
    size = default_bucket_size(d, plan.num_params, target_buckets=BACKENDS[backend])
    least = [0] + [math.inf] * len(units)  # least[j]: the least sum of shards of units[:j]
    for end in range(1, len(units) + 1):
        for start in range(end):
            bucket = units[start:end]
            if sum(bucket) * UNIT <= max(size, (d + 1) * max(bucket) * UNIT):
                least[end] = min(least[end], least[start] + _least_busiest(bucket, d))
    return max(0, d * least[-1] * UNIT - plan.num_params)


@pytest.mark.parametrize(("optimizer", "backend", "d"), CASES)
def test_padding_at_most_two_percent_where_a_layout_can_be(optimizer, backend, d):
    plan = _plan(optimizer, backend, d)
    buffer = plan.buffers[0]
    numels = [math.prod(shape) for shape in buffer.shapes]
    # Each whole param in one rank's shard, equal shards, 64-element alignment, buckets in the
    # order their grads complete them.
    check_layout(buffer.layout, numels, buffer.whole_costs, 64)
    check_pieces(buffer.layout, numels, buffer.whole_costs)
    lasts = [bucket.param_indices[-1] for bucket in buffer.layout.buckets]
    assert lasts == sorted(lasts)
    (report,) = plan.balance()
    padding, floor = sum(report.padding), _floor(plan)
    within = _floor_within_capacity(plan, backend)
    assert report.param_elements == plan.num_params == N_PARAMS
    assert padding >= within >= floor
    if floor <= 0.02 * (N_PARAMS + floor):
        assert report.padding_fraction <= 0.02
        return
    # Where no layout reaches 2%: d = 4 under Adafactor, d = 8 under both.
    if d == 4:
        # Adafactor's 50 units of matrices on 4 ranks leave one at least 13: 3.4% padding at
        # the least. Three buckets of 16 units and one of 2 would reach it; today's cut pads
        # at most 0.6% more.
        assert optimizer == "adafactor" and floor == 4 * 13 * UNIT - N_PARAMS
        assert round(floor / (N_PARAMS + floor), 4) == 0.0344
        assert report.padding_fraction <= 0.04
    else:
        # d = 8: two matrices of 4 units on some rank would give it 8; so every rank holds one,
        # and some rank also a 3: 7 units, 10.3% padding at the least, in one bucket, with
        # every element-wise param filling the shards. No bucket may hold more than 9 x 4
        # units, and each of the two buckets needed has shards of at least 4 units (one
        # without a 4-unit matrix holds too little to fill 8 shards of 3): 8 units per rank,
        # 21.5% at the least. Adafactor's layout pads exactly that; Muon's pads the 2.2 units
        # of its element-wise params' bucket on top.
        assert floor == 8 * 7 * UNIT - N_PARAMS
        assert round(floor / (N_PARAMS + floor), 4) == 0.1034
        assert within == 8 * 2 * 4 * UNIT - N_PARAMS
        assert round(within / (N_PARAMS + within), 4) == 0.2155
        assert sum(b.whole_tensor for b in buffer.layout.buckets) == 2
        assert report.whole_padding == 8 * 2 * 4 * UNIT - (
            3_145_728 if optimizer == "muon" else N_PARAMS)


@pytest.mark.parametrize(("optimizer", "backend", "d"), CASES)
def test_never_more_padding_nor_a_busier_rank_than_the_cut_by_size(
    monkeypatch, optimizer, backend, d
):
    (after,) = _plan(optimizer, backend, d).balance()
    (before,) = _by_size_alone(monkeypatch, optimizer, backend, d).balance()
    assert sum(after.padding) <= sum(before.padding)
    assert after.max_cost <= before.max_cost * (1 + 1e-12)
    assert after.imbalance <= before.imbalance + 1e-12


def test_figures_of_the_docs(monkeypatch):
    """The before and after figures of docs/design.md's layout section."""
    figures = {}
    for case in CASES:
        (after,) = _plan(*case).balance()
        (before,) = _by_size_alone(monkeypatch, *case).balance()
        figures[case] = tuple(round(x, 4) for x in (
            before.padding_fraction, before.imbalance, after.padding_fraction, after.imbalance))
    assert figures[("muon", "nccl", 2)] == (0.1374, 1.0, 0.0, 1.0)
    assert figures[("muon", "gloo", 4)] == (0.1374, 1.0, 0.0, 1.0)
    assert figures[("adafactor", "nccl", 2)] == (0.1344, 1.0, 0.0, 1.0)
    assert figures[("adafactor", "gloo", 4)] == (0.2616, 1.0356, 0.0396, 1.0356)
    assert figures[("adafactor", "nccl", 4)] == (0.2616, 1.0397, 0.0370, 1.0384)
    assert figures[("muon", "nccl", 8)] == (0.2417, 1.1667, 0.2417, 1.1667)


def main() -> None:
    patch = pytest.MonkeyPatch()
    print(f"{'optimizer':<10}{'backend':<8}{'d':>2}  {'padding before':>15}{'after':>8}"
          f"  {'imbalance before':>17}{'after':>8}")
    for case in CASES:
        (after,) = _plan(*case).balance()
        (before,) = _by_size_alone(patch, *case).balance()
        print(f"{case[0]:<10}{case[1]:<8}{case[2]:>2}  {before.padding_fraction:>15.2%}"
              f"{after.padding_fraction:>8.2%}  {before.imbalance:>17.4f}{after.imbalance:>8.4f}")


if __name__ == "__main__":
    main()
