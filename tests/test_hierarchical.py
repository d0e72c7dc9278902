"""Hierarchical data parallelism: shard over "dp_shard", replicate over "dp_replicate".

Four gloo ranks run every case in one spawned group. Each case builds a 2-D mesh
(replicate, shard) and trains the parity model on its slice of the global batch, against
single-process torch.optim on the whole batch; it also counts what each group carried and
measures what each rank holds. A checkpoint saved at (2, 2) is resumed by the same four ranks
flat, and by a second group of two ranks flat and at (1, 2). See
[Note: hierarchical data parallelism] in distopt/parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt
from distopt import collectives as comm
from distopt.checkpoint import merge_state_dicts

from dist_harness import case_result, run_cases
from models import AwkwardLM, TinyTransformer, batches, rank_slice
from test_checkpoint import _state_diff
from test_fp32_accumulation import _local_loss, _owned_pieces, error_report, fp32_average
from test_parity import (
    BF16_TOL,
    CLIP,
    FP32_TOL,
    NORM_RTOL,
    _groups,
    _lm_loss,
    _max_diff,
    fp32_master_step,
)

WORLD = 4
LAYOUTS = [(2, 2), (1, 4), (4, 1)]
FP32_ACCUMULATION_LAYOUTS = [(2, 2), (4, 1)]
STEPS = 20


def _mesh(replicate: int, shard: int):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def parity(replicate: int, shard: int, dtype: torch.dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM().to(dtype)
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(
        model, bucket_size=40, find_unused_parameters=True, device_mesh=_mesh(replicate, shard)
    )
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, params=_groups(model, "adamw"), clip_grad=CLIP,
        overlap_param_gather=True, lr=1e-2,
    )
    sched = CosineAnnealingLR(opt, T_max=STEPS)
    # The reference keeps fp32 master weights and casts them into the model after each step.
    trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().float()) for p in trainable]
    index = {p: i for i, p in enumerate(trainable)}
    ref_groups = [{**g, "params": [masters[index[p]] for p in g["params"]]}
                  for g in _groups(ref, "adamw")]
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2)
    ref_sched = CosineAnnealingLR(ref_opt, T_max=STEPS)

    worst, worst_norm, per_step = 0.0, 0.0, None
    for step in range(STEPS):
        tokens, targets = batches(step)
        ddp.comm_stats.reset()
        opt.zero_grad()
        _lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                 step).backward()
        result = opt.step()
        sched.step()
        per_step = (dict(ddp.comm_stats.calls), dict(ddp.comm_stats.bytes))

        ref_norm = fp32_master_step(trainable, masters, ref_opt,
                                    _lm_loss(ref, tokens, targets, step))
        ref_sched.step()

        ddp.finish_param_sync()
        worst = max(worst, _max_diff(model, ref))
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norm.item() - 1))
    report = distopt.measure_state_bytes(opt)
    padded = sum(buf.layout.numel for buf in ddp.flat_buffers)
    owned_padded = sum(b.owned_grad.numel() for b in ddp.buckets)
    return {
        "max_diff": worst, "norm_diff": worst_norm, "calls": per_step[0], "bytes": per_step[1],
        "buckets": len(ddp.buckets), "padded": padded, "owned_padded": owned_padded,
        "dp_size": ddp.dp_size, "report": report, "moved": _max_diff(model, AwkwardLM()),
        "owned": sum(m.numel() for m in opt.main_params),
        "num_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


SAVE_AT, END = 3, 6


def _build_for_checkpoint(mesh):
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, device_mesh=mesh)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, params=_groups(model, "adamw"), clip_grad=CLIP, lr=1e-2
    )
    return model, ddp, opt


def _train(ddp, opt, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = batches(step)
        opt.zero_grad()
        _lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                 step).backward()
        opt.step()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def save_hierarchical(replicate: int, shard: int, path: str) -> dict:
    """Train at (replicate, shard) to SAVE_AT, save, train on to END; write each rank's
    in-memory state dict and (rank 0) the trajectory, for the resumes to compare with."""
    model, ddp, opt = _build_for_checkpoint(_mesh(replicate, shard))
    _train(ddp, opt, range(SAVE_AT))
    distopt.save_checkpoint(path, ddp, opt)
    torch.save(opt.state_dict(), f"{path}-sd-{dist.get_rank()}.pt")
    ref = {"saved": _params(model)}
    _train(ddp, opt, range(SAVE_AT, END))
    ref["final"] = _params(model)
    if dist.get_rank() == 0:
        torch.save(ref, f"{path}-ref.pt")
    return {"moved": _max_diff(model, AwkwardLM())}


def resume(path: str, layout: tuple[int, int] | None, saved_world: int) -> dict:
    """Load the checkpoint at ``layout`` (a (replicate, shard) mesh, or None: flat over every
    rank) and train to END on the same global batches: the params and the optimizer state at
    the load are exactly the saved ones, and the end is the uninterrupted run's."""
    model, ddp, opt = _build_for_checkpoint(None if layout is None else _mesh(*layout))
    distopt.load_checkpoint(path, ddp, opt)
    ref = torch.load(f"{path}-ref.pt")
    at_load = max(
        (p.detach() - ref["saved"][k]).abs().max().item() for k, p in model.named_parameters()
    )
    saved = merge_state_dicts(
        [torch.load(f"{path}-sd-{r}.pt", weights_only=False) for r in range(saved_world)]
    )
    state_diff = _state_diff(opt, saved)
    _train(ddp, opt, range(SAVE_AT, END))
    final = max(
        (p.detach() - ref["final"][k]).abs().max().item() for k, p in model.named_parameters()
    )
    return {"at_load": at_load, "state_diff": state_diff, "final": final,
            "dp_size": ddp.dp_size, "replicas": ddp.parallel.replicate_size,
            "owned": sum(m.numel() for m in opt.main_params)}


def fp32_accumulated_reduction(replicate: int, shard: int) -> dict:
    """bf16 grads with reduce_scatter_with_fp32_accumulation on a mesh: each stage sums in
    fp32 and rounds once, so every owned piece is the fp32 average over the replicas of the
    shard groups' rounded fp32 averages, bit for bit; see
    [Note: fp32-accumulated reduce-scatter]. Every rank's bf16 grads are recomputed here on a
    reference copy, so the exact average is known."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    per_rank = []
    for r in range(world):
        ref.zero_grad()
        _local_loss(ref, 0, r, world).backward()
        per_rank.append([p.grad.clone() for p in ref.parameters()])
    ddp = distopt.DistributedDataParallel(
        model, grad_dtype=torch.bfloat16, bucket_size=5000, device_mesh=_mesh(replicate, shard),
        reduce_scatter_with_fp32_accumulation=True,
    )
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.0)
    opt.zero_grad()
    ddp.comm_stats.reset()
    _local_loss(ddp, 0, rank, world).backward()
    ddp.finish_grad_sync()
    index = {p: i for i, p in enumerate(model.parameters())}
    two_stage, single, pieces, worst = True, True, 0, -1.0
    for param, piece in _owned_pieces(ddp):
        rows = [grads[index[param]].reshape(-1)[piece] for grads in per_rank]
        groups = [fp32_average(rows[k * shard : (k + 1) * shard], torch.bfloat16)
                  for k in range(replicate)]
        got = param.main_grad.reshape(-1)[piece]
        two_stage &= torch.equal(got, fp32_average(groups, torch.bfloat16))
        single &= torch.equal(got, fp32_average(rows, torch.bfloat16))
        worst = max(worst, error_report(got, rows)["over_half_ulp"])
        pieces += 1
    # The collective alone: the replicas' copies summed in fp32 in replica order, rounded once;
    # the all-gather version (NCCL's) gives the same bits on gloo too.
    group = ddp.parallel.replicate_group
    copies = [torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
              for r in dist.get_process_group_ranks(group)]
    mine = copies[dist.get_rank(group)]
    p2p, gathered = mine.clone(), mine.clone()
    comm.all_reduce_avg_fp32_accum(p2p, group, async_op=True).wait()
    comm._all_gather_all_reduce_fp32(gathered, group, async_op=False)
    return {"two_stage": two_stage, "single_rounding": single, "over_half_ulp": worst,
            "pieces": pieces, "buckets": len(ddp.buckets), "calls": dict(ddp.comm_stats.calls),
            "bytes": dict(ddp.comm_stats.bytes),
            "owned_padded": sum(b.owned_grad.numel() for b in ddp.buckets),
            "collective": torch.equal(p2p, fp32_average(copies, torch.bfloat16)),
            "gathered_same": torch.equal(gathered, p2p)}


def fp32_accumulated_parity(replicate: int, shard: int) -> dict:
    """bf16 params and grads with fp32-accumulated reductions on a mesh against a reference
    keeping fp32 master weights, AdamW with clipping: the flat path's test (in
    test_fp32_accumulation.py) on a mesh."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().float()) for p in trainable]
    ddp = distopt.DistributedDataParallel(
        model, grad_dtype=torch.bfloat16, bucket_size=40, find_unused_parameters=True,
        device_mesh=_mesh(replicate, shard), reduce_scatter_with_fp32_accumulation=True,
    )
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    worst = 0.0
    for step in range(10):
        tokens, targets = batches(step)
        opt.zero_grad()
        _lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                 step).backward()
        opt.step()
        fp32_master_step(trainable, masters, ref_opt, _lm_loss(ref, tokens, targets, step))
        worst = max(worst, _max_diff(model, ref))
    return {"max_diff": worst, "moved": _max_diff(model, initial),
            "fp32_buckets": sum(b.fp32_accumulation for b in ddp.buckets),
            "buckets": len(ddp.buckets)}


def bad_meshes() -> dict:
    out = {}
    meshes = {
        "unknown-name": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("nodes", "gpus")),
        "dp-and-dp-shard": lambda: init_device_mesh(
            "cpu", (1, 2, 2), mesh_dim_names=("dp", "dp_replicate", "dp_shard")),
    }
    for name, make in meshes.items():
        try:
            distopt.DistributedDataParallel(AwkwardLM(), device_mesh=make())
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def nan_check_names_the_rank() -> str:
    """A nan in the own grads of the last rank (replica 1, shard 1) is named, with that rank,
    on every rank of both replicas."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, overlap_grad_reduce=False,
                                          check_for_nan_in_grad=True, device_mesh=_mesh(2, 2))
    tokens, targets = (rank_slice(t, rank, world) for t in batches(0))
    _lm_loss(ddp, tokens, targets, 0).backward()
    if rank == world - 1:
        model.l2.weight.main_grad[0, 0] = float("nan")  # before the reduction: launched later
    try:
        ddp.finish_grad_sync()
    except FloatingPointError as error:
        return str(error)
    return "no error"


def _cases(tmp: str) -> list:
    cases = [("nan-check-2x2", nan_check_names_the_rank, ())]
    for r, s in LAYOUTS:
        cases.append((f"fp32-{r}x{s}", parity, (r, s, torch.float32)))
    cases.append(("bf16-2x2", parity, (2, 2, torch.bfloat16)))
    for r, s in FP32_ACCUMULATION_LAYOUTS:
        cases.append((f"fp32acc-reduction-{r}x{s}", fp32_accumulated_reduction, (r, s)))
    cases.append(("fp32acc-parity-2x2", fp32_accumulated_parity, (2, 2)))
    cases.append(("save-2x2", save_hierarchical, (2, 2, f"{tmp}/ckpt-2x2")))
    cases.append(("resume-flat4", resume, (f"{tmp}/ckpt-2x2", None, WORLD)))
    cases.append(("bad-meshes", bad_meshes, ()))
    return cases


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hier"))


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_cases(WORLD, _cases(checkpoints))


@pytest.fixture(scope="module")
def resumed_on_two(results, checkpoints):
    """The checkpoint saved at (2, 2) on four ranks, resumed by two: flat, and on a (1, 2) mesh."""
    case_result(results, "save-2x2")
    path = f"{checkpoints}/ckpt-2x2"
    return run_cases(2, [("resume-flat2", resume, (path, None, WORLD)),
                         ("resume-1x2", resume, (path, (1, 2), WORLD))])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_trains_like_single_process_torch(results, layout):
    r, s = layout
    for v in case_result(results, f"fp32-{r}x{s}"):
        assert v["dp_size"] == s
        assert v["max_diff"] < FP32_TOL, v["max_diff"]
        assert v["norm_diff"] < NORM_RTOL, v["norm_diff"]
        assert v["moved"] > 0.05


def test_bf16_params_with_fp32_masters(results):
    for v in case_result(results, "bf16-2x2"):
        assert v["max_diff"] < BF16_TOL, v["max_diff"]
        assert v["moved"] > 0.05


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_each_group_carries_what_it_should(results, layout):
    r, s = layout
    for v in case_result(results, f"fp32-{r}x{s}"):
        calls, nbytes, n = v["calls"], v["bytes"], v["buckets"]
        # The shard group: one reduce-scatter and one all-gather per bucket (none when s = 1).
        assert calls.get("reduce_scatter", 0) == (n if s > 1 else 0)
        assert calls.get("all_gather", 0) == (n if s > 1 else 0)
        # The replicate group: this rank's reduced chunk of every bucket, N/s elements, once.
        assert calls.get("replicate_all_reduce", 0) == (n if r > 1 else 0)
        assert nbytes.get("replicate_all_reduce", 0) == (4 * v["padded"] // s if r > 1 else 0)
        assert v["owned_padded"] * s == v["padded"]
        assert "all_reduce" not in calls


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_memory_is_the_table_at_the_shard_size(results, layout):
    r, s = layout
    values = case_result(results, f"fp32-{r}x{s}")
    for v in values:
        report, padded = v["report"], v["padded"]
        assert report.params == report.grads == 4 * padded
        assert report.main_params == report.main_grads == 0  # views, fp32 params and grads
        assert report.optimizer_state == 8 * v["owned"]
    # The ranks of one replica (global ranks 0..s-1) own every element once: state is 8/s.
    assert sum(v["owned"] for v in values[:s]) == values[0]["num_params"]
    assert all(v["owned"] == values[i % s]["owned"] for i, v in enumerate(values))


@pytest.mark.parametrize("layout", FP32_ACCUMULATION_LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_fp32_accumulation_sums_both_stages_in_fp32(results, layout):
    r, s = layout
    for v in case_result(results, f"fp32acc-reduction-{r}x{s}"):
        assert v["pieces"] > 0 and v["buckets"] >= 3
        # Each stage's fp32 sum, rounded once: the same bits on every rank.
        assert v["two_stage"], v
        if s == 1:
            # Nothing to round in the shard group: one rounding in all, as flat.
            assert v["single_rounding"] and v["over_half_ulp"] <= 0, v
        # Overlapped as the plain path: both stages of every bucket start during backward
        # (counted once each); the replicate stage carries the owned chunk.
        assert v["calls"].get("reduce_scatter", 0) == (v["buckets"] if s > 1 else 0)
        assert v["calls"]["replicate_all_reduce"] == v["buckets"]
        assert v["bytes"]["replicate_all_reduce"] == 2 * v["owned_padded"]
        assert v["collective"] and v["gathered_same"]


def test_fp32_accumulation_trains_like_fp32_master_weights(results):
    for v in case_result(results, "fp32acc-parity-2x2"):
        assert v["fp32_buckets"] == v["buckets"]
        assert v["max_diff"] <= BF16_TOL, v  # the flat path's tolerance
        assert v["moved"] > 2 * BF16_TOL


def test_checkpoint_saved_hierarchical_resumes_flat(results):
    for v in case_result(results, "save-2x2"):
        assert v["moved"] > 0.05
    for v in case_result(results, "resume-flat4"):
        assert (v["dp_size"], v["replicas"]) == (4, 1)
        assert v["at_load"] == 0.0 and v["state_diff"] == 0.0, v
        # Another summation order of the same average (two stages against one): round-off.
        assert v["final"] < 1e-6, v


@pytest.mark.parametrize("name", ["resume-flat2", "resume-1x2"])
def test_checkpoint_saved_hierarchical_resumes_on_two_ranks(resumed_on_two, name):
    values = case_result(resumed_on_two, name)
    for v in values:
        assert (v["replicas"], v["dp_size"]) == (1, 2)
        assert v["at_load"] == 0.0 and v["state_diff"] == 0.0, v
        assert v["final"] <= FP32_TOL, v  # test_checkpoint.py's bound at another DP size
    # The two ranks together own every element once, as each replica did at (2, 2).
    assert sum(v["owned"] for v in values) == sum(
        p.numel() for p in AwkwardLM().parameters() if p.requires_grad)


def test_bad_meshes_name_the_fix(results):
    for v in case_result(results, "bad-meshes"):
        assert "name it 'dp'" in v["unknown-name"] and "dp_replicate" in v["unknown-name"]
        assert "either 'dp'" in v["dp-and-dp-shard"]


def test_nan_check_names_the_rank_across_replicas(results):
    for message in case_result(results, "nan-check-2x2"):
        assert f"parameter 'l2.weight' produced on rank {WORLD - 1} " in message, message
