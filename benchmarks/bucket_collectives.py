"""Where a step's communication time goes with many buckets: the benchmark MLP's buckets at a
given bucket size, reduced and gathered as distopt does and as gloo's own collectives do.

    python benchmarks/bucket_collectives.py --nproc 2 --bucket-size 40000 --iters 30

For each way, every rank runs the whole step's collectives (all buckets) after a barrier; a
step's time is the slowest rank's, the figure the median over ``--iters`` steps, the ways
taken in turn in every step so that the machine's slow spells fall on all of them:

- distopt reduce-scatter: every bucket's point-to-point reduce-scatter started, then all
  waited for (what ``finish_grad_sync`` does without overlap);
- distopt all-gather, one by one: each bucket's gather waited for before the next starts;
- distopt all-gather, together: all started, then all waited for;
- gloo reduce_scatter_tensor / all_gather_into_tensor per bucket (started together), and the
  same on the whole model as one bucket.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distopt
from distopt.bench.models import build_model
from distopt.bench.runner import init_rank
from distopt.comm import collectives as comm


def _ways(rank: int, d: int, buckets: list[torch.Tensor], whole: torch.Tensor):
    group = dist.group.WORLD

    def wait_all(handles) -> None:
        for handle in handles:
            handle.wait()

    def p2p_reduce(bufs):
        wait_all([comm.reduce_scatter_avg(b.chunk(d)[rank], b, group, async_op=True)
                  for b in bufs])

    def p2p_gather_one_by_one(bufs):
        for b in bufs:
            comm.all_gather(b, b.chunk(d)[rank], group, async_op=False)

    def p2p_gather_together(bufs):
        wait_all([comm.all_gather(b, b.chunk(d)[rank], group, async_op=True) for b in bufs])

    def gloo_reduce(bufs):
        wait_all([dist.reduce_scatter_tensor(torch.empty(b.numel() // d), b, group=group,
                                             async_op=True) for b in bufs])

    def gloo_gather(bufs):
        wait_all([dist.all_gather_into_tensor(b, b.chunk(d)[rank].clone(), group=group,
                                              async_op=True) for b in bufs])

    n = len(buckets)
    return {
        f"distopt reduce-scatter, {n} buckets": (p2p_reduce, buckets),
        f"distopt all-gather one by one, {n} buckets": (p2p_gather_one_by_one, buckets),
        f"distopt all-gather together, {n} buckets": (p2p_gather_together, buckets),
        f"gloo reduce_scatter_tensor, {n} buckets": (gloo_reduce, buckets),
        f"gloo all_gather_into_tensor, {n} buckets": (gloo_gather, buckets),
        "distopt reduce-scatter, 1 bucket": (p2p_reduce, [whole]),
        "distopt all-gather, 1 bucket": (p2p_gather_one_by_one, [whole]),
        "gloo reduce_scatter_tensor, 1 bucket": (gloo_reduce, [whole]),
        "gloo all_gather_into_tensor, 1 bucket": (gloo_gather, [whole]),
    }


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    init_rank(rank, args.nproc, "cpu", 1, tmp)
    d = args.nproc
    torch.manual_seed(0)
    module = build_model(args.model, 128).module
    ddp = distopt.DistributedDataParallel(module, bucket_size=args.bucket_size,
                                          overlap_grad_reduce=False)
    sizes = [bucket.grad_data.numel() for bucket in ddp.buckets]
    buckets = [torch.randn(s) for s in sizes]
    whole = torch.randn(sum(sizes))
    ways = _ways(rank, d, buckets, whole)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.iters + 3):
        for name, (run, bufs) in ways.items():
            dist.barrier()
            start = time.perf_counter()
            run(bufs)
            times[name].append(time.perf_counter() - start)
    slowest = {}
    for name, own in times.items():
        t = torch.tensor(own[3:], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
    if rank == 0:
        print(f"{args.model}, d = {d}, bucket size {args.bucket_size}: buckets of {sizes} "
              f"elements; median ms of the slowest rank over {args.iters} steps")
        for name, t in slowest.items():
            print(f"  {name:<46}{statistics.median(t) * 1e3:8.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--bucket-size", type=int, default=40_000)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="distopt-buckets-") as tmp:
        mp.start_processes(_worker, args=(args, tmp), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
