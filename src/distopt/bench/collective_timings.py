"""The collectives distopt issues against the backend's own, on one bucket-sized tensor.

``distopt bench --collectives`` spawns d ranks and times, on the same ``numel`` elements of
fp32: the backend's all-reduce (what DDP issues per bucket), its reduce-scatter and
all-gather (``reduce_scatter_tensor``, ``all_gather_into_tensor``), and distopt's
``collectives.reduce_scatter_avg`` and ``collectives.all_gather`` (on gloo: point-to-point
messages, see [Note: collectives on gloo]). Each call starts after a barrier; a call's time is
the slowest rank's, and the figure is the median over the timed calls. Before timing, each
rank checks that distopt's results equal the backend's, so both sides compute the same thing.
On gloo every op is timed a second time with gloo's I/O threads in the idle scheduling class,
as CPU runs of ``distopt train`` have them ([Note: gloo's I/O thread]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._forkserver import forkserver_preloading
from ..comm import collectives as comm
from ..comm.gloo_io import idle_gloo_io_threads
from .runner import init_rank

OPS = (
    "torch all_reduce",
    "torch reduce_scatter",
    "torch all_gather",
    "distopt reduce_scatter",
    "distopt all_gather",
)


def measure_collectives(
    nproc: int, *, numel: int = 3_260_000, iters: int = 20, warmup: int = 3,
    device: str = "cpu", threads: int = 1,
) -> dict[str, Any]:
    """Median milliseconds of each of ``OPS`` over ``nproc`` freshly spawned ranks."""
    with tempfile.TemporaryDirectory(prefix="distopt-collectives-") as tmp:
        context = mp.start_processes(
            _worker, args=(nproc, numel, iters, warmup, device, threads, tmp),
            nprocs=nproc, join=False,
            start_method=forkserver_preloading("distopt.bench.collective_timings"),
        )
        for process in context.processes:
            process.join()
        # Rank 0 writes the result after the last collective; gloo's threads can still abort
        # a process as it exits, which costs nothing once the result is on disk.
        path = os.path.join(tmp, "result.json")
        if not os.path.exists(path):
            codes = [process.exitcode for process in context.processes]
            raise RuntimeError(f"the collectives benchmark failed on {nproc} ranks "
                               f"(exit codes {codes}); see the ranks' errors above")
        with open(path) as f:
            return json.load(f)


def _worker(rank, nproc, numel, iters, warmup, device, threads, tmp) -> None:
    dev = init_rank(rank, nproc, device, threads, tmp)
    try:
        result = _measure(rank, nproc, numel - numel % nproc, iters, warmup, dev)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _measure(rank, nproc, numel, iters, warmup, dev) -> dict[str, Any]:
    group = dist.group.WORLD
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(rank)
    data = torch.randn(numel, generator=generator).to(dev)
    full = data.clone()
    shard_len = numel // nproc
    shard = torch.empty(shard_len, device=dev)
    own = slice(rank * shard_len, (rank + 1) * shard_len)

    # The same results as the backend's collectives, checked on fresh inputs.
    expected = torch.empty(shard_len, device=dev)
    dist.reduce_scatter_tensor(expected, data.clone(), group=group)
    full.copy_(data)
    comm.reduce_scatter_avg(full[own], full, group, async_op=False)
    max_diff = float((full[own] * nproc - expected).abs().max())
    gathered = torch.empty(numel, device=dev)
    dist.all_gather_into_tensor(gathered, data[own].clone(), group=group)
    full.zero_()
    comm.all_gather(full, data[own], group, async_op=False)
    gather_equal = bool(torch.equal(full, gathered))

    ops: dict[str, Callable[[], Any]] = {
        "torch all_reduce": lambda: dist.all_reduce(full, group=group),
        "torch reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "torch all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "distopt reduce_scatter": lambda: comm.reduce_scatter_avg(
            full[own], full, group, async_op=False),
        "distopt all_gather": lambda: comm.all_gather(full, full[own], group, async_op=False),
    }
    times = _time_ops(ops, full, data, warmup, iters, sync, group)
    ms = _median_ms(times)
    idle_io: dict[str, float] = {}
    if dist.get_backend(group) == "gloo":
        idle_gloo_io_threads()
        idle_io = _median_ms(_time_ops(ops, full, data, warmup, iters, sync, group))
    return {
        "nproc": nproc,
        "numel": numel,
        "bytes": numel * 4,
        "backend": dist.get_backend(group),
        "median_ms": ms,
        "median_ms_idle_io": idle_io,
        "call_ms": {name: [x * 1e3 for x in t] for name, t in times.items()},
        "distopt_over_torch": {
            "reduce_scatter + all_gather / all_reduce":
                (ms["distopt reduce_scatter"] + ms["distopt all_gather"])
                / ms["torch all_reduce"],
            "reduce_scatter": ms["distopt reduce_scatter"] / ms["torch reduce_scatter"],
            "all_gather": ms["distopt all_gather"] / ms["torch all_gather"],
        },
        "check": {"reduce_scatter_max_abs_diff": max_diff, "all_gather_equal": gather_equal},
    }


def _time_ops(ops: dict[str, Callable[[], Any]], full: torch.Tensor, data: torch.Tensor,
              warmup: int, iters: int, sync: Callable[[], Any], group: Any
              ) -> dict[str, list[float]]:
    """Each op's timed calls in seconds, the slowest rank's time of each call."""
    times: dict[str, list[float]] = {}
    for name, op in ops.items():
        full.copy_(data)  # the reductions' sums stay finite whatever the number of calls
        own_times = []
        for _ in range(warmup + iters):
            sync()
            dist.barrier(group)
            start = time.perf_counter()
            op()
            sync()
            own_times.append(time.perf_counter() - start)
        slowest = torch.tensor(own_times[warmup:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times[name] = slowest.tolist()
    return times


def _median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _print_rows(results: list[dict[str, Any]], medians: str) -> None:
    """One row per data-parallel size: each op's median ms, then distopt's two over the
    backend's all-reduce."""
    for r in results:
        ms = r[medians]
        row = " ".join(f"{ms[op]:22.2f}" for op in OPS)
        ratio = (ms["distopt reduce_scatter"] + ms["distopt all_gather"]) / ms["torch all_reduce"]
        print(f"{r['nproc']:>3} {row}   {ratio:.2f}")


def main(args: argparse.Namespace) -> int:
    """``distopt bench --collectives``: one table row per data-parallel size, JSON to --out."""
    results = [
        measure_collectives(n, numel=args.numel, iters=args.steps, warmup=args.warmup,
                            device=args.device, threads=args.threads or 1)
        for n in args.nproc
    ]
    mib = results[0]["numel"] * 4 / 2**20
    print(f"collectives on {mib:.1f} MiB of fp32, {args.device}, median ms of the slowest rank")
    print(f"{'d':>3} " + " ".join(f"{op:>22}" for op in OPS) + "   (rs + ag) / all_reduce")
    _print_rows(results, "median_ms")
    if any(r["median_ms_idle_io"] for r in results):
        print("the same, gloo's I/O threads idle-class (as distopt train on CPU runs them)")
        _print_rows(results, "median_ms_idle_io")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "collectives.json")
    with open(path, "w") as f:
        json.dump({"results": results, "torch": torch.__version__}, f, indent=1)
    print(f"wrote {path}")
    checks = [r["check"] for r in results]
    ok = all(c["all_gather_equal"] and c["reduce_scatter_max_abs_diff"] <= 1e-3 for c in checks)
    return 0 if ok else 1
