"""Step times of several systems taken in turn, one step each, inside one process group: a
comparison that a machine whose speed drifts by the minute cannot tilt.

    python benchmarks/interleaved_steps.py --nproc 2 --model mlp --steps 20 \
        --systems ddp distopt-no-overlap distopt megatron megatron-overlap deepspeed-z2

Every system of ``distopt bench`` (the peers need the ``peers`` extra) is built on the same
ranks from the same seed; then, step after step, each trains one step on the same batch in a
rotating order, after a barrier. A step's time is the slowest rank's. The output is each
system's median step and, for each distopt configuration, the median over cycles of its step
over each peer's step of the same cycle (the two ran seconds apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distopt.bench.models import build_model
from distopt.bench.peers import build_peer_system
from distopt.bench.runner import init_rank, slowest_rank, timed_step
from distopt.bench.systems import LABELS, PEER_SYSTEMS, build_system


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    device = init_rank(rank, args.nproc, "cpu", 1, tmp)
    built = []
    for name in args.systems:
        torch.manual_seed(0)
        model = build_model(args.model, args.seq_len)
        build = build_peer_system if name in PEER_SYSTEMS else build_system
        built.append((name, build(name, model.module, device, bucket_size=args.bucket_size),
                      model))
    times: dict[str, list[float]] = {name: [] for name in args.systems}
    for step in range(args.warmup + args.steps):
        shift = step % len(built)
        for name, system, model in built[shift:] + built[:shift]:
            seconds = timed_step(system, model, model.batch(step, rank, 1, device))
            if step >= args.warmup:
                times[name].append(seconds)
    slowest = {name: slowest_rank(own) for name, own in times.items()}
    if rank == 0:
        _report(args, slowest)
    dist.barrier()
    dist.destroy_process_group()


def _report(args: argparse.Namespace, slowest: dict[str, list[float]]) -> None:
    print(f"{args.model}, d = {args.nproc}, {args.steps} steps of each, taken in turn; "
          "median ms of the slowest rank")
    for name, t in slowest.items():
        print(f"  {LABELS[name]:<34}{statistics.median(t) * 1e3:9.1f}")
    mine = [n for n in slowest if n.startswith("distopt")]
    peers = [n for n in slowest if not n.startswith("distopt")]
    ratios = {
        m: {p: statistics.median(a / b for a, b in zip(slowest[m], slowest[p], strict=True))
            for p in peers}
        for m in mine
    }
    for m, row in ratios.items():
        print(f"  {LABELS[m]} / " + ", ".join(f"{LABELS[p]} {r:.2f}" for p, r in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "step_s": slowest, "ratios": ratios}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="mlp")
    p.add_argument("--systems", nargs="+", default=["ddp", "distopt-no-overlap", "distopt"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON file for the step times and ratios")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="distopt-interleaved-") as tmp:
        mp.start_processes(_worker, args=(args, tmp), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
