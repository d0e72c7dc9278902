"""What whole-tensor ownership costs, on real optimizers at d = 4: the Newton-Schulz cost of the
busiest rank, the padding, and the bytes each rank holds against the table plus that padding.

Models: the demo GPT ``small`` (Muon recipe; and Adafactor for every param), once with the
buckets distopt picks on gloo and once with those it picks on NCCL, and an MLP whose twelve
matrices all have different shapes. Each rank takes one step (torch creates optimizer state
lazily), then ``measure_state_bytes`` walks its storages. See [Note: memory of whole-tensor
ownership] in distopt/plan/ownership.py for the accounting the assertions follow.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn

import distopt
from distopt.layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO, default_bucket_size
from distopt.optim.recipes import muon_param_groups
from distopt.plan.ownership import plan_of, predict_plan, state_bytes
from distopt.train.config import OPTIMIZERS
from distopt.train.model import GPT, gpt_config

from dist_harness import case_result, run_cases

pytestmark = pytest.mark.slow  # GPT small at d = 4

D = 4
LR = 1e-3
# Widths of an MLP whose twelve matrices all differ in shape (and in Newton-Schulz cost, from
# 1.3M to 25.7M multiply-adds: the costliest is 0.75 of a rank's mean share at d = 4).
UNEQUAL_WIDTHS = (96, 384, 160, 640, 128, 512, 224, 320, 64, 448, 192, 576, 96)


def unequal_mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(UNEQUAL_WIDTHS[:-1], UNEQUAL_WIDTHS[1:], strict=True):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _build(model_name: str, optimizer: str) -> tuple[nn.Module, type, list[dict] | None, dict]:
    torch.manual_seed(0)
    # The GPT at seq_len 256 is what `distopt memory --model small` counts.
    module = GPT(gpt_config("small", seq_len=256)) if model_name == "gpt" else unequal_mlp()
    if optimizer == "adafactor":
        return module, torch.optim.Adafactor, None, {"lr": LR}
    if model_name == "gpt":
        groups = muon_param_groups(module, LR)  # the recipe of `distopt train --optimizer muon`
    else:
        matrices = [p for p in module.parameters() if p.dim() == 2]
        biases = [p for p in module.parameters() if p.dim() == 1]
        groups = [{"params": matrices},
                  {"params": biases, "optimizer": torch.optim.AdamW, "lr": LR}]
    return module, torch.optim.Muon, groups, {"lr": LR, **OPTIMIZERS["muon"][1]}


def _loss(module: nn.Module, model_name: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if model_name == "gpt":
        tokens = torch.randint(0, 256, (1, 17), generator=g)
        return module(tokens[:, :-1], tokens[:, 1:])[1]
    x = torch.randn(8, UNEQUAL_WIDTHS[0], generator=g)
    return module(x).square().mean()


def ownership_case(model_name: str, optimizer: str, nccl_buckets: bool) -> dict:
    rank = dist.get_rank()
    module, optimizer_cls, groups, kwargs = _build(model_name, optimizer)
    num_params = sum(p.numel() for p in module.parameters())
    # distopt's default bucket size on NCCL, or leave the DDP to pick gloo's.
    bucket_size = default_bucket_size(D, num_params) if nccl_buckets else None
    ddp = distopt.DistributedDataParallel(module, bucket_size=bucket_size)
    opt = distopt.DistributedOptimizer(ddp, optimizer_cls, params=groups, **kwargs)
    opt.zero_grad()
    _loss(ddp, model_name, rank).backward()
    calls = 0
    original = torch_muon._zeropower_via_newtonschulz

    def counted(grad: torch.Tensor, *args, **kw) -> torch.Tensor:
        # Only where Newton-Schulz runs matters here, not its value: a stand-in of the same
        # shape, as torch's runs its products in bf16, which take seconds a matrix on a CPU.
        nonlocal calls
        calls += 1
        return torch.zeros_like(grad)

    torch_muon._zeropower_via_newtonschulz = counted
    try:
        opt.step()
    finally:
        torch_muon._zeropower_via_newtonschulz = original
    ddp.finish_param_sync()

    plan = plan_of(opt)
    # The same arithmetic before any process group exists, as `distopt memory` runs it.
    predicted = predict_plan(
        module, optimizer_cls, groups, dp_size=D, bucket_size=bucket_size,
        target_buckets=TARGET_BUCKETS if nccl_buckets else TARGET_BUCKETS_GLOO,
    )
    classes = {p: g.get("optimizer", optimizer_cls) for g in (groups or [{"params": list(
        module.parameters())}]) for p in g["params"]}
    (balance,) = plan.balance()
    layout = ddp.flat_buffers[0].layout
    owned = [slot.owner for slot in layout.params if slot.owner is not None]
    return {
        "measured": distopt.measure_state_bytes(opt).as_dict(),
        "plan": plan.ranks[rank].as_dict(),
        "predicted_equal": [b.layout for b in predicted.buffers] == [layout]
        and predicted.ranks == plan.ranks,
        "num_params": num_params,
        "buffer_numel": layout.numel,
        "state_of_every_param": sum(state_bytes(cls, tuple(p.shape))
                                    for p, cls in classes.items()),
        "table": plan.table_bytes_per_param,
        "padding_bytes_per_param": plan.padding_bytes_per_param,
        "cost": balance.cost,
        "padding": balance.padding,
        "whole_padding": balance.whole_padding,
        "imbalance": balance.imbalance,
        "best_imbalance": balance.best_imbalance,
        "mean_cost": balance.mean_cost,
        "costliest": max(c for c in plan.buffers[0].whole_costs if c is not None),
        "report": balance.format() + "\n" + plan.format(),
        "ns_calls": calls,
        "matrices_owned": owned.count(rank) if optimizer == "muon" else 0,
        "matrices": len(owned),
    }


CASES = {
    "gpt-muon": ("gpt", "muon", False),
    "gpt-muon-nccl-buckets": ("gpt", "muon", True),
    "gpt-adafactor": ("gpt", "adafactor", False),
    "unequal-muon": ("unequal", "muon", False),
}


@pytest.fixture(scope="module")
def results():
    per_rank = run_cases(D, [(name, ownership_case, args) for name, args in CASES.items()])
    return {name: case_result(per_rank, name) for name in CASES}


@pytest.mark.parametrize("case", CASES)
def test_measured_bytes_are_the_table_plus_the_padding(results, case):
    ranks = results[case]
    print(f"\n{case}, d = {D}:\n{ranks[0]['report']}")
    first = ranks[0]
    n, padding = first["num_params"], sum(first["padding"])
    assert first["buffer_numel"] == n + padding  # the report's padding is all of it
    for r in ranks:
        # What each rank holds is what the layout says it holds, component by component.
        assert r["measured"] == r["plan"]
        assert r["predicted_equal"]
        # fp32 params and grads: both buffers hold every element and all padding.
        assert r["measured"]["params"] == r["measured"]["grads"] == 4 * (n + padding)
        assert r["measured"]["main_params"] == r["measured"]["main_grads"] == 0
    # Every element's state is held by exactly one rank, and padding has none.
    state = sum(r["measured"]["optimizer_state"] for r in ranks)
    assert state == first["state_of_every_param"]
    # So the ranks together hold d times the table plus the padding, to the byte: the table's
    # params + grads (8 B) for every element and every padding element, and the state once.
    assert sum(r["measured"]["total"] for r in ranks) == D * 8 * (n + padding) + state
    mean = sum(r["measured"]["bytes_per_param"] for r in ranks) / D
    assert mean == pytest.approx(first["table"] + first["padding_bytes_per_param"], rel=1e-12)
    # ... while each rank's own state is what it owns: not 1/d of the state exactly.
    assert first["table"] == pytest.approx(8 + state / n / D, rel=1e-12)


def test_gpt_small_with_muon(results):
    gloo, nccl = results["gpt-muon"][0], results["gpt-muon-nccl-buckets"][0]
    # Four layers of four matrices (768x256, 256x256, 1024x256, 256x1024): 201.3M multiply-adds
    # per Newton-Schulz iteration each, so a rank's even share is one layer's worth, reached.
    layer = 768 * 256**2 + 256**3 + 2 * 1024 * 256**2
    for r in (gloo, nccl):
        assert r["cost"] == (layer,) * D
        assert r["imbalance"] == r["best_imbalance"] == 1.0
    # The buckets are cut where each splits into four parts of equal elements (layout/packing.py),
    # with gloo's default bucket size (half the model) as with NCCL's: no padding at all. (Cut
    # into two buckets of two layers each, every shard would be 458,752 long for 393,216 on
    # average: 131,072 padding elements per rank, 13.7% of the buffer.)
    for r in (gloo, nccl):
        assert r["padding"] == (0,) * D and r["whole_padding"] == 0
    # 4 B of momentum per matrix element, 8 B of AdamW state per other one: 9.04 B/param at d=4,
    # against 10 for AdamW alone, and nothing for padding.
    assert gloo["table"] == pytest.approx(9.0440, abs=1e-4)
    assert gloo["padding_bytes_per_param"] == nccl["padding_bytes_per_param"] == 0


def test_imbalance_within_the_bound_of_the_greedy(results):
    """The owners of the cut by size are chosen greedily (layout/whole.py): each bucket's params,
    costliest first, go to its part with the least cost, so the parts of a bucket differ by at
    most the costliest param c_max; the parts go to the ranks by least load so far, which keeps
    the spread of the ranks' totals within the largest spread of a bucket's parts; and the
    local search only narrows gaps. So max - min <= c_max, hence max <= mean + (1 - 1/d) c_max;
    the layout cut for less padding is kept only where its busiest rank does no more."""
    for case in ("gpt-muon", "gpt-muon-nccl-buckets", "unequal-muon"):
        r = results[case][0]
        bound = 1 + (1 - 1 / D) * r["costliest"] / r["mean_cost"]
        assert r["best_imbalance"] <= r["imbalance"] <= bound, case
    unequal = results["unequal-muon"][0]
    # The costliest matrix (224x512, 25.7M) is 0.75 of the mean share, so no single matrix
    # rules out a perfect split; the greedy's busiest rank does 1.7% more than the mean.
    assert unequal["best_imbalance"] == 1.0
    assert unequal["imbalance"] == pytest.approx(1.0173, abs=1e-4)
    # Twelve unequal matrices, three per rank: cut by size into three buckets of four, each
    # shard as long as its bucket's largest part, the others padded up to it, 475,136 elements
    # (36% of the buffer); cut for padding, two buckets whose parts come out closer, 98,304
    # (10.5%), for the same busiest rank. The biases' element-wise bucket pads only to a
    # multiple of 64 d.
    assert unequal["whole_padding"] == 98_304
    assert 0 <= sum(unequal["padding"]) - unequal["whole_padding"] < 64 * D


def test_newton_schulz_runs_once_per_matrix_on_its_owner(results):
    for case in ("gpt-muon", "gpt-muon-nccl-buckets", "unequal-muon"):
        ranks = results[case]
        assert [r["ns_calls"] for r in ranks] == [r["matrices_owned"] for r in ranks]
        assert sum(r["ns_calls"] for r in ranks) == ranks[0]["matrices"]
    assert results["gpt-muon"][0]["matrices"] == 16
    assert results["unequal-muon"][0]["matrices"] == len(UNEQUAL_WIDTHS) - 1
    assert all(r["ns_calls"] == 0 for r in results["gpt-adafactor"])


def test_adafactor_state_is_rows_and_columns(results):
    ranks = results["gpt-adafactor"]
    r = ranks[0]
    # Adafactor owns every param whole (cost: elements), keeping 4 B per row and per column of
    # each matrix and 4 B per element of each vector: 0.038 B/param of state for the GPT.
    config = gpt_config("small", seq_len=256)
    e, v, layers = config.n_embd, config.vocab_size, config.n_layer
    matrices = [(v, e), (config.seq_len, e)] + layers * [(3 * e, e), (e, e), (4 * e, e), (e, 4 * e)]
    # Per block: two LayerNorms (weight, bias), the biases of c_attn, c_proj, c_fc, c_proj.
    vectors = layers * (2 * 2 * e + 3 * e + e + 4 * e + e) + 2 * e  # and ln_f
    expected = 4 * (sum(a + b for a, b in matrices) + vectors)
    assert r["state_of_every_param"] == expected
    assert expected / r["num_params"] == pytest.approx(0.0380, abs=1e-4)
    assert math.isclose(sum(r["cost"]), r["num_params"])  # cost = elements, every param whole
