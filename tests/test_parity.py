"""The parity grid: distopt against single-process torch.optim, d = 1..4.

Every point of the grid (helpers.ParityRun) trains AwkwardLM on this rank's slice of the same
global batches with distopt and, in the same process, a plain torch reference on the full
batches (with fp32 master weights when the params are in low precision); the cases return the
largest difference seen after any step, what the last step sent and what each rank holds. The
axes: the optimizer (AdamW, SGD, Adagrad), the param and grad dtypes, fp32-accumulated
reductions, None or zero grads for unused params, overlap on or off, param groups with a
schedule or one group, the mesh (flat, or replicate x shard at d = 4; see
[Note: hierarchical data parallelism]) and d. Also here: no_sync accumulation and the memory
table. One spawned group per world size runs the whole grid.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import distopt

from dist_harness import case_result, run_cases
from helpers import (
    BF16_TOL,
    FP32_TOL,
    NORM_RTOL,
    PARITY_OPTIMIZERS,
    ParityRun,
    lm_loss,
    max_diff,
    parity_trajectory,
    world_params,
)
from models import AwkwardLM, batches, mlp, rank_slice

BF16 = torch.bfloat16
# name -> the point of the grid; the flat points run at every d
FLAT = {
    **{f"fp32-{name}": ParityRun(optimizer=name) for name in PARITY_OPTIMIZERS},
    "fp32-adamw-no-overlap": ParityRun(overlap_grad=False, overlap_gather=False),
    "bf16-fp32grads": ParityRun(dtype=BF16, groups=False, overlap_gather=False),
    "bf16-bf16grads": ParityRun(dtype=BF16, grad_dtype=BF16, groups=False,
                                overlap_gather=False),
}
# bf16 grads reduced with fp32 accumulation (d > 1)
FP32_ACCUMULATION = ParityRun(dtype=BF16, grad_dtype=BF16, fp32_accumulation=True, groups=False,
                              overlap_gather=False, steps=10)
# d = 4 as (replicate, shard) meshes
LAYOUTS = [(2, 2), (1, 4), (4, 1)]
MESH = {
    **{f"fp32-{r}x{s}": ParityRun(mesh=(r, s)) for r, s in LAYOUTS},
    "bf16-2x2": ParityRun(mesh=(2, 2), dtype=BF16),
    "fp32acc-2x2": dataclasses.replace(FP32_ACCUMULATION, mesh=(2, 2)),
}


def no_sync_accumulation() -> dict:
    """4 micro-batches, the first 3 under no_sync, equal one step on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=40)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    worst, calls_in_no_sync = 0.0, 0
    for step in range(3):
        tokens, targets = batches(step, global_batch=48)
        micro = [(rank_slice(t, rank, world).chunk(4)) for t in (tokens, targets)]
        opt.zero_grad()
        ddp.comm_stats.reset()
        for i in range(4):
            loss = lm_loss(ddp, micro[0][i], micro[1][i], 0) / 4
            if i < 3:
                with ddp.no_sync():
                    loss.backward()
                calls_in_no_sync += sum(ddp.comm_stats.calls.values())
            else:
                loss.backward()
        opt.step()
        ref_opt.zero_grad()
        lm_loss(ref, tokens, targets, 0).backward()
        ref_opt.step()
        worst = max(worst, max_diff(model, ref))
    return {"max_diff": worst, "calls_in_no_sync": calls_in_no_sync,
            "reduce_scatters": ddp.comm_stats.calls["reduce_scatter"],
            "buckets": len(ddp.buckets)}


MEMORY_ROWS = [
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
]


def memory_row(param_dtype: torch.dtype, grad_dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = mlp([64, 96, 80, 33], dtype=param_dtype)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=6000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    model_in = torch.randn(4, 64, dtype=param_dtype)
    opt.zero_grad()
    ddp(model_in).float().square().mean().backward()
    opt.step()
    report = distopt.measure_state_bytes(opt)
    padded = sum(buf.layout.numel for buf in ddp.flat_buffers)
    owned = sum(p.numel() for p in opt.main_params)
    return {"report": report, "padded": padded, "owned": owned,
            "buckets": len(ddp.buckets)}


def _cases(world: int) -> list:
    cases = [(name, parity_trajectory, (run,)) for name, run in FLAT.items()]
    if world > 1:
        cases.append(("fp32acc", parity_trajectory, (FP32_ACCUMULATION,)))
    cases.append(("no-sync", no_sync_accumulation, ()))
    for pd, gd in MEMORY_ROWS:
        cases.append((f"memory-{pd}-{gd}", memory_row, (pd, gd)))
    return cases


WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases(request.param))


@pytest.mark.parametrize("case", ["fp32-adamw", "fp32-sgd", "fp32-adagrad",
                                  "fp32-adamw-no-overlap"])
def test_fp32_parity(world, case):
    _, results = world
    for value in case_result(results, case):
        assert value["max_diff"] <= FP32_TOL, value
        assert value["norm_diff"] <= NORM_RTOL, value
        assert value["moved"] > 1e-2  # training really changed the weights


@pytest.mark.parametrize("case", ["bf16-fp32grads", "bf16-bf16grads"])
def test_bf16_parity(world, case):
    _, results = world
    for value in case_result(results, case):
        assert value["dtypes"] == {torch.bfloat16}
        assert value["max_diff"] <= BF16_TOL, value


def test_no_sync_accumulates_without_communication(world):
    d, results = world
    for value in case_result(results, "no-sync"):
        assert value["max_diff"] <= FP32_TOL, value
        assert value["calls_in_no_sync"] == 0
        # Only the last micro-batch communicates: one reduce-scatter per bucket.
        assert value["reduce_scatters"] == (value["buckets"] if d > 1 else 0)


@pytest.mark.parametrize("param_dtype,grad_dtype", MEMORY_ROWS)
def test_memory_matches_design_table(world, param_dtype, grad_dtype):
    d, results = world
    values = case_result(results, f"memory-{param_dtype}-{grad_dtype}")
    psize = param_dtype.itemsize
    gsize = grad_dtype.itemsize
    main_p = 4 if param_dtype != torch.float32 else 0
    main_g = 4 if grad_dtype != torch.float32 else 0
    num_params = values[0]["report"].num_params
    theory = distopt.theoretical_bytes_per_param(param_dtype, grad_dtype, d)
    owned_total = 0
    for v in values:
        r, padded = v["report"], v["padded"]
        # Each component is what the design says, for the padded buffer and no more.
        assert r.params == padded * psize
        assert r.grads == padded * gsize
        assert r.main_params == padded // d * main_p
        assert r.main_grads == padded // d * main_g
        assert r.optimizer_state == 8 * v["owned"]
        owned_total += v["owned"]
        padding_bytes = (padded - num_params) * (psize + gsize + (main_p + main_g) / d)
        slack = padding_bytes / num_params + 8 * (v["owned"] - num_params / d) / num_params
        assert r.bytes_per_param == pytest.approx(theory + slack, rel=1e-9)
        assert 0 <= padding_bytes / num_params < 0.2  # padding stays a small excess
    assert owned_total == num_params  # every element's state exists on exactly one rank


# ---------------------------------------------------------------- fp32-accumulated reductions


def test_fp32_accumulation_trains_like_fp32_master_weights(world):
    """bf16 params and bf16 grads reduced with fp32 accumulation, AdamW with clipping, against
    fp32 master weights on the full batch: the flat path's bound (test_fp32_accumulation.py
    checks the reduction itself)."""
    d, results = world
    if d == 1:
        pytest.skip("a reduction needs two ranks")
    for value in case_result(results, "fp32acc"):
        assert value["fp32_buckets"] == value["buckets"]
        assert value["max_diff"] <= BF16_TOL, (d, value)
        assert value["moved"] > 2 * BF16_TOL  # it trained: ~lr per step


# ---------------------------------------------------------------- meshes (d = 4)


@pytest.fixture(scope="module")
def meshes():
    """Every mesh point at d = 4 (the tests that use it are slow)."""
    return run_cases(4, [(name, parity_trajectory, (run,)) for name, run in MESH.items()])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_mesh_trains_like_single_process_torch(meshes, layout):
    """Shard over "dp_shard", replicate over "dp_replicate": each rank trains its slice of the
    global batch, as flat data parallelism at d = 4 does."""
    r, s = layout
    for v in case_result(meshes, f"fp32-{r}x{s}"):
        assert v["dp_size"] == s
        assert v["max_diff"] < FP32_TOL, v["max_diff"]
        assert v["norm_diff"] < NORM_RTOL, v["norm_diff"]
        assert v["moved"] > 0.05


@pytest.mark.slow
def test_mesh_bf16_params_with_fp32_masters(meshes):
    for v in case_result(meshes, "bf16-2x2"):
        assert v["max_diff"] < BF16_TOL, v["max_diff"]
        assert v["moved"] > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_mesh_each_group_carries_what_it_should(meshes, layout):
    r, s = layout
    for v in case_result(meshes, f"fp32-{r}x{s}"):
        calls, nbytes, n = v["calls"], v["bytes"], v["buckets"]
        # The shard group: one reduce-scatter and one all-gather per bucket (none when s = 1).
        assert calls.get("reduce_scatter", 0) == (n if s > 1 else 0)
        assert calls.get("all_gather", 0) == (n if s > 1 else 0)
        # The replicate group: this rank's reduced chunk of every bucket, N/s elements, once.
        assert calls.get("replicate_all_reduce", 0) == (n if r > 1 else 0)
        assert nbytes.get("replicate_all_reduce", 0) == (4 * v["padded"] // s if r > 1 else 0)
        assert v["owned_padded"] * s == v["padded"]
        assert "all_reduce" not in calls


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_mesh_memory_is_the_table_at_the_shard_size(meshes, layout):
    r, s = layout
    values = case_result(meshes, f"fp32-{r}x{s}")
    for v in values:
        report, padded = v["report"], v["padded"]
        assert report.params == report.grads == 4 * padded
        assert report.main_params == report.main_grads == 0  # views, fp32 params and grads
        assert report.optimizer_state == 8 * v["owned"]
    # The ranks of one replica (global ranks 0..s-1) own every element once: state is 8/s.
    assert sum(v["owned"] for v in values[:s]) == values[0]["num_params"]
    assert all(v["owned"] == values[i % s]["owned"] for i, v in enumerate(values))


@pytest.mark.slow
def test_mesh_fp32_accumulation_trains_like_fp32_master_weights(meshes):
    """bf16 params and grads with fp32-accumulated reductions on a (2, 2) mesh against a
    reference keeping fp32 master weights, AdamW with clipping: the flat path's test on a
    mesh."""
    for v in case_result(meshes, "fp32acc-2x2"):
        assert v["fp32_buckets"] == v["buckets"]
        assert v["max_diff"] <= BF16_TOL, v  # the flat path's tolerance
        assert v["moved"] > 2 * BF16_TOL
