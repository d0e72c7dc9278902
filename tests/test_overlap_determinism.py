"""Overlap changes no bit: ``overlap_grad_reduce`` and ``overlap_param_gather``, each on or off,
give the same params, optimizer state and grad norms, bit for bit, step after step.

Overlap moves when a bucket's collective is issued and waited for, never what it sums or in
which order (see [Note: bucket launch order] in ddp/wrapper.py and [Note: collectives on gloo] in
comm/collectives.py), so any difference is a bug: a grad that reached a bucket after its launch, a
forward that read a param before its gather, a summation whose order followed arrival times.
Each case trains the same model on the same data four times (the two switches on and off) and
compares every step's grad norm, this rank's main params and optimizer state, and the whole
model, against the run with both off. The grid: fp32 and bf16 (bf16 grads, summed in bf16 or
in fp32), AdamW alone and Muon with AdamW (whole-tensor ownership), on a flat group of 4 ranks
(at d = 2 a sum of two terms has no order to get wrong) and on a (2 replicas x 2 shards) mesh;
one spawned group. Every case also checks that overlap really happened (reductions launched
during backward, gathers still in flight after the step), so equality is not that of two
synchronous runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distopt

from dist_harness import case_result, run_cases
from models import TinyTransformer, markov_batch, rank_slice

# Every case runs on four ranks: the quick loop (-m "not slow") keeps to two.
pytestmark = pytest.mark.slow

# Bitwise equality fails at the first step that differs, so the steps need not be many: three
# give a first step from a fresh optimizer and two that step its state (moments, momentum,
# Muon's buffers), each with overlapped reductions and gathers left in flight.
STEPS = 3
MICRO = 2  # micro-batches per step, all but the last under no_sync
CLIP = 0.5
BUCKET = 3000  # elements: 13 buckets of the 28k-param model, each over every rank
ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.01}
MUON = {"lr": 0.02, "momentum": 0.9}
PRECISIONS = {
    # name: (param dtype, grad dtype, reduce_scatter_with_fp32_accumulation)
    "fp32": (torch.float32, torch.float32, False),
    "bf16": (torch.bfloat16, None, False),
    "bf16-fp32-accum": (torch.bfloat16, None, True),
}
SWITCHES = list(itertools.product((False, True), repeat=2))  # (grad reduce, param gather)


def _optimizer(ddp, model: TinyTransformer, kind: str,
               overlap: bool) -> distopt.DistributedOptimizer:
    if kind == "adamw":
        return distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, **ADAMW,
                                            overlap_param_gather=overlap)
    # Muon for the blocks' matrices, each owned whole by one rank; AdamW for the rest.
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks")]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    groups = [{"params": matrices, **MUON},
              {"params": rest, "optimizer": torch.optim.AdamW, **ADAMW}]
    return distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=groups, clip_grad=CLIP,
                                        overlap_param_gather=overlap)


def _run(precision: str, kind: str, mesh, overlap_grads: bool, overlap_params: bool) -> dict:
    """Train STEPS steps; every step's grad norm, main params and state, and the final model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    param_dtype, grad_dtype, fp32_accum = PRECISIONS[precision]
    torch.manual_seed(0)
    model = TinyTransformer().to(param_dtype)
    ddp = distopt.DistributedDataParallel(
        model, grad_dtype=grad_dtype, bucket_size=BUCKET, overlap_grad_reduce=overlap_grads,
        reduce_scatter_with_fp32_accumulation=fp32_accum, device_mesh=mesh,
    )
    initial = [p.detach().clone() for p in model.parameters()]
    opt = _optimizer(ddp, model, kind, overlap_params)
    steps, launched_in_backward, gathers_in_flight = [], [], []
    for step in range(STEPS):
        tokens, targets = markov_batch(step, global_batch=4 * MICRO * world)
        mine = [rank_slice(t, rank, world).chunk(MICRO) for t in (tokens, targets)]
        opt.zero_grad()
        ddp.comm_stats.reset()
        for i in range(MICRO):
            loss = model.loss(mine[0][i], mine[1][i]) / MICRO
            if i < MICRO - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        launched_in_backward.append(ddp.comm_stats.calls["reduce_scatter"])
        result = opt.step()
        gathers_in_flight.append(ddp.param_gathers_in_flight)
        steps.append({
            "grad_norm": result.grad_norm,
            "main": [m.detach().clone() for m in opt.main_params],
            "state": [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[m].items()}
                      for m in opt.main_params],
        })
    ddp.finish_param_sync()
    return {
        "steps": steps,
        "model": [p.detach().clone() for p in model.parameters()],
        "moved": max((p.float() - q.float()).abs().max().item()
                     for p, q in zip(model.parameters(), initial, strict=True)),
        "launched_in_backward": launched_in_backward,
        "gathers_in_flight": gathers_in_flight,
        "buckets": len(ddp.buckets),
    }


def _differences(a: dict, b: dict) -> list[str]:
    """Where run ``b`` is not bitwise run ``a``."""
    found = []
    for step, (x, y) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        if x["grad_norm"] != y["grad_norm"]:
            found.append(f"step {step}: grad norm {x['grad_norm']!r} != {y['grad_norm']!r}")
        for i, (mx, my) in enumerate(zip(x["main"], y["main"], strict=True)):
            if not torch.equal(mx, my):
                found.append(f"step {step}: main param {i}")
        for i, (sx, sy) in enumerate(zip(x["state"], y["state"], strict=True)):
            for key in sx:
                same = (torch.equal(sx[key], sy[key]) if torch.is_tensor(sx[key])
                        else sx[key] == sy[key])
                if not same:
                    found.append(f"step {step}: state {key!r} of main param {i}")
    for i, (px, py) in enumerate(zip(a["model"], b["model"], strict=True)):
        if not torch.equal(px, py):
            found.append(f"final model param {i}")
    return found


def overlap_changes_no_bit(precision: str, kind: str, hierarchical: bool) -> dict:
    mesh = (init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                             mesh_dim_names=("dp_replicate", "dp_shard"))
            if hierarchical else None)
    runs = {switches: _run(precision, kind, mesh, *switches) for switches in SWITCHES}
    reference = runs[(False, False)]
    return {
        "differences": {s: _differences(reference, run) for s, run in runs.items()},
        "launched_in_backward": {s: run["launched_in_backward"] for s, run in runs.items()},
        "gathers_in_flight": {s: run["gathers_in_flight"] for s, run in runs.items()},
        "buckets": reference["buckets"],
        "norms": [s["grad_norm"] for s in reference["steps"]],
        "moved": reference["moved"],
        "states": sum(len(s) for s in reference["steps"][-1]["state"]),
    }


# Flat at d = 4: three or more ranks, where the order of a sum could follow arrival times; the
# (2 x 2) mesh adds the replicate stage. bf16 grads summed in fp32 have their own collectives.
GRID = [
    *((p, k, h) for h in (False, True) for p in ("fp32", "bf16") for k in ("adamw", "muon")),
    ("bf16-fp32-accum", "adamw", False),
    ("bf16-fp32-accum", "muon", True),
]
WORLD = 4


def _name(precision: str, kind: str, hierarchical: bool) -> str:
    return f"{precision}-{kind}-{'hierarchical' if hierarchical else 'flat'}"


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, [(_name(*c), overlap_changes_no_bit, c) for c in GRID])


@pytest.mark.parametrize("case", GRID, ids=[_name(*c) for c in GRID])
def test_overlap_changes_no_bit(results, case):
    for rank, value in enumerate(case_result(results, _name(*case))):
        for switches, found in value["differences"].items():
            assert not found, f"rank {rank}, (grad reduce, param gather) = {switches}: {found}"
        # The switches did what they say: reductions launched during backward only with
        # overlap_grad_reduce (on the steps that use every layer: on odd ones the first
        # bucket waits for the sync), gathers left in flight after the step only with
        # overlap_param_gather.
        for (grads, _), launched in value["launched_in_backward"].items():
            assert (max(launched) > 0) if grads else (max(launched) == 0), launched
        for (_, params), pending in value["gathers_in_flight"].items():
            assert (min(pending) > 0) if params else (max(pending) == 0), pending
        # Something to compare: several buckets, finite norms, weights that moved, state on
        # every rank.
        assert value["buckets"] >= 3
        assert all(n is not None and 0 < n < float("inf") for n in value["norms"])
        assert value["moved"] > 1e-3 and value["states"] > 0
