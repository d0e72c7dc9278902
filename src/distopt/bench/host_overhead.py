"""Host overhead of ``step()`` + ``zero_grad()``: distopt against ``torch.optim.AdamW(foreach)``.

A model of many small parameters (1,000 tensors of 64 elements by default) makes the update
itself nearly free, so what is measured is the per-step cost of the host code around it:
Python loops over parameters, per-tensor bookkeeping, kernel launches. Both sides run one
process; distopt runs the same code path as on d ranks with communication skipped. distopt is
timed twice: with fp32 state, and with ``state_dtype=torch.bfloat16``, whose step is chunked
(one inner step per bucket, each state tensor copied to fp32 before it and rounded after it;
see [Note: state precision] in optim/state_precision.py).

It also reports the optimizer step's achieved memory bandwidth on a large flat model, as a
fraction of the device's copy bandwidth (AdamW reads param, grad and two moments and writes
param and both moments: 28 bytes per fp32 element).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

import distopt

ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "foreach": True}


class ManySmall(nn.Module):
    """``count`` parameters of ``numel`` elements each, registered in one ParameterList."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(count))


def _backward_with(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    """A backward that leaves exactly ``grads`` as the params' grads (through distopt's hooks
    into the grad buffer), so that what is timed next starts where a real step does."""
    loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True))
    loss.backward()


def _timeit(fn, refill, iters: int, sync) -> list[float]:
    times = []
    for _ in range(iters):
        refill()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def measure_host_overhead(
    *, count: int = 1000, numel: int = 64, iters: int = 200, device: str = "cpu",
    bucket_size: int | None = None,
) -> dict[str, Any]:
    """Median seconds of ``step(); zero_grad()`` for torch AdamW(foreach) and for distopt,
    with fp32 and with bf16 state (``bucket_size``: distopt's elements per bucket)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(1)
    grads = [torch.randn(numel, device=dev) for _ in range(count)]

    torch.manual_seed(0)
    plain = ManySmall(count, numel).to(dev)
    plain_params = list(plain.parameters())
    torch_opt = torch.optim.AdamW(plain_params, **ADAMW)

    def torch_refill() -> None:
        for p, g in zip(plain_params, grads, strict=True):
            p.grad = g

    def torch_step() -> None:
        torch_opt.step()
        torch_opt.zero_grad()

    def distopt_run(state_dtype: torch.dtype | None):
        """(model, ddp, optimizer, refill, step) of one distopt configuration."""
        torch.manual_seed(0)
        model = ManySmall(count, numel).to(dev)
        ddp = distopt.DistributedDataParallel(model, bucket_size=bucket_size)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, state_dtype=state_dtype,
                                           **ADAMW)
        params = list(model.parameters())

        def refill() -> None:
            _backward_with(params, grads)

        def step() -> None:
            opt.step()
            opt.zero_grad()

        return model, ddp, opt, refill, step

    model, ddp, opt, distopt_refill, distopt_step = distopt_run(None)
    bf16_model, _, bf16_opt, bf16_refill, bf16_step = distopt_run(torch.bfloat16)
    initial = [p.detach().clone() for p in model.parameters()]

    def inner_step() -> None:
        opt.optimizer.step()

    # Interleave them, in rounds, so that a drift of the machine's speed hits all alike.
    torch_times: list[float] = []
    distopt_times: list[float] = []
    bf16_times: list[float] = []
    for _ in range(5):
        torch_times += _timeit(torch_step, torch_refill, iters // 5, sync)
        distopt_times += _timeit(distopt_step, distopt_refill, iters // 5, sync)
        bf16_times += _timeit(bf16_step, bf16_refill, iters // 5, sync)
    # All took the same steps from the same weights with the same grads: with fp32 state the
    # same weights now, with bf16 state weights that moved as far.
    def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    max_diff = diff(plain_params, list(model.parameters()))
    bf16_diff = diff(plain_params, list(bf16_model.parameters()))
    moved = diff(initial, plain_params)
    bf16_held = {v.dtype for s in bf16_opt.state.values() for k, v in s.items() if k != "step"}
    # The inner torch AdamW alone on distopt's pieces (the rest of distopt's step is its own
    # code), interleaved with the whole step again so that both see the same machine.
    inner_times: list[float] = []
    again: list[float] = []
    for _ in range(5):
        inner_times += _timeit(inner_step, distopt_refill, iters // 10, sync)
        again += _timeit(distopt_step, distopt_refill, iters // 10, sync)
    warm = max(1, iters // 25)
    t_torch = statistics.median(torch_times[warm:])
    t_distopt = statistics.median(distopt_times[warm:])
    t_bf16 = statistics.median(bf16_times[warm:])
    return {
        "params": count,
        "numel_per_param": numel,
        "torch_adamw_foreach_s": t_torch,
        "distopt_s": t_distopt,
        "distopt_inner_optimizer_s": statistics.median(inner_times[1:]),
        "distopt_again_s": statistics.median(again[1:]),
        "ratio": t_distopt / t_torch,
        "distopt_bf16_state_s": t_bf16,
        "bf16_state_ratio": t_bf16 / t_torch,
        "pieces": len(opt.main_params),
        "buckets": len(ddp.buckets),
        "max_param_diff": max_diff,
        "bf16_state_max_param_diff": bf16_diff,
        "bf16_state_dtypes": sorted(str(d) for d in bf16_held),
        "moved": moved,
    }


def measure_step_bandwidth(
    *, numel: int = 16 * 2**20, iters: int = 20, device: str = "cpu"
) -> dict[str, Any]:
    """Achieved bandwidth of distopt's AdamW step on one flat ``numel``-element model, and
    the device's copy bandwidth (read + write of a same-sized fp32 tensor)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = nn.Linear(numel // 1024, 1024, bias=False).to(dev)
    ddp = distopt.DistributedDataParallel(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW)
    weight = model.weight
    grad = torch.randn_like(weight)

    def refill() -> None:
        opt.zero_grad()
        _backward_with([weight], [grad])

    step_times = _timeit(opt.step, refill, iters, sync)[2:]
    src = torch.randn(numel, device=dev)
    dst = torch.empty_like(src)
    copy_times = _timeit(lambda: dst.copy_(src), lambda: None, iters, sync)[2:]
    n = sum(p.numel() for p in model.parameters())
    step_bytes = 28 * n  # read param, grad, m, v; write param, m, v (fp32)
    copy_bytes = 8 * numel
    step_bw = step_bytes / statistics.median(step_times)
    copy_bw = copy_bytes / statistics.median(copy_times)
    return {
        "numel": n,
        "step_s": statistics.median(step_times),
        "step_GBps": step_bw / 1e9,
        "copy_GBps": copy_bw / 1e9,
        "fraction_of_copy": step_bw / copy_bw,
    }


def main(args: argparse.Namespace) -> int:
    """``distopt bench --host-overhead``: print both measurements, write JSON to --out."""
    threads = args.threads or 1
    torch.set_num_threads(threads)
    overhead = measure_host_overhead(device=args.device, bucket_size=args.bucket_size)
    bandwidth = measure_step_bandwidth(device=args.device)
    print(
        f"step()+zero_grad(), {overhead['params']} params of {overhead['numel_per_param']} "
        f"elements in {overhead['buckets']} bucket(s), {args.device}, {threads} thread(s):\n"
        f"  torch.optim.AdamW(foreach=True): {overhead['torch_adamw_foreach_s'] * 1e3:8.3f} ms\n"
        f"  distopt DistributedOptimizer:    {overhead['distopt_s'] * 1e3:8.3f} ms"
        f"   ({overhead['ratio']:.2f}x)\n"
        f"  the same, state_dtype=bfloat16:  {overhead['distopt_bf16_state_s'] * 1e3:8.3f} ms"
        f"   ({overhead['bf16_state_ratio']:.2f}x)\n"
        f"  torch AdamW alone on distopt's pieces: "
        f"{overhead['distopt_inner_optimizer_s'] * 1e3:.3f} ms, against "
        f"{overhead['distopt_again_s'] * 1e3:.3f} ms for distopt's whole step+zero_grad "
        f"measured alongside"
    )
    print(
        f"AdamW step on {bandwidth['numel'] / 2**20:.0f}M fp32 params: "
        f"{bandwidth['step_s'] * 1e3:.2f} ms, {bandwidth['step_GBps']:.1f} GB/s = "
        f"{bandwidth['fraction_of_copy']:.2f} of copy bandwidth "
        f"({bandwidth['copy_GBps']:.1f} GB/s)"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host_overhead.json")
    with open(path, "w") as f:
        json.dump({"host_overhead": overhead, "step_bandwidth": bandwidth,
                   "device": args.device, "threads": threads, "torch": torch.__version__},
                  f, indent=1)
    print(f"wrote {path}")
    return 0
