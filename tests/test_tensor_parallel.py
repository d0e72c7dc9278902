"""distopt over DTensor params on a 2-D (dp, tp) mesh, against single-process torch.optim.

Every rank parallelizes a small transformer block over its TP submesh, wraps it in distopt over
its DP submesh and trains its DP slice of the global batches; in the same process a plain copy
of the block trains on the full batches with torch.optim.AdamW and clip_grad_norm_. The cases
compare full tensors (``full_tensor()``) after every step. One 4-rank group runs the grid.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
)

import distopt
from distopt.optim.remainders import bf16_of_fp32
from distopt.parallel.tensor_parallel import some_shard_is_empty

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, NORM_RTOL, error_of, full, max_diff
from models import TP_BATCH, TP_DIM, TP_FFN, TP_HEAD_DIM, TP_HEADS, TP_SEQ, Block, batch, tp_plan

# Every case runs on four ranks: the quick loop (-m "not slow") keeps to two.
pytestmark = pytest.mark.slow

WORLD = 4
# AdamW: within helpers.FP32_TOL and NORM_RTOL, the drift of its fp32 roundoff. The test takes
# the largest difference over every step, so fewer steps compare a part of what more did, under
# the same bounds. Five steps step the moments four times and move the weights by several lr;
# a grad lost or a shard stepped twice is off by about lr (1e-2) from its first step.
STEPS = 5
CLIP = 0.05  # below every step's grad norm here, so every step clips


def mesh_2d(dp: int, tp: int, names: tuple[str, str] = ("dp", "tp")) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(WORLD).reshape(dp, tp), mesh_dim_names=names)


def tp_block(mesh: DeviceMesh, sequence_parallel: bool = False) -> tuple[Block, Block]:
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel))
    return model, ref


def parity(dp: int, tp: int, sharded: bool, sequence_parallel: bool) -> dict:
    """STEPS steps of AdamW + clip at (dp, tp) against the single-process reference."""
    mesh = mesh_2d(dp, tp)
    dp_rank, tp_rank = mesh.get_coordinate()
    model, ref = tp_block(mesh, sequence_parallel)
    ddp = distopt.DistributedDataParallel(
        model, device_mesh=mesh, bucket_size=100, use_distributed_optimizer=sharded
    )
    cls = distopt.DistributedOptimizer if sharded else distopt.BasicOptimizer
    kwargs = {"overlap_param_gather": True} if sharded else {}
    opt = cls(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2, weight_decay=0.1, **kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)

    # The buffers hold local shards, and the DTensors' local tensors alias them.
    aliased = all(
        p.to_local().untyped_storage().data_ptr()
        == ddp.buffer_of[p].param_data.untyped_storage().data_ptr()
        and p.main_grad.untyped_storage().data_ptr()
        == ddp.buffer_of[p].grad_data.untyped_storage().data_ptr()
        and type(p.main_grad) is torch.Tensor
        for p in model.parameters()
        if isinstance(p, DTensor)
    )
    worst = worst_norm = 0.0
    clipped, calls = 0, []
    for step in range(STEPS):
        x, y = batch(step)
        per = TP_BATCH // dp
        mine = (slice(dp_rank * per, (dp_rank + 1) * per),)
        if sequence_parallel:  # and this TP rank's chunk of the sequence
            mine += (slice(tp_rank * TP_SEQ // tp, (tp_rank + 1) * TP_SEQ // tp),)
        opt.zero_grad()
        ddp.comm_stats.reset()
        loss = F.mse_loss(ddp(x[mine]), y[mine])
        # Under SP each TP rank's loss covers 1/tp of the sequence, and TP backward sums them.
        (loss / tp if sequence_parallel else loss).backward()
        result = opt.step()
        calls.append(dict(ddp.comm_stats.calls))

        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        ref_opt.step()
        clipped += ref_norm > CLIP

        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norm - 1))
    torch.manual_seed(0)
    return {
        "max_diff": worst,
        "norm_diff": worst_norm,
        "clipped": clipped,
        "moved": max_diff(model, Block()),
        "aliased": aliased,
        "dtensors": sorted(
            (n, str(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)
        ),
        "dp_ranks": dist.get_process_group_ranks(ddp.process_group) if dp > 1 else None,
        "mesh_dp_ranks": mesh["dp"].mesh.tolist(),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                           for p in model.parameters()),
        "global_numel": sum(p.numel() for p in model.parameters()),
        "buffer_numel": sum(b.layout.numel for b in ddp.flat_buffers),
        "buckets": len(ddp.buckets),
        "calls": calls,
        "reduce_groups": len(opt._reduce_groups),
    }


def remainders_match_fp32_masters() -> dict:
    """bf16 params and grads at dp=2, tp=2 with sequence parallelism (replicated LayerNorm
    DTensors, counted once in the norm): with store_param_remainders, whose step sees the
    grads one bucket at a time, against the fp32-master path. Both see the same grads until a
    tie event changes a forward (see [Note: param remainders])."""
    mesh = mesh_2d(2, 2)
    dp_rank, tp_rank = mesh.get_coordinate()
    runs = {}
    for remainders in (True, False):
        torch.manual_seed(0)
        model = Block().to(torch.bfloat16)
        parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel=True))
        ddp = distopt.DistributedDataParallel(model, device_mesh=mesh, bucket_size=100,
                                              grad_dtype=torch.bfloat16)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
                                           log_num_zeros=True, store_param_remainders=remainders)
        runs[remainders] = (ddp, opt)
    out = {"results": {True: [], False: []}, "same_masters": [], "ties": []}
    for step in range(4):
        x, y = batch(step)
        mine = (slice(dp_rank * TP_BATCH // 2, (dp_rank + 1) * TP_BATCH // 2),
                slice(tp_rank * TP_SEQ // 2, (tp_rank + 1) * TP_SEQ // 2))
        for remainders, (ddp, opt) in runs.items():
            opt.zero_grad()
            (F.mse_loss(ddp(x[mine].bfloat16()).float(), y[mine]) / 2).backward()
            result = opt.step()
            out["results"][remainders].append((result.grad_norm, result.num_zeros))
            ddp.finish_param_sync()
        masters = runs[True][1].main_param_values()
        out["same_masters"].append(all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(masters, runs[False][1].main_param_values(), strict=True)))
        ties = sum(int((bf16_of_fp32(m).view(torch.int16)
                        != m.to(torch.bfloat16).view(torch.int16)).sum()) for m in masters)
        count = torch.tensor([ties])
        dist.all_reduce(count)
        out["ties"].append(int(count.item()))
    out["buckets"] = len(runs[True][0].buckets)
    return out


def scaler_skips_inf_on_one_tp_rank() -> dict:
    """An inf in one TP rank's grads skips the step on every rank of the mesh."""
    mesh = mesh_2d(2, 2)
    model, _ = tp_block(mesh)
    ddp = distopt.DistributedDataParallel(
        model, device_mesh=mesh, bucket_size=100, overlap_grad_reduce=False
    )
    scaler = distopt.DynamicLossScaler(initial_scale=2.0**8, hysteresis=1)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, loss_scaler=scaler, lr=1e-2)
    updated, changed, scales = [], [], []
    for step in range(3):
        x, y = batch(step)
        before = [full(p).clone() for p in model.parameters()]
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(ddp(x), y)).backward()
        if step == 1 and tuple(mesh.get_coordinate()) == (0, 1):
            model.fc1.weight.main_grad[0, 0] = float("inf")  # only this rank, before the sync
        updated.append(opt.step().updated)
        scales.append(scaler.scale)
        after = [full(p) for p in model.parameters()]
        changed.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    return {"updated": updated, "changed": changed, "scales": scales}


def nan_check_raises_on_every_rank() -> str:
    """check_for_nan_in_grad agrees over DP and TP: a nan on one rank raises on all four."""
    mesh = mesh_2d(2, 2)
    model, _ = tp_block(mesh)
    ddp = distopt.DistributedDataParallel(
        model, device_mesh=mesh, overlap_grad_reduce=False, check_for_nan_in_grad=True
    )
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    if tuple(mesh.get_coordinate()) == (0, 1):
        model.fc2.weight.main_grad[0, 0] = float("nan")
    try:
        ddp.finish_grad_sync()
    except FloatingPointError as e:
        return str(e)
    return "no error"


def p_grad_of_dtensors_refused() -> dict:
    """torch's clip_grad_norm_ over a TP model's params raises on every rank at the first
    DTensor param's p.grad, naming it, before any collective; a replicated param's p.grad
    answers (the same on every rank), and the step goes on."""
    mesh = mesh_2d(2, 2)
    model, _ = tp_block(mesh)
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    x, y = batch(mesh.get_coordinate()[0])
    F.mse_loss(ddp(x), y).backward()
    try:
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    replicated = model.ln2.weight.grad.norm().item()
    return {"message": message, "replicated": replicated, "updated": opt.step().updated}


def errors() -> dict:
    mesh = mesh_2d(2, 2)
    one = DeviceMesh("cpu", torch.arange(WORLD).reshape(WORLD, 1), mesh_dim_names=("a", "b"))
    out = {}

    def sharded_along(sub_mesh: DeviceMesh, placements: list) -> nn.Module:
        torch.manual_seed(0)
        module = nn.Linear(4, 4)
        weight = distribute_tensor(module.weight.detach(), sub_mesh, placements)
        module.weight = nn.Parameter(weight)
        return module

    out["fsdp-2d"] = error_of(lambda: distopt.DistributedDataParallel(
        sharded_along(mesh, [Shard(0), Replicate()]), device_mesh=mesh))
    out["fsdp-1d"] = error_of(lambda: distopt.DistributedDataParallel(
        sharded_along(mesh["dp"], [Shard(0)]), process_group=mesh["dp"].get_group()))
    out["replicated-over-dp"] = error_of(lambda: distopt.DistributedDataParallel(
        sharded_along(mesh, [Replicate(), Shard(0)]), device_mesh=mesh))

    def two_meshes() -> nn.Module:
        model, _ = tp_block(mesh)
        weight = model.ln2.weight.detach()
        model.ln2.weight = nn.Parameter(distribute_tensor(weight, one["b"], [Replicate()]))
        return model

    out["two-meshes"] = error_of(lambda: distopt.DistributedDataParallel(two_meshes(),
                                                                       device_mesh=mesh))
    out["world-dp"] = error_of(lambda: distopt.DistributedDataParallel(tp_block(mesh)[0]))
    out["tp-as-dp"] = error_of(lambda: distopt.DistributedDataParallel(
        tp_block(mesh)[0], process_group=mesh["tp"].get_group()))
    out["both"] = error_of(lambda: distopt.DistributedDataParallel(
        tp_block(mesh)[0], process_group=mesh["dp"].get_group(), device_mesh=mesh))
    out["unnamed"] = error_of(lambda: distopt.DistributedDataParallel(
        tp_block(mesh)[0], device_mesh=mesh_2d(2, 2, ("x", "y"))))

    def empty_shard() -> nn.Module:
        torch.manual_seed(0)
        return parallelize_module(nn.Linear(4, 1), mesh["tp"], ColwiseParallel())

    out["empty-shard"] = error_of(lambda: distopt.DistributedDataParallel(empty_shard(),
                                                                        device_mesh=mesh))

    def chunks_on_two_meshes() -> None:
        a = distopt.DistributedDataParallel(tp_block(mesh)[0], device_mesh=mesh)
        torch.manual_seed(0)
        b = parallelize_module(nn.Linear(4, 4), one["b"], ColwiseParallel())
        b = distopt.DistributedDataParallel(b, device_mesh=mesh)
        distopt.DistributedOptimizer([a, b], torch.optim.AdamW, lr=1e-2)

    out["chunks"] = error_of(chunks_on_two_meshes)

    def muon_on_a_tp_shard() -> None:
        model = distopt.DistributedDataParallel(tp_block(mesh)[0], device_mesh=mesh)
        inner = model.module
        matrices = [inner.q.weight, inner.o.weight]  # Shard(0) and Shard(1) over TP
        distopt.DistributedOptimizer(model, torch.optim.Muon, params=[{"params": matrices}],
                                     lr=0.02)

    out["muon-tp-shard"] = error_of(muon_on_a_tp_shard)
    row_mesh = mesh_2d(1, 4)
    out["rows-of-6-over-4"] = distribute_tensor(torch.zeros(6, 3), row_mesh["tp"], [Shard(0)]
                                                ).to_local().shape[0]
    return out


CONFIGS = {  # name: (dp, tp, DistributedOptimizer (else BasicOptimizer), sequence parallel)
    "dp2-tp2-zero": (2, 2, True, False),
    "dp1-tp4-zero": (1, 4, True, False),
    "dp4-tp1-zero": (4, 1, True, False),
    "dp2-tp2-basic": (2, 2, False, False),
    "dp2-tp2-zero-sp": (2, 2, True, True),
}


def _cases() -> list:
    cases = [(f"parity-{name}", parity, args) for name, args in CONFIGS.items()]
    cases.append(("remainders", remainders_match_fp32_masters, ()))
    cases.append(("scaler", scaler_skips_inf_on_one_tp_rank, ()))
    cases.append(("nan-check", nan_check_raises_on_every_rank, ()))
    cases.append(("errors", errors, ()))
    cases.append(("p-grad", p_grad_of_dtensors_refused, ()))
    return cases


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, _cases())


@pytest.mark.parametrize("config", CONFIGS)
def test_trains_like_single_process_torch(results, config):
    dp, _, _, sequence_parallel = CONFIGS[config]
    values = case_result(results, f"parity-{config}")
    for v in values:
        assert v["max_diff"] <= FP32_TOL, v["max_diff"]
        assert v["norm_diff"] <= NORM_RTOL, v["norm_diff"]
        assert v["clipped"] == STEPS  # clipping was active on every step
        assert v["moved"] > 1e-2  # training really changed the weights
        assert v["aliased"]
        # The params stay DTensors: q/k/v/fc1 column-wise, o/fc2 row-wise, their biases
        # replicated; LayerNorm is plain, or replicated under sequence parallelism.
        placements = dict(v["dtensors"])
        assert len(placements) == (15 if sequence_parallel else 11)
        assert placements["q.weight"] == placements["fc1.bias"] == "(Shard(dim=0),)"
        assert placements["o.weight"] == placements["fc2.weight"] == "(Shard(dim=1),)"
        assert placements["o.bias"] == placements["fc2.bias"] == "(Replicate(),)"
        if sequence_parallel:
            assert placements["ln1.weight"] == placements["ln2.bias"] == "(Replicate(),)"
        if dp > 1:  # DP collectives run on the mesh's DP group
            assert v["dp_ranks"] == v["mesh_dp_ranks"]


def test_buffers_hold_local_shards_and_dp_collectives_cover_them(results):
    for v in case_result(results, "parity-dp2-tp2-zero"):
        width = TP_HEADS * TP_HEAD_DIM
        sharded_numel = 4 * TP_DIM * width + 2 * TP_DIM * TP_FFN + 2 * width + TP_FFN
        assert v["global_numel"] - v["local_numel"] == sharded_numel // 2
        assert v["local_numel"] <= v["buffer_numel"] < v["local_numel"] + v["buckets"] * 2 * 64
        for calls in v["calls"]:
            # One reduce-scatter and one all-gather per bucket over DP; the grad norm is summed
            # over DP, then over TP; what p.grad reads is gathered over DP.
            assert calls == {"reduce_scatter": v["buckets"], "all_gather": v["buckets"],
                             "all_reduce_small": 2, "agree_grad_statistics": 1}
        assert v["reduce_groups"] == 2
    for v in case_result(results, "parity-dp2-tp2-basic"):
        for calls in v["calls"]:
            assert calls == {"all_reduce": v["buckets"], "all_reduce_small": 1}  # norm over TP


def test_param_remainders_step_the_fp32_master_paths_bits(results):
    values = case_result(results, "remainders")
    for v in values:
        assert v["buckets"] >= 2
        # Identical until the step after the first tie event (whose forward differs).
        first_tie = next((i for i, t in enumerate(v["ties"]) if t), len(v["ties"]) - 1)
        same = first_tie + 1
        assert v["same_masters"][:same] == [True] * same, v
        assert v["results"][True][:same] == v["results"][False][:same], v
        assert all(norm > CLIP for norm, _ in v["results"][True])  # every step clipped


def test_inf_on_one_tp_rank_skips_the_step_everywhere(results):
    for v in case_result(results, "scaler"):
        assert v["updated"] == [True, False, True]
        assert v["changed"] == [True, False, True]
        assert v["scales"] == [2.0**8, 2.0**7, 2.0**7]


def test_nan_check_raises_on_every_rank(results):
    for message in case_result(results, "nan-check"):
        # Planted on the rank at mesh coordinate (0, 1): rank 1.
        assert "'fc2.weight' produced on rank 1 " in message, message


def test_empty_shard_arithmetic(results):
    # DTensor splits like torch.chunk: 6 rows over 4 ranks are 2, 2, 2, 0 (seen in "errors").
    assert [v["rows-of-6-over-4"] for v in case_result(results, "errors")] == [2, 2, 2, 0]
    assert some_shard_is_empty((6, 3), (4,), [Shard(0)])
    assert not some_shard_is_empty((8, 3), (4,), [Shard(0)])
    assert some_shard_is_empty((3, 5), (4,), [Shard(1)])  # 2, 2, 1, 0 columns
    assert not some_shard_is_empty((3, 5), (4,), [Replicate()])
    assert not some_shard_is_empty((3, 5), (2, 2), [Shard(0), Shard(1)])  # 2|1 rows, 3|2 cols
    # Two mesh dims splitting one tensor dim: 4 rows -> 2, 2 -> 1, 1 | 1, 1; 3 -> 2, 1 -> ..., 0
    assert not some_shard_is_empty((4,), (2, 2), [Shard(0), Shard(0)])
    assert some_shard_is_empty((3,), (2, 2), [Shard(0), Shard(0)])


ERRORS = {
    "fsdp-2d": "FSDP's job",
    "fsdp-1d": "FSDP's job",
    "replicated-over-dp": "must be disjoint",
    "two-meshes": "different device meshes",
    "world-dp": "process_group=mesh['dp'].get_group()",
    "tp-as-dp": "process_group=mesh['dp'].get_group()",
    "both": "not both",
    "unnamed": "name it 'dp'",
    "empty-shard": "empty shard",
    "chunks": "different tensor-parallel meshes",
    "muon-tp-shard": "parameter 'q.weight' is sharded over the tensor-parallel mesh",
}


@pytest.mark.parametrize("name", ERRORS)
def test_clear_errors_on_every_rank(results, name):
    for v in case_result(results, "errors"):
        assert v[name].startswith("ValueError"), v[name]
        assert ERRORS[name] in v[name], v[name]


def test_p_grad_of_dtensor_params_refused_by_name(results):
    values = case_result(results, "p-grad")
    assert len({v["message"] for v in values}) == 1
    for v in values:
        assert v["message"].startswith("p.grad of parameter '"), v
        assert "is a tensor-parallel DTensor" in v["message"] and "clip_grad=" in v["message"]
        assert v["replicated"] > 0 and v["updated"]
    # A replicated param's reduced grad: the same on the two TP ranks of each DP replica.
    assert values[0]["replicated"] == values[1]["replicated"]
