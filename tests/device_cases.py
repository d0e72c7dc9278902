"""Training cases that take the device as an argument, for one rank.

tests/gpu/test_cuda.py runs them on a CUDA GPU; tests/test_device_cases.py runs each of them on
the CPU, so that the logic of every GPU test has run on any machine. Each returns the figures
its tests assert on. They mirror tests/test_parity.py (same model, batches, clipping, schedule
and tolerances) with everything placed on ``device``; on one rank the data-parallel
collectives have nothing to send, so what they check is distopt's own arithmetic and the order
of its work on the device.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt

from helpers import (
    BF16_TOL,
    CLIP,
    FP32_TOL,
    NORM_RTOL,
    PARITY_OPTIMIZERS,
    PARITY_STEPS,
    fp32_master_step,
    lm_loss,
    max_diff,
    muon_groups,
    parity_groups,
    same,
    snapshot,
)
from models import AwkwardLM, batches, mlp

STEPS = PARITY_STEPS
OPTIMIZERS = PARITY_OPTIMIZERS

KERNEL_KEYS = ("foreach", "fused")
CPU_KERNEL = {"foreach": True, "fused": None}
"""The inner optimizer's kernel options on the CPU (distopt's default since before CUDA)."""
CUDA_KERNEL = {"foreach": None, "fused": True}
"""... and on CUDA, for the classes that have a fused kernel."""


@contextlib.contextmanager
def single_rank_group(backend: str, store_dir: Path) -> Iterator[None]:
    """A default process group of one rank (rendezvous through a file), destroyed on exit."""
    store = dist.FileStore(str(store_dir / f"store-{backend}"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def kernel_of(opt: torch.optim.Optimizer) -> dict[str, bool | None]:
    """The ``foreach``/``fused`` options the inner optimizer runs with."""
    return {k: opt.param_groups[0].get(k) for k in KERNEL_KEYS}


def _on(device: torch.device, step: int, global_batch: int = 12
        ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = batches(step, global_batch)
    return tokens.to(device), targets.to(device)


# ---------------------------------------------------------------------- parity


def parity_fp32(device: torch.device, opt_name: str) -> dict:
    """distopt (its default kernel) against torch.optim (torch's default kernel) on the same
    device: STEPS steps with clipping, a cosine schedule, two param groups and a layer used
    on even steps only."""
    torch.manual_seed(0)
    model = AwkwardLM().to(device)
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model)
    opt_cls, _, kwargs = OPTIMIZERS[opt_name]
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, opt_cls, params=parity_groups(model, opt_name),
                                       clip_grad=CLIP, overlap_param_gather=True, **kwargs)
    sched = CosineAnnealingLR(opt, T_max=STEPS)
    ref_opt = opt_cls(parity_groups(ref, opt_name), **kwargs)
    ref_sched = CosineAnnealingLR(ref_opt, T_max=STEPS)
    trainable = [p for p in ref.parameters() if p.requires_grad]

    worst, worst_norm = 0.0, 0.0
    for step in range(STEPS):
        tokens, targets = _on(device, step)
        opt.zero_grad()
        lm_loss(ddp, tokens, targets, step).backward()
        result = opt.step()
        sched.step()

        ref_opt.zero_grad(set_to_none=True)
        lm_loss(ref, tokens, targets, step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in trainable if p.grad is not None], CLIP
        )
        ref_opt.step()
        ref_sched.step()

        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norm.item() - 1))
    return {"max_diff": worst, "norm_diff": worst_norm, "moved": max_diff(model, start),
            "kernel": kernel_of(opt), "devices": {p.device.type for p in model.parameters()}}


# Muon for the hidden matrices, AdamW for the tied embedding and the rest.
MUON = {"lr": 0.02, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95)}


def parity_muon(device: torch.device) -> dict:
    """Muon + AdamW in one distopt optimizer against torch.optim.Muon and torch.optim.AdamW on
    the same device (each with its default kernel), with clipping and a cosine schedule."""
    torch.manual_seed(0)
    model = AwkwardLM().to(device)
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon,
                                       params=muon_groups(model, MUON, ADAMW, embedding=False),
                                       clip_grad=CLIP, overlap_param_gather=True)
    sched = CosineAnnealingLR(opt, T_max=STEPS)
    ref_muon, ref_adamw = muon_groups(ref, MUON, ADAMW, embedding=False)
    ref_opts = [torch.optim.Muon([ref_muon]),
                torch.optim.AdamW([{k: v for k, v in ref_adamw.items() if k != "optimizer"}])]
    ref_scheds = [CosineAnnealingLR(o, T_max=STEPS) for o in ref_opts]
    trainable = [p for p in ref.parameters() if p.requires_grad]

    worst = 0.0
    for step in range(STEPS):
        tokens, targets = _on(device, step)
        opt.zero_grad()
        lm_loss(ddp, tokens, targets, step).backward()
        opt.step()
        sched.step()
        for o in ref_opts:
            o.zero_grad(set_to_none=True)
        lm_loss(ref, tokens, targets, step).backward()
        torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], CLIP)
        for o, s in zip(ref_opts, ref_scheds, strict=True):
            o.step()
            s.step()
        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
    return {"max_diff": worst, "moved": max_diff(model, start),
            "classes": [type(o).__name__ for o in opt.optimizers],
            "adamw_kernel": kernel_of(opt.optimizers[1])}


def parity_bf16(device: torch.device) -> dict:
    """bf16 params with fp32 grads against a reference that keeps fp32 master weights and
    casts them to bf16 after each step."""
    torch.manual_seed(0)
    model = AwkwardLM().to(device, torch.bfloat16)
    ref = copy.deepcopy(model)
    ref_trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = [nn.Parameter(p.detach().float()) for p in ref_trainable]
    ddp = distopt.DistributedDataParallel(model, grad_dtype=torch.float32, bucket_size=40,
                                          find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    worst = 0.0
    for step in range(STEPS):
        tokens, targets = _on(device, step)
        opt.zero_grad()
        lm_loss(ddp, tokens, targets, step).backward()
        opt.step()

        fp32_master_step(ref_trainable, masters, ref_opt,
                         lm_loss(ref, tokens, targets, step))
        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
    return {"max_diff": worst, "dtypes": {p.dtype for p in model.parameters()}}


FP16_STEPS = 8
OVERFLOW_STEP = 3
FP16_SCALE = 2.0**10  # a power of two: scaling the loss and unscaling the grads are exact
# The fp16 weights stay below 2 in magnitude, where one fp16 ulp is 2**-10; allow four ulps
# (the fp32 masters differ by roundoff, and one cast may round the other way).
FP16_TOL = 4 * 2**-10


def fp16_dynamic_scaler(device: torch.device) -> dict:
    """fp16 params with a DynamicLossScaler; step OVERFLOW_STEP's loss is multiplied by inf.

    That step must be skipped with nothing changed (params, main params, optimizer state,
    step counts) and the scale halved; the other steps must match an fp32-master reference
    that skips the same step and scales its loss alike.
    """
    torch.manual_seed(0)
    model = AwkwardLM().to(device, torch.float16)
    ref = copy.deepcopy(model)
    ref_trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = [nn.Parameter(p.detach().float()) for p in ref_trainable]
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, find_unused_parameters=True)
    scaler = distopt.DynamicLossScaler(initial_scale=FP16_SCALE, hysteresis=1,
                                       growth_interval=1000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
                                       loss_scaler=scaler)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    updated, unchanged, scales, worst = [], None, [], 0.0
    for step in range(FP16_STEPS):
        tokens, targets = _on(device, step)
        scale = scaler.scale
        poison = math.inf if step == OVERFLOW_STEP else 1.0
        before = snapshot(model, opt)
        opt.zero_grad()
        opt.scale_loss(lm_loss(ddp, tokens, targets, step) * poison).backward()
        updated.append(opt.step().updated)
        ddp.finish_param_sync()
        scales.append(scaler.scale)
        if step == OVERFLOW_STEP:
            unchanged = same(before, snapshot(model, opt))
            continue

        for p in ref_trainable:
            p.grad = None
        (lm_loss(ref, tokens, targets, step) * scale).backward()
        for master, p in zip(masters, ref_trainable, strict=True):
            master.grad = None if p.grad is None else p.grad.float() / scale
        torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], CLIP)
        ref_opt.step()
        with torch.no_grad():
            for master, p in zip(masters, ref_trainable, strict=True):
                p.copy_(master)
        worst = max(worst, max_diff(model, ref))
    return {"updated": updated, "unchanged": unchanged, "scales": scales, "max_diff": worst}


def no_sync_accumulation(device: torch.device, shard_grads: bool = False) -> dict:
    """4 micro-batches, the first 3 under no_sync, equal one step on the whole batch; with
    ``shard_grads`` every micro-batch is reduced into the kept shard."""
    torch.manual_seed(0)
    model = AwkwardLM().to(device)
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=40,
                                          shard_grads=shard_grads)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    worst = 0.0
    for step in range(3):
        tokens, targets = _on(device, step, global_batch=48)
        micro = list(zip(tokens.chunk(4), targets.chunk(4), strict=True))
        opt.zero_grad()
        for i, (t, y) in enumerate(micro):
            loss = lm_loss(ddp, t, y, 0) / 4
            if i < 3:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        ref_opt.zero_grad()
        lm_loss(ref, tokens, targets, 0).backward()
        ref_opt.step()
        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
    pools = ddp.grad_pools.values()
    return {"max_diff": worst, "peak_buffers": [pool.peak_buffers for pool in pools],
            "live_buffers": [pool.live_buffers for pool in pools]}


def held_state_one_step(device: torch.device, state_dtype: torch.dtype) -> dict:
    """One AdamW step with the state held in ``state_dtype`` against the same step with fp32
    state, on the same device: the moments torch creates in fp32 are narrowed once, so each
    held tensor equals the fp32 run's rounded to bf16 (``.to``), or for fp16 and fp8 cut into
    blocks of 32 and scaled by powers of two (distopt.optim.block_scaling.quantize)."""
    from distopt.optim.block_scaling import DEFAULT_BLOCK_SIZE, needs_scales, quantize

    states = {}
    for dtype in (torch.float32, state_dtype):
        torch.manual_seed(0)
        model = AwkwardLM().to(device)
        ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=40)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2, state_dtype=dtype)
        tokens, targets = _on(device, 0)
        opt.zero_grad()
        lm_loss(ddp, tokens, targets, 0).backward()
        opt.step()
        # fp32 main params are views of the param buffer: their offset in it places their
        # state, whatever pieces the step cut (one per bucket with held state).
        states[dtype] = [(main.storage_offset(), main.shape, entries)
                         for main, entries in opt.state.items()]
    reference = {}
    for key in ("exp_avg", "exp_avg_sq"):
        end = max(offset + math.prod(shape) for offset, shape, _ in states[torch.float32])
        flat = torch.full((end,), float("nan"), device=device)
        for offset, shape, entries in states[torch.float32]:
            flat[offset : offset + math.prod(shape)] = entries[key].reshape(-1)
        reference[key] = flat
    equal, dtypes, devices, scaled = [], set(), set(), 0
    for offset, shape, held in states[state_dtype]:
        for key in ("exp_avg", "exp_avg_sq"):
            value = held[key]
            ref = reference[key][offset : offset + math.prod(shape)]
            dtypes.add(value.dtype)
            devices.add(value.device.type)
            if needs_scales(state_dtype):
                values, exponents = quantize(ref, state_dtype, DEFAULT_BLOCK_SIZE)
                equal.append(torch.equal(value.reshape(-1).view(torch.uint8),
                                         values.view(torch.uint8))
                             and torch.equal(held[key + ".block_exponents"], exponents))
                scaled += 1
            else:
                equal.append(torch.equal(value.reshape(-1), ref.to(state_dtype)))
    return {"equal": equal, "dtypes": dtypes, "devices": devices, "scaled": scaled}


# ---------------------------------------------------------------------- checkpoints


def _build(device: torch.device, **kwargs) -> tuple[nn.Module, distopt.DistributedDataParallel,
                                                    distopt.DistributedOptimizer]:
    torch.manual_seed(0)
    model = AwkwardLM().to(device)
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
                                       **kwargs)
    return model, ddp, opt


def _train(device: torch.device, ddp: distopt.DistributedDataParallel,
           opt: distopt.DistributedOptimizer, steps: range) -> None:
    for step in steps:
        tokens, targets = _on(device, step)
        opt.zero_grad()
        lm_loss(ddp, tokens, targets, step).backward()
        opt.step()
    ddp.finish_param_sync()


def _cpu_state(opt: distopt.DistributedOptimizer) -> list[torch.Tensor]:
    """Main params and optimizer state (step counts included), copied to the CPU, in piece
    order."""
    out = [m.detach().to("cpu", copy=True) for m in opt.main_params]
    for main in opt.main_params:
        state = opt.state[main]
        out += [state[k].detach().to("cpu", copy=True) for k in sorted(state)]
    return out


def _steps_where_torch_keeps_them(opt: distopt.DistributedOptimizer) -> bool:
    """Step counts on the CPU for plain kernels, on the params' device for fused ones."""
    for group in opt.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for main in group["params"]:
            want = main.device if on_device else torch.device("cpu")
            if opt.state[main]["step"].device != want:
                return False
    return True


def checkpoint_round_trip(tmp: Path, first: torch.device, second: torch.device,
                          first_kwargs: dict | None = None,
                          second_kwargs: dict | None = None) -> dict:
    """Train on ``first``, save, load on ``second``, train both on; then save on ``second``
    and load back on ``first``. Loads must reproduce the saved values exactly, keep the
    loading optimizer's own kernel, and the continued runs must agree."""
    first_kwargs, second_kwargs = first_kwargs or {}, second_kwargs or {}
    model_a, ddp_a, opt_a = _build(first, **first_kwargs)
    _train(first, ddp_a, opt_a, range(3))
    distopt.save_checkpoint(tmp / "a", ddp_a, opt_a, extra={"step": 3})
    saved_a = _cpu_state(opt_a)
    _train(first, ddp_a, opt_a, range(3, 5))

    model_b, ddp_b, opt_b = _build(second, **second_kwargs)
    extra = distopt.load_checkpoint(tmp / "a", ddp_b, opt_b)
    exact_b = all(torch.equal(x, y) for x, y in zip(saved_a, _cpu_state(opt_b), strict=True))
    kernel_b, steps_b = kernel_of(opt_b), _steps_where_torch_keeps_them(opt_b)
    _train(second, ddp_b, opt_b, range(3, 5))
    diff_b = max_diff(model_a, model_b)

    distopt.save_checkpoint(tmp / "b", ddp_b, opt_b)
    saved_b = _cpu_state(opt_b)
    model_c, ddp_c, opt_c = _build(first, **first_kwargs)
    distopt.load_checkpoint(tmp / "b", ddp_c, opt_c)
    exact_c = all(torch.equal(x, y) for x, y in zip(saved_b, _cpu_state(opt_c), strict=True))
    kernel_c, steps_c = kernel_of(opt_c), _steps_where_torch_keeps_them(opt_c)
    _train(first, ddp_c, opt_c, range(5, 6))
    _train(second, ddp_b, opt_b, range(5, 6))
    diff_c = max_diff(model_b, model_c)
    return {"extra": extra, "exact": [exact_b, exact_c], "kernels": [kernel_b, kernel_c],
            "steps_placed": [steps_b, steps_c], "max_diff": max(diff_b, diff_c),
            "devices": [{p.device.type for p in m.parameters()}
                        for m in (model_a, model_b, model_c)]}


# ---------------------------------------------------------------------- memory

MEMORY_SIZES = [1024, 2048, 2048, 1024]


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _warm_up(device: torch.device) -> None:
    """Allocate what the device keeps for good after its first matmuls, forward and backward
    (cuBLAS workspaces), so that it is not counted as distopt's."""
    layer = nn.Linear(64, 64).to(device)
    layer(torch.randn(8, 64, device=device)).sum().backward()


def memory_figures(device: torch.device) -> dict:
    """What a rank holds after a step, against distopt's own measurement and the theory, and
    the peak of a step above what is held (measured on CUDA only; None elsewhere).

    fp32 params and grads, AdamW, one rank: the theory is 16 bytes per param (params, grads,
    two moments; the main params and grads are views) plus the padding of the buckets.
    """
    _warm_up(device)
    base = _allocated(device)
    torch.manual_seed(0)
    model = mlp(MEMORY_SIZES).to(device)
    ddp = distopt.DistributedDataParallel(model, bucket_size=2**20)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=1.0, lr=1e-3)
    model_in = torch.randn(16, MEMORY_SIZES[0], device=device)

    def forward_backward() -> None:
        opt.zero_grad()
        ddp(model_in).square().mean().backward()

    forward_backward()
    opt.step()
    held = _allocated(device)
    held = None if held is None else held - base - model_in.numel() * 4

    forward_backward()
    before_step = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt.step()
    peak = None
    if before_step is not None:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before_step

    report = distopt.measure_state_bytes(opt)
    owned = sum(m.numel() for m in opt.main_params)
    return {
        "report": report,
        "theory": distopt.theoretical_bytes_per_param(torch.float32, torch.float32, 1),
        "held": held,
        "step_peak": peak,
        "bucket_fp32_bytes": 4 * max(b.grad_shard.numel() for b in ddp.buckets),
        "owned_fp32_bytes": 4 * owned,
        "kernel": kernel_of(opt),
    }


def step_temporaries_bound(figures: dict) -> int:
    """Bytes a step may allocate above what is held: one bucket's fp32 shard, and the inner
    optimizer's temporaries (a fused kernel keeps none; torch's foreach AdamW holds one fp32
    copy of the state, sqrt(v), counted twice for its lists of intermediate results), and a
    MiB for the scalars of clipping and the step counts."""
    fused = bool(figures["kernel"]["fused"])
    temporaries = 0 if fused else 2 * figures["owned_fp32_bytes"]
    return figures["bucket_fp32_bytes"] + temporaries + 2**20


# ---------------------------------------------------------------------- ordering

DELAY_WIDTH, DELAY_LAYERS, DELAY_STEPS = 64, 4, 4


def cuda_sleep(cycles: int = 20_000_000) -> Callable[[], None]:
    """A delay on the current CUDA stream: later work on the stream waits ~10 ms for it."""
    return lambda: torch.cuda._sleep(cycles)


def no_delay() -> None:
    pass


def delayed_run(device: torch.device, overlap: bool, delay: Callable[[], None]
                ) -> list[torch.Tensor]:
    """Train an MLP with one bucket per layer, ``delay()`` enqueued before every forward and,
    in backward, before the grads of each layer are computed (so before its bucket can be
    launched); returns the params, on the CPU."""
    torch.manual_seed(0)
    model = mlp([DELAY_WIDTH] * (DELAY_LAYERS + 1)).to(device)
    bucket = DELAY_WIDTH * DELAY_WIDTH + DELAY_WIDTH  # one Linear's elements
    ddp = distopt.DistributedDataParallel(model, bucket_size=bucket,
                                          overlap_grad_reduce=overlap)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2, clip_grad=1.0,
                                       overlap_param_gather=overlap)

    def delayed_grad(grad: torch.Tensor) -> torch.Tensor:
        delay()
        return grad

    def hook_outputs(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(delayed_grad)

    handles = [layer.register_forward_hook(hook_outputs)
               for layer in model if isinstance(layer, nn.Linear)]
    g = torch.Generator().manual_seed(7)
    for _ in range(DELAY_STEPS):
        model_in = torch.randn(8, DELAY_WIDTH, generator=g).to(device)
        opt.zero_grad()
        delay()
        F.mse_loss(ddp(model_in), model_in).backward()
        opt.step()
    ddp.finish_param_sync()
    for handle in handles:
        handle.remove()
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


# ---------------------------------------------------------------------- distopt train


def train_command(out: Path, device: str, steps: int, nproc: int = 1) -> list[str]:
    """``distopt train`` on the tiny model, small enough for a test."""
    return [sys.executable, "-m", "distopt", "train", "--device", device, "--nproc", str(nproc),
            "--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--seq-len", "32",
            "--max-bytes", "300000", "--eval-every", "0", "--eval-batches", "2",
            "--save-every", "0", "--warmup", "2", "--no-progress", "--out", str(out)]


def run_train(out: Path, device: str, steps: int, timeout: int = 300
              ) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(out, device, steps), capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------- assertions
# The same on every device, so that the CPU run of a case checks what the GPU run checks.


def check_parity_fp32(value: dict) -> None:
    assert value["max_diff"] <= FP32_TOL, value
    assert value["norm_diff"] <= NORM_RTOL, value
    assert value["moved"] > 1e-2, value  # training really changed the weights


def check_parity_muon(value: dict) -> None:
    assert value["classes"] == ["Muon", "AdamW"], value
    assert value["max_diff"] <= FP32_TOL, value
    assert value["moved"] > 1e-2, value


def check_parity_bf16(value: dict) -> None:
    assert value["dtypes"] == {torch.bfloat16}
    assert value["max_diff"] <= BF16_TOL, value


def check_fp16_dynamic_scaler(value: dict) -> None:
    assert value["updated"] == [step != OVERFLOW_STEP for step in range(FP16_STEPS)], value
    assert value["unchanged"] is True, value
    halved = [FP16_SCALE if step < OVERFLOW_STEP else FP16_SCALE / 2
              for step in range(FP16_STEPS)]
    assert value["scales"] == halved, value
    assert value["max_diff"] <= FP16_TOL, value


def check_no_sync(value: dict) -> None:
    assert value["max_diff"] <= FP32_TOL, value
    # Sharded grads: buffers lent during backward, none kept after the step's sync.
    assert all(n >= 1 for n in value["peak_buffers"]) and not any(value["live_buffers"]), value


def check_held_state(value: dict, state_dtype: torch.dtype) -> None:
    assert value["equal"] and all(value["equal"]), value
    assert value["dtypes"] == {state_dtype}, value
    assert value["scaled"] == (len(value["equal"]) if state_dtype != torch.bfloat16 else 0)


def check_round_trip(value: dict, kernels: list[dict]) -> None:
    assert value["extra"] == {"step": 3}
    assert value["exact"] == [True, True], value
    assert value["kernels"] == kernels, value
    assert value["steps_placed"] == [True, True], value
    assert value["max_diff"] <= FP32_TOL, value


def check_memory(value: dict) -> None:
    report = value["report"]
    # Measured storages: the theory plus the padding of the buckets, far below replicated.
    assert value["theory"] <= report.bytes_per_param < value["theory"] + 0.1, value
    if value["held"] is not None:
        # What the device holds is what distopt counts, up to the step counts, the clipping
        # scalars and the allocator's rounding.
        assert report.total <= value["held"] <= report.total + 2**22, value
    if value["step_peak"] is not None:
        assert value["step_peak"] <= step_temporaries_bound(value), value


def memory_lines(value: dict) -> str:
    """The memory figures as a report for the test log (in MiB)."""
    mib = 2.0**20
    report = value["report"]
    held = "n/a" if value["held"] is None else f"{value['held'] / mib:.2f}"
    peak = "n/a" if value["step_peak"] is None else f"{value['step_peak'] / mib:.2f}"
    return (
        f"distopt memory, {report.num_params} params, kernel {value['kernel']}:\n"
        f"  measure_state_bytes  {report.total / mib:.2f} MiB "
        f"({report.bytes_per_param:.3f} B/param, theory {value['theory']:.1f})\n"
        f"  allocated, held      {held} MiB\n"
        f"  step peak above held {peak} MiB (bound "
        f"{step_temporaries_bound(value) / mib:.2f}: bucket fp32 shard "
        f"{value['bucket_fp32_bytes'] / mib:.2f} + optimizer temporaries + 1)"
    )
