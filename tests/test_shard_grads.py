"""Sharded grads (``shard_grads=True``) and sharded params (``shard_params=True``) at d = 1..4.

The whole grid runs at d = 1, 2 and 3 (3: shards that do not divide evenly); at d = 4 the flat
group runs the trajectories against torch (fp32, bf16, micro-batches, fp32-accumulated bf16
reductions) beside the meshes and tensor parallelism, which need four ranks.

Against single-process torch.optim (the parity grid's trajectory, and micro-batches summed to
the whole batch), and bit for bit against the full grad buffer wherever the arithmetic is the
same (one backward per step): with bf16, remainders, fp32-accumulated reductions, fp16 loss
scaling, Muon, no overlap, a hierarchical mesh and tensor parallelism. Also: what a rank holds
between steps (the kept shards alone) and during backward (plus k pool buffers), the nan
check, checkpoints across both paths, and the option's check. Sharded params run the same
grid (parity, micro-batches, bf16 with remainders, Muon, fp16 loss scaling, both
``reshard_after_forward``), bit for bit equal to sharded grads (the same arithmetic; only where
the params live changes), with what a rank holds (its param shard) and the most it gathered at
once measured. One spawned group per world size runs every case; see [Note: sharded grads] in
src/distopt/ddp/buffers/grad_pool.py and [Note: sharded params] in
src/distopt/ddp/buffers/param_storage.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import distopt

from dist_harness import case_result, run_cases
from helpers import (
    BF16_TOL,
    CLIP,
    FP32_TOL,
    NORM_RTOL,
    STEP_FILES,
    ParityRun,
    files_run_by,
    lm_loss,
    max_diff,
    muon_groups,
    parity_groups,
    parity_trajectory,
    same,
    shared_tmpdir,
    snapshot,
    world_params,
)
from models import TP_BATCH, AwkwardLM, Block, batch, batches, mlp, rank_slice, tp_plan

BF16, FP16 = torch.bfloat16, torch.float16
MICRO = 4  # micro-batches of the accumulation runs
GLOBAL_BATCH = 48  # divides by every d and by d * MICRO


@dataclasses.dataclass(frozen=True)
class Run:
    """How ``train`` trains AwkwardLM on this rank's slice of each global batch."""

    shard_grads: bool = True
    shard_params: bool = False
    reshard_after_forward: bool = True
    dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    micro: int = 1  # micro-batches per step, all but the last under no_sync
    last_synced: bool = True  # False: every micro-batch under no_sync
    mesh: tuple[int, int] | None = None  # (replicate, shard)
    optimizer: str = "adamw"  # or "muon"
    remainders: bool = False
    fp32_accumulation: bool = False
    overlap: bool = True
    scaler: bool = False  # a DynamicLossScaler; rank 0 gets an inf grad at step 2
    steps: int = 8


def _ddp(model: nn.Module, run: Run, **kwargs) -> distopt.DistributedDataParallel:
    mesh = None if run.mesh is None else init_device_mesh(
        "cpu", run.mesh, mesh_dim_names=("dp_replicate", "dp_shard"))
    return distopt.DistributedDataParallel(
        model, grad_dtype=run.grad_dtype, bucket_size=40, device_mesh=mesh,
        overlap_grad_reduce=run.overlap, find_unused_parameters=True,
        reduce_scatter_with_fp32_accumulation=run.fp32_accumulation,
        shard_grads=run.shard_grads, shard_params=run.shard_params,
        reshard_after_forward=run.reshard_after_forward, **kwargs)


def _optimizer(ddp, model: AwkwardLM, run: Run) -> distopt.DistributedOptimizer:
    scaler = distopt.DynamicLossScaler(initial_scale=2.0**8, hysteresis=1) if run.scaler else None
    common = dict(clip_grad=CLIP, loss_scaler=scaler, store_param_remainders=run.remainders)
    if run.optimizer == "muon":
        return distopt.DistributedOptimizer(
            ddp, torch.optim.Muon, overlap_param_gather=True, **common,
            params=muon_groups(model, {"lr": 0.02, "momentum": 0.9}, {"lr": 1e-2}))
    return distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, params=parity_groups(model, "adamw"), lr=1e-2,
        betas=(0.8, 0.95), **common)


def train(run: Run, reference: bool = True) -> dict:
    """Train ``run`` and, for fp32 params (and ``reference``), a single-process torch reference
    on the whole batches beside it; every number distopt holds at the end, and what it sent
    and held. Runs compared with each other bit for bit leave the reference out: they assert
    nothing against it, and it costs every rank a whole-batch training of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM().to(run.dtype)
    compared = (reference and run.dtype == torch.float32 and not run.scaler
                and run.optimizer == "adamw")
    if compared:  # the same initial weights, copied before distopt wraps the model
        ref = copy.deepcopy(model)
        trainable = [p for p in ref.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(parity_groups(ref, "adamw"), lr=1e-2, betas=(0.8, 0.95))
    ddp = _ddp(model, run)
    opt = _optimizer(ddp, model, run)
    poisoned = [False]
    model.l2.weight.register_hook(
        lambda g: g.masked_fill(torch.ones_like(g, dtype=torch.bool), float("inf"))
        if poisoned[0] else g)
    worst, norms, updated, calls = 0.0, [], [], []
    gathered_peak: dict[str, int] = {}  # the most gathered buckets at once, steps 2 on
    for step in range(run.steps):
        tokens, targets = batches(step, global_batch=GLOBAL_BATCH)
        mine = [rank_slice(t, rank, world).chunk(run.micro) for t in (tokens, targets)]
        opt.zero_grad()
        ddp.comm_stats.reset()
        for pool in ddp.param_pools.values():
            pool.reset_peak()
        poisoned[0] = run.scaler and step == 2 and rank == 0
        for i in range(run.micro):
            loss = lm_loss(ddp, mine[0][i], mine[1][i], step) / run.micro
            synced = i == run.micro - 1 and run.last_synced
            with (ddp.no_sync() if not synced else _nothing()):
                opt.scale_loss(loss).backward()
        result = opt.step()
        if step > 0:  # see [Note: where a param is used]: the first step gathers widely
            for dtype, pool in ddp.param_pools.items():
                gathered_peak[str(dtype)] = max(gathered_peak.get(str(dtype), 0),
                                                pool.peak_buffers)
        calls.append(dict(ddp.comm_stats.calls))
        norms.append(result.grad_norm)
        updated.append(result.updated)
        if compared:
            ref_opt.zero_grad()
            lm_loss(ref, tokens, targets, step).backward()
            norm = torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None],
                                                  CLIP)
            ref_opt.step()
            with ddp.gathered_params():
                worst = max(worst, max_diff(model, ref), abs(result.grad_norm / norm.item() - 1))
    ddp.finish_param_sync()
    return {
        "snapshot": snapshot(ddp, opt), "norms": norms, "updated": updated, "calls": calls,
        "gathered_peak": gathered_peak,
        "max_diff": worst if compared else None, "buckets": len(ddp.buckets),
        "peak_buffers": {str(k): p.peak_buffers for k, p in ddp.grad_pools.items()},
        "fp32_buckets": sum(b.fp32_accumulation for b in ddp.buckets),
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


@functools.cache
def compared_train(run: Run) -> dict:
    """``train(run)`` without a reference, for runs compared bit for bit with each other: a
    run that several comparisons share (sharded grads is one side of both the full buffer's and
    sharded params' comparisons) trains once per test process. Its result is only read."""
    return train(run, reference=False)


def same_as_full_buffer(run: Run) -> dict:
    """``run`` with sharded grads and with the full buffer: whether every number is the same."""
    sharded = compared_train(run)
    full = compared_train(dataclasses.replace(run, shard_grads=False))
    return {"same": same(sharded["snapshot"], full["snapshot"]),
            "norms": (sharded["norms"], full["norms"]),
            "updated": (sharded["updated"], full["updated"]),
            "calls": (sharded["calls"], full["calls"]), "buckets": sharded["buckets"],
            "peak_buffers": sharded["peak_buffers"], "fp32_buckets": sharded["fp32_buckets"]}


def same_as_sharded_grads(run: Run) -> dict:
    """``run`` with sharded params and with sharded grads only: whether every number is the
    same, what each sent, and the most gathered buckets alive at once."""
    params = compared_train(run)
    grads = compared_train(dataclasses.replace(run, shard_params=False))
    # The most gathered at once in the steps after the first (which gathers on the safe side
    # while it learns where params are read; see [Note: where a param is used]).
    return {"same": same(params["snapshot"], grads["snapshot"]),
            "norms": (params["norms"], grads["norms"]), "calls": (params["calls"], grads["calls"]),
            "gathered_peak": params["gathered_peak"], "buckets": params["buckets"]}


def overlap_changes_no_bit(run: Run) -> bool:
    """``run`` (with micro-batches) overlapped and not: the same numbers."""
    on = compared_train(run)
    off = compared_train(dataclasses.replace(run, overlap=False))
    return same(on["snapshot"], off["snapshot"]) and on["norms"] == off["norms"]


def accumulation(run: Run) -> dict:
    out = train(run)
    del out["snapshot"]
    return out


# ---------------------------------------------------------------- memory


def memory(param_dtype: torch.dtype, grad_dtype: torch.dtype, remainders: bool) -> dict:
    """What a rank holds between steps, by component, and the most it held during backward."""
    torch.manual_seed(0)
    model = mlp([64, 96, 80, 33], dtype=param_dtype)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=3000,
                                          shard_grads=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3,
                                       store_param_remainders=remainders)
    (pool,) = ddp.grad_pools.values()
    kept = sum(t.untyped_storage().nbytes() for b in ddp.flat_buffers for t in b.grad_storage())
    held = []  # after each grad: the distinct storages the buckets' transient grads live in

    def record(_param) -> None:
        storages = {b.grad_data.untyped_storage().data_ptr(): b.grad_data.untyped_storage()
                    for b in ddp.buckets if b.grad_data is not None}
        held.append((len(storages), sum(s.nbytes() for s in storages.values())))

    for p in model.parameters():  # after the DDP's own hook
        p.register_post_accumulate_grad_hook(record)
    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):
            ddp(torch.randn(4, 64, dtype=param_dtype)).float().square().mean().backward()
        opt.step()
    report = distopt.measure_state_bytes(opt)
    return {
        "report": report, "kept": kept,
        "padded": sum(buf.layout.numel for buf in ddp.flat_buffers),
        "owned": sum(p.numel() for p in opt.main_params),
        "bucket_numels": [b.layout.buffer_range.size for b in ddp.buckets],
        "pool_numel": pool.numel, "buffer_bytes": pool.buffer_bytes,
        "peak_buffers": pool.peak_buffers, "live_after_step": pool.live_buffers,
        "held": held,
        "between_steps": [b.grad_data is None for b in ddp.buckets]
        + [p.main_grad is None for p in model.parameters()],
    }


def params_memory(param_dtype: torch.dtype, remainders: bool, state_dtype: torch.dtype | None
                  ) -> dict:
    """Sharded params: what a rank holds between steps, by component, and the param buffers it
    holds gathered during forward and backward, read off their storages at every module's
    forward and every grad (PARAMS_MEMORY_STEPS steps: nothing stays or grows)."""
    torch.manual_seed(0)
    model = mlp([64, 96, 80, 72, 33], dtype=param_dtype)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=param_dtype, bucket_size=3000,
                                          shard_params=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3, state_dtype=state_dtype,
                                       store_param_remainders=remainders)
    (pool,) = ddp.param_pools.values()
    stores = [b.params_store for b in ddp.buckets]
    held: list[int] = []  # bytes of gathered params at each forward and each grad

    def record(*_args) -> None:
        held.append(sum(s._full.untyped_storage().nbytes() for s in stores))

    for module in model.modules():
        module.register_forward_hook(record)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    after_step, peaks = [], []
    for step in range(PARAMS_MEMORY_STEPS):
        if step == 1:  # the first step gathers on the safe side; see [Note: where a param
            held.clear()  # is used]
        pool.reset_peak()
        opt.zero_grad()
        ddp(torch.randn(4, 64, dtype=param_dtype)).float().square().mean().backward()
        opt.step()
        after_step.append(sum(s._full.untyped_storage().nbytes() for s in stores))
        peaks.append(pool.peak_bytes)
    report = distopt.measure_state_bytes(opt)
    return {"report": report, "padded": sum(buf.layout.numel for buf in ddp.flat_buffers),
            "owned": sum(p.numel() for p in opt.main_params), "held": held,
            "after_step": after_step, "peaks": peaks, "peak_buffers": pool.peak_buffers,
            "bucket_bytes": [b.numel * param_dtype.itemsize for b in ddp.buckets],
            "placeholders": all(p.untyped_storage().nbytes() <= param_dtype.itemsize
                                for p in model.parameters())}


# ---------------------------------------------------------------- checks and checkpoints


def nan_check() -> str:
    """A nan in the last rank's grad of l1.weight, produced in the second micro-batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=40,
                                          check_for_nan_in_grad=True,
                                          shard_grads=True)
    poison = [False]
    model.l1.weight.register_hook(
        lambda g: g.masked_fill(torch.ones_like(g, dtype=torch.bool), float("nan"))
        if poison[0] else g)
    tokens, targets = batches(0, global_batch=GLOBAL_BATCH)
    for i in range(2):
        poison[0] = i == 1 and rank == world - 1
        with ddp.no_sync() if i == 0 else _nothing():
            lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                    0).backward()
    try:
        ddp.finish_grad_sync()
    except FloatingPointError as e:
        return str(e)
    return "no error"


def bad_option() -> str:
    """shard_grads with all-reduced buckets: every rank raises before any collective."""
    model = mlp([4, 3])
    try:
        distopt.DistributedDataParallel(model, use_distributed_optimizer=False,
                                        shard_grads=True)
    except ValueError as e:
        return str(e)
    return "no error"


def _numbers(ddp, opt) -> list[torch.Tensor]:
    """``snapshot`` with each state's entries by name (a loaded state holds them in another
    order)."""
    values = [v.detach().clone() for v in ddp.full_state_dict().values()]
    for main in opt.main_params:
        state = opt.state.get(main, {})
        values += [main.detach().clone()] + [state[k].clone() for k in sorted(state)]
    return values


def reentrant_checkpointing() -> dict:
    """Every block under reentrant activation checkpointing: each inner backward ends with a
    reduction of every bucket, and the sums of those reductions train like the full buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for shard in (True, False):
        torch.manual_seed(0)
        model = mlp([12, 40, 40, 40, 5])
        blocks = [model[i : i + 2] for i in range(0, len(model), 2)]
        ddp = distopt.DistributedDataParallel(model, bucket_size=900, shard_grads=shard)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
        calls = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = rank_slice(torch.randn(8, 12, generator=g), rank, world)
            opt.zero_grad()
            ddp.comm_stats.reset()
            h = x.requires_grad_()
            for block in blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            h.square().mean().backward()
            opt.step()
            calls.append(ddp.comm_stats.calls["reduce_scatter"])
        ddp.finish_param_sync()
        out[shard] = {"params": [p.detach().clone() for p in model.parameters()],
                      "calls": calls, "buckets": len(ddp.buckets)}
    diff = max((a - b).abs().max().item()
               for a, b in zip(out[True]["params"], out[False]["params"], strict=True))
    return {"diff": diff, "calls": out[True]["calls"], "full_calls": out[False]["calls"],
            "buckets": out[True]["buckets"], "blocks": 4}


def checkpointed_params(reentrant: bool) -> bool:
    """Every block under activation checkpointing, sharded params against sharded grads: the
    recomputation inside backward gathers what it reads and keeps it for the backward after
    it, so every number is the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for params in (True, False):
        torch.manual_seed(0)
        model = mlp([12, 40, 40, 40, 5])
        blocks = [model[i : i + 2] for i in range(0, len(model), 2)]
        ddp = distopt.DistributedDataParallel(model, bucket_size=900, shard_grads=True,
                                              shard_params=params)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = rank_slice(torch.randn(8, 12, generator=g), rank, world)
            opt.zero_grad()
            h = x.requires_grad_()
            for block in blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
            h.square().mean().backward()
            opt.step()
        out.append(_numbers(ddp, opt))
    return same(*out)


def meta_init() -> dict:
    """AwkwardLM built on the meta device and materialized into sharded params (no rank holds
    it whole) against the same model built for real: the same values, and the same training."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for meta in (True, False):
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = AwkwardLM()
        ddp = _ddp(model, Run(shard_params=True))
        opt = _optimizer(ddp, model, Run(shard_params=True))
        initial = ddp.full_state_dict()
        for step in range(3):
            tokens, targets = batches(step, global_batch=GLOBAL_BATCH)
            opt.zero_grad()
            lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                    step).backward()
            opt.step()
        runs.append((list(initial.values()), _numbers(ddp, opt)))
    refused = ""
    try:
        with torch.device("meta"):
            distopt.DistributedDataParallel(mlp([4, 3]))
    except ValueError as error:
        refused = str(error)
    return {"initial": same(runs[0][0], runs[1][0]), "trained": same(runs[0][1], runs[1][1]),
            "refused": refused}


def model_check_compares_the_option() -> str:
    try:
        distopt.DistributedDataParallel(mlp([4, 3]), shard_grads=dist.get_rank() == 0)
    except ValueError as e:
        return str(e)
    return "no error"


def checkpoint_across_paths(sharded_params: bool = False) -> dict:
    """Save with sharded grads (and params, asynchronously), load into the full buffer and
    back: every run goes on to the same numbers as the one that never stopped."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(shared_tmpdir("distopt-shard-grads-"))

    def build(shard: bool):
        torch.manual_seed(0)
        model = AwkwardLM()
        run = Run(shard_grads=shard, shard_params=shard and sharded_params)
        ddp = _ddp(model, run)
        return ddp, _optimizer(ddp, model, run)

    def steps(ddp, opt, first: int, last: int) -> None:
        for step in range(first, last):
            tokens, targets = batches(step, global_batch=GLOBAL_BATCH)
            opt.zero_grad()
            lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                    step).backward()
            opt.step()
        ddp.finish_param_sync()

    ddp, opt = build(True)
    steps(ddp, opt, 0, 3)
    # With sharded params the save is async: the params gathered for it are staged, freed,
    # and trained on while the write goes on.
    saved = distopt.save_checkpoint(root / "sharded", ddp, opt, async_save=sharded_params)
    steps(ddp, opt, 3, 6)
    if sharded_params:
        saved.wait()
    unbroken = _numbers(ddp, opt)
    full_ddp, full_opt = build(False)
    distopt.load_checkpoint(root / "sharded", full_ddp, full_opt)
    steps(full_ddp, full_opt, 3, 4)
    distopt.save_checkpoint(root / "full", full_ddp, full_opt)
    steps(full_ddp, full_opt, 4, 6)
    back_ddp, back_opt = build(True)
    distopt.load_checkpoint(root / "full", back_ddp, back_opt)
    steps(back_ddp, back_opt, 4, 6)
    return {"full": same(_numbers(full_ddp, full_opt), unbroken),
            "back": same(_numbers(back_ddp, back_opt), unbroken)}


def tensor_parallel(shard: bool, params: bool = False) -> list[torch.Tensor]:
    """dp = 2, tp = 2: AdamW with clipping, 5 steps; every number held at the end."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, _ = mesh.get_coordinate()
    torch.manual_seed(0)
    model = Block()
    parallelize_module(model, mesh["tp"], tp_plan())
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh, bucket_size=100,
                                          shard_grads=shard, shard_params=params)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=0.05, lr=1e-2)
    for step in range(5):
        x, y = batch(step)
        per = TP_BATCH // 2
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        opt.zero_grad()
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    return [t.to_local() if hasattr(t, "to_local") else t for t in snapshot(ddp, opt)]


def tp_same_as_full_buffer() -> bool:
    full = tensor_parallel(False)
    return same(tensor_parallel(True), full) and same(tensor_parallel(True, True), full)


# ---------------------------------------------------------------- the grid

FLAT_PARITY = {
    "parity-fp32": ParityRun(shard_grads=True),
    "parity-fp32-no-overlap": ParityRun(shard_grads=True, overlap_grad=False,
                                        overlap_gather=False),
    "parity-bf16": ParityRun(shard_grads=True, dtype=BF16, grad_dtype=BF16, groups=False,
                             overlap_gather=False),
    "parity-fp32-params": ParityRun(shard_params=True),
    "parity-fp32-params-keep": ParityRun(shard_params=True, reshard_after_forward=False),
}
SAME = {
    "same-fp32": Run(),
    "same-fp32-no-overlap": Run(overlap=False),
    "same-bf16-remainders": Run(dtype=BF16, grad_dtype=BF16, remainders=True),
    "same-bf16-fp32grads": Run(dtype=BF16),
    "same-fp16-scaler": Run(dtype=FP16, grad_dtype=FP16, scaler=True),
    "same-muon": Run(optimizer="muon"),
}
SAME_PARAMS = {
    "params-fp32": Run(shard_params=True),
    "params-fp32-keep": Run(shard_params=True, reshard_after_forward=False),
    "params-fp32-no-overlap": Run(shard_params=True, overlap=False),
    "params-bf16-remainders": Run(shard_params=True, dtype=BF16, grad_dtype=BF16,
                                  remainders=True),
    "params-fp16-scaler": Run(shard_params=True, dtype=FP16, grad_dtype=FP16, scaler=True),
    "params-muon": Run(shard_params=True, optimizer="muon"),
    "params-micro": Run(shard_params=True, micro=MICRO, steps=4),
}
SAME_MULTI = {  # d > 1
    "same-fp32acc": Run(dtype=BF16, grad_dtype=BF16, fp32_accumulation=True),
}
MEMORY_ROWS = [(BF16, BF16, True), (torch.float32, torch.float32, False)]
# Sharded params' rows: (param dtype, remainders, state dtype) -> bytes per param times d.
PARAMS_MEMORY_ROWS = {(torch.float32, False, None): 16, (BF16, True, None): 14,
                      (BF16, True, BF16): 10}
# Every step after the first runs the same hooks on the same shapes (the first learns where
# params are used), so a gathered buffer left behind or a pool that grows shows in step 2 and
# adds up in each step after it: 10 steps, 9 alike, show what 50 did, at a fifth of the time.
PARAMS_MEMORY_STEPS = 10


def _cases(world: int) -> list:
    cases = [(name, parity_trajectory, (run,)) for name, run in FLAT_PARITY.items()]
    cases += [(name, same_as_full_buffer, (run,)) for name, run in SAME.items()]
    cases += [(name, same_as_sharded_grads, (run,)) for name, run in SAME_PARAMS.items()]
    if world > 1:
        cases += [(name, same_as_full_buffer, (run,)) for name, run in SAME_MULTI.items()]
    cases.append(("accumulate", accumulation, (Run(micro=MICRO),)))
    cases.append(("accumulate-all-no-sync",
                  accumulation, (Run(micro=MICRO, last_synced=False, steps=3),)))
    cases += [(f"memory-{p}-{g}", memory, (p, g, r)) for p, g, r in MEMORY_ROWS]
    cases += [(f"params-memory-{p}-{r}-{sd}", params_memory, (p, r, sd))
              for p, r, sd in PARAMS_MEMORY_ROWS]
    cases.append(("overlap-micro", overlap_changes_no_bit, (Run(micro=2, steps=4),)))
    cases.append(("reentrant", reentrant_checkpointing, ()))
    cases += [(f"checkpointed-params-{r}", checkpointed_params, (r,)) for r in (False, True)]
    if world > 1:
        cases.append(("model-check", model_check_compares_the_option, ()))
    cases.append(("nan", nan_check, ()))
    cases.append(("bad-option", bad_option, ()))
    cases.append(("checkpoint", checkpoint_across_paths, ()))
    cases.append(("meta-init", meta_init, ()))
    cases.append(("checkpoint-params", checkpoint_across_paths, (True,)))
    return cases


WORLDS = [1, 2, 3]
# The flat group of four runs these beside its meshes (``four``): what d = 2 and 3 do not show is
# more ranks summed, which the trajectories do.
FLAT_FOUR = [*FLAT_PARITY, *SAME_MULTI, "accumulate"]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases(request.param))


@pytest.mark.parametrize("case", ["parity-fp32", "parity-fp32-no-overlap", "parity-fp32-params",
                                  "parity-fp32-params-keep"])
def test_fp32_parity_with_torch(world, case):
    """AdamW, two groups and a schedule, clipping, a tied embedding, a branch used on even steps
    only (find_unused_parameters), within FP32_TOL of single-process torch.optim."""
    check_fp32_parity(case_result(world[1], case), case)


def check_fp32_parity(values: list, case: str) -> None:
    for value in values:
        assert value["max_diff"] <= FP32_TOL, value
        assert value["norm_diff"] <= NORM_RTOL, value
        assert value["moved"] > 1e-2
        assert value["report"].grads == 4 * value["owned_padded"]  # the kept shards alone
        if "params" in case:  # and the param shards alone
            assert value["report"].params == 4 * value["owned_padded"]


def test_bf16_parity_with_torch(world):
    check_bf16_parity(case_result(world[1], "parity-bf16"))


def check_bf16_parity(values: list) -> None:
    for value in values:
        assert value["dtypes"] == {torch.bfloat16}
        assert value["max_diff"] <= BF16_TOL, value


@pytest.mark.parametrize("case", list(SAME) + list(SAME_MULTI))
def test_bitwise_equal_to_the_full_buffer(world, case):
    """One backward per step: the same grads through the same collectives, so every number
    (params, main params, state, norms, skipped steps) is the same bit for bit, and so is what
    was sent."""
    d, results = world
    if case in SAME_MULTI and d == 1:
        pytest.skip("a reduction needs two ranks")
    check_bitwise_equal(case_result(results, case), case)


def check_bitwise_equal(values: list, case: str) -> None:
    for value in values:
        assert value["same"], value["norms"]
        assert value["norms"][0] == value["norms"][1]
        assert value["calls"][0] == value["calls"][1]
        if case == "same-fp16-scaler":  # the inf on rank 0 skipped step 2 everywhere
            assert value["updated"][0] == [step != 2 for step in range(8)]
        if case in SAME_MULTI:
            assert value["fp32_buckets"] == value["buckets"]


def test_accumulation_reduces_every_micro_batch_and_matches_torch(world):
    """4 micro-batches, 3 under no_sync: each reduce-scatters and adds into the kept shard (the
    sum of averages is the average of the sum, not bit for bit: within FP32_TOL of torch)."""
    check_accumulation(*world)


def check_accumulation(d: int, results: list) -> None:
    for value in case_result(results, "accumulate"):
        assert value["max_diff"] <= FP32_TOL, value
        n = value["buckets"]
        for calls in value["calls"]:
            assert calls.get("reduce_scatter", 0) == (MICRO * n if d > 1 else 0)
        # The branch unused on odd steps holds back every bucket after it (launch order), so
        # these keep their buffers until backward ends; see [Note: sharded grads].
        assert 2 <= max(value["peak_buffers"].values()) <= n


def test_accumulation_all_under_no_sync(world):
    """No micro-batch outside no_sync: the step still sees every micro-batch's grads."""
    for value in case_result(world[1], "accumulate-all-no-sync"):
        assert value["max_diff"] <= FP32_TOL, value


@pytest.mark.parametrize("param_dtype,grad_dtype,remainders", MEMORY_ROWS)
def test_memory_by_component(world, param_dtype, grad_dtype, remainders):
    """Between steps: params, the kept grad shards, remainders or nothing, Adam's two moments,
    the table's new rows (bf16 + remainders: 2 + 12/d; fp32: 4 + 12/d) padding aside. During
    backward: that plus k pool buffers of the largest bucket, k = the pool's high-water mark."""
    d, results = world
    values = case_result(results, f"memory-{param_dtype}-{grad_dtype}")
    psize, gsize = param_dtype.itemsize, grad_dtype.itemsize
    row = (2 + 12 / d) if remainders else (4 + 12 / d)
    for v in values:
        r, padded = v["report"], v["padded"]
        assert r.params == padded * psize
        assert r.grads == padded // d * gsize == v["kept"]
        assert r.main_params == (padded // d * 2 if remainders else 0)
        assert r.main_grads == 0
        assert r.optimizer_state == 8 * v["owned"]
        padding = (padded - r.num_params) * (psize + (gsize + (2 if remainders else 0)) / d)
        state_excess = 8 * (v["owned"] - r.num_params / d)
        assert r.total == pytest.approx(row * r.num_params + padding + state_excess, rel=1e-12)
        assert all(v["between_steps"]) and v["live_after_step"] == 0
        # During backward.
        assert v["pool_numel"] == max(v["bucket_numels"])
        assert len(v["bucket_numels"]) >= 3
        k = v["peak_buffers"]
        assert max(n for n, _ in v["held"]) == k
        assert max(b for _, b in v["held"]) <= k * v["buffer_bytes"]
        assert k == (1 if d == 1 else 2)  # an MLP's grads arrive bucket by bucket
        assert k * v["buffer_bytes"] < padded * gsize  # below the full buffer


@pytest.mark.parametrize("row", list(PARAMS_MEMORY_ROWS), ids=str)
def test_sharded_params_memory(world, row):
    """Between steps every component is 1/d (fp32: 16/d; bf16 with remainders: 14/d, with bf16
    state 10/d) padding aside, the params placeholders of no memory; during forward and
    backward, that plus the gathered buckets, read off their storages: never the whole model,
    the pool's count exact, and nothing left or grown after any of PARAMS_MEMORY_STEPS steps."""
    d, results = world
    param_dtype, remainders, state_dtype = row
    v = case_result(results, f"params-memory-{param_dtype}-{remainders}-{state_dtype}")[0]
    r, padded, owned = v["report"], v["padded"], v["owned"]
    size = param_dtype.itemsize
    state = 8 * (state_dtype or torch.float32).itemsize // 4
    shard = padded // d  # params, grads and remainders cover the padding; state only params
    assert (size + size + (2 if remainders else 0) + state) == PARAMS_MEMORY_ROWS[row]
    assert distopt.theoretical_bytes_per_param(
        param_dtype, param_dtype, d, shard_params=True, store_param_remainders=remainders,
        state_dtype=state_dtype) * d == PARAMS_MEMORY_ROWS[row]
    assert r.params == shard * size and r.grads == shard * size
    assert r.main_params == (shard * 2 if remainders else 0)
    assert r.optimizer_state == state * owned
    assert v["placeholders"]
    assert max(v["held"]) == max(v["peaks"][1:])  # the pool counts what the storages hold
    assert 0 < max(v["held"]) < sum(v["bucket_bytes"])  # never every bucket at once
    assert set(v["after_step"]) == {0}  # nothing gathered between steps, nothing grows
    assert len(set(v["peaks"][1:])) == 1  # every step after the first holds the same


def test_overlap_changes_no_bit_with_micro_batches(world):
    assert all(case_result(world[1], "overlap-micro"))


def test_meta_device_model_materialized_into_shards(world):
    """See [Note: meta-device models]: the same values as the model built for real, and the
    meta device without sharded params refused, naming the fix."""
    for value in case_result(world[1], "meta-init"):
        assert value["initial"] and value["trained"]
        assert "shard_params=True" in value["refused"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_sharded_params_under_activation_checkpointing(world, reentrant):
    assert all(case_result(world[1], f"checkpointed-params-{reentrant}"))


def test_reentrant_checkpointing_reduces_per_inner_backward(world):
    """Correct, at the price of one reduction of the model per checkpointed block."""
    d, results = world
    for v in case_result(results, "reentrant"):
        assert v["diff"] <= FP32_TOL, v
        if d > 1:
            assert v["full_calls"] == [v["buckets"]] * 4
            assert v["calls"] == [v["blocks"] * v["buckets"]] * 4


def test_model_check_compares_shard_grads(world):
    d, results = world
    if d == 1:
        pytest.skip("a comparison needs two ranks")
    for message in case_result(results, "model-check"):
        assert "shard_grads" in message, message


def test_nan_check_names_the_param_and_rank(world):
    d, results = world
    for message in case_result(results, "nan"):
        assert "'l1.weight'" in message and f"produced on rank {d - 1}" in message, message


def test_all_reduce_path_is_refused_on_every_rank(world):
    for message in case_result(world[1], "bad-option"):
        assert "shard_grads=True" in message and "use_distributed_optimizer=True" in message


@pytest.mark.parametrize("case", ["checkpoint", "checkpoint-params"])
def test_checkpoints_load_across_both_paths(world, case):
    for value in case_result(world[1], case):
        assert value == {"full": True, "back": True}


@pytest.mark.parametrize("case", list(SAME_PARAMS))
def test_sharded_params_bitwise_equal_to_sharded_grads(world, case):
    """The same grads reduced by the same collectives, the same step on the same shards: only
    where the params live between uses differs, so every number is the same bit for bit; the
    gathers add one all-gather per bucket per use (none after the step)."""
    d, results = world
    for value in case_result(results, case):
        assert value["same"], value["norms"]
        assert value["norms"][0] == value["norms"][1]
        for params, grads in zip(*value["calls"], strict=True):
            assert params.get("reduce_scatter") == grads.get("reduce_scatter")
            if d > 1:
                assert params.get("all_gather", 0) >= value["buckets"]  # around forward
        # The buckets of the module running and of those that read them, and the next one:
        # with AwkwardLM's 7 buckets (3 with Muon's whole matrices) never all at once.
        peak = max(value["gathered_peak"].values())
        assert 1 <= peak <= value["buckets"]
        if value["buckets"] > 3 and "keep" not in case:
            assert peak < value["buckets"], peak


def test_a_step_touches_only_the_step_modules():
    """With sharded grads too (see tests/test_step_files.py), over two micro-batches."""
    torch.manual_seed(0)
    model = mlp([8, 16, 4])
    ddp = distopt.DistributedDataParallel(model, bucket_size=60, shard_grads=True,
                                          check_for_nan_in_grad=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=1.0, lr=1e-2)
    x = torch.randn(5, 8)

    def train_step() -> None:
        opt.zero_grad()
        with ddp.no_sync():
            ddp(x).sum().backward()
        ddp(x).sum().backward()
        assert opt.step().updated

    train_step()
    touched = files_run_by(train_step)
    assert {"ddp/grads/grad_sync.py", "ddp/buffers/bucket.py", "ddp/buffers/grad_storage.py",
            "ddp/buffers/grad_pool.py"} <= touched
    assert touched <= STEP_FILES, f"a step ran code of {sorted(touched - STEP_FILES)}"


# ---------------------------------------------------------------- d = 4: meshes, TP

MESH = {
    "mesh-parity": ParityRun(mesh=(2, 2), shard_grads=True),
    "mesh-parity-params": ParityRun(mesh=(2, 2), shard_params=True),
    "mesh-same-bf16-fp32acc": Run(mesh=(2, 2), dtype=BF16, grad_dtype=BF16,
                                  fp32_accumulation=True),
    "mesh-accumulate": Run(mesh=(2, 2), micro=MICRO, steps=4),
    "mesh-accumulate-all-no-sync": Run(mesh=(2, 2), micro=MICRO, last_synced=False, steps=3),
}


@pytest.fixture(scope="module")
def four():
    cases = [("mesh-parity", parity_trajectory, (MESH["mesh-parity"],)),
             ("mesh-parity-params", parity_trajectory, (MESH["mesh-parity-params"],)),
             ("mesh-same-bf16-fp32acc", same_as_full_buffer, (MESH["mesh-same-bf16-fp32acc"],)),
             ("mesh-accumulate", accumulation, (MESH["mesh-accumulate"],)),
             ("mesh-accumulate-all-no-sync", accumulation,
              (MESH["mesh-accumulate-all-no-sync"],)),
             ("tp", tp_same_as_full_buffer, ())]
    cases += [case for case in _cases(4) if case[0] in FLAT_FOUR]
    return run_cases(4, cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FLAT_PARITY if c != "parity-bf16"])
def test_fp32_parity_with_torch_on_four_flat_ranks(four, case):
    check_fp32_parity(case_result(four, case), case)


@pytest.mark.slow
def test_bf16_parity_with_torch_on_four_flat_ranks(four):
    check_bf16_parity(case_result(four, "parity-bf16"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAME_MULTI))
def test_fp32_accumulated_reduction_bitwise_on_four_flat_ranks(four, case):
    check_bitwise_equal(case_result(four, case), case)


@pytest.mark.slow
def test_accumulation_reduces_every_micro_batch_on_four_flat_ranks(four):
    check_accumulation(4, four)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mesh-parity", "mesh-parity-params"])
def test_mesh_parity_and_second_stage_on_the_kept_shard(four, case):
    """HSDP with sharded params too: gathered within the shard group, replicated across."""
    for v in case_result(four, case):
        assert v["max_diff"] < FP32_TOL and v["norm_diff"] < NORM_RTOL, v
        n = v["buckets"]
        assert v["calls"]["reduce_scatter"] == n
        # The replicate stage averages this rank's kept shard of every bucket, once.
        assert v["calls"]["replicate_all_reduce"] == n
        assert v["bytes"]["replicate_all_reduce"] == 4 * v["padded"] // 2


@pytest.mark.slow
def test_mesh_bitwise_equal_with_fp32_accumulation(four):
    for v in case_result(four, "mesh-same-bf16-fp32acc"):
        assert v["same"] and v["calls"][0] == v["calls"][1]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mesh-accumulate", "mesh-accumulate-all-no-sync"])
def test_mesh_accumulation_replicates_once_per_step(four, case):
    """Every micro-batch reduce-scatters over the shard group; the replicas average the kept
    shard once per step, in the synced micro-batch or in finish_grad_sync."""
    for v in case_result(four, case):
        assert v["max_diff"] <= FP32_TOL, v
        n = v["buckets"]
        for calls in v["calls"]:
            assert calls["reduce_scatter"] == MICRO * n
            assert calls["replicate_all_reduce"] == n


@pytest.mark.slow
def test_tensor_parallel_bitwise_equal_to_the_full_buffer(four):
    assert all(case_result(four, "tp"))
