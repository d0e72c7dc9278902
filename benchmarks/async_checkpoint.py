"""How long a checkpoint holds training: save_checkpoint synchronous against async_save=True.

Trains the demo GPT (``--model small medium``) with DistributedOptimizer(AdamW) on ``--nproc``
ranks (gloo on CPU; NCCL with gloo beside it on CUDA) and saves every ``--save-every`` steps,
once synchronously and once with ``async_save=True``, into ``--dir``. It reports, per model:

- stall: seconds the ``save_checkpoint`` call held the training loop (the slowest rank's), the
  median over the saves: for a synchronous save the whole write, for an async one the staging
  copy (and any wait for the save before it);
- write: seconds from the call to the checkpoint being published (async: ``handle.wait()``);
- slowdown: seconds the steps that ran while an async write was in flight took beyond the
  median step without one, summed per save (the cost of overlapping the write with training);
- staging: bytes of host memory each rank keeps for async saves (``staging_bytes``).

    python benchmarks/async_checkpoint.py --model small medium --nproc 2 --steps 16 \\
        --save-every 4 --json benchmarks/results/async_checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def _rank_main(rank: int, world: int, store_dir: str, args: argparse.Namespace,
               out: Any) -> None:
    import torch
    import torch.distributed as dist

    import distopt
    from distopt.checkpoint import staging_bytes
    from distopt.train.model import GPT, gpt_config

    cuda = args.device == "cuda"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            store=dist.FileStore(os.path.join(store_dir, "store"), world),
                            rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = {}
    for name in args.model:
        torch.manual_seed(0)
        model = GPT(gpt_config(name, seq_len=args.seq_len)).to(device)
        ddp = distopt.DistributedDataParallel(model)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-4)
        generator = torch.Generator().manual_seed(rank)

        def step(ddp=ddp, opt=opt, generator=generator) -> float:
            return _step(ddp, opt, generator, device, args)

        for _ in range(args.warmup):
            step()
        row = {"params": sum(p.numel() for p in model.parameters())}
        for mode in ("sync", "async"):
            run_dir = Path(args.dir) / f"{name}-{mode}"
            steps, in_flight, stalls, writes = [], [], [], []
            pending = None
            for i in range(args.steps):
                steps.append(step())
                in_flight.append(pending is not None and not pending[0].done())
                if pending is not None and pending[0].done():
                    writes.append(time.perf_counter() - pending[1])
                    pending[0].wait()
                    pending = None
                if (i + 1) % args.save_every == 0:
                    dist.barrier()
                    began = time.perf_counter()
                    saved = distopt.save_checkpoint(run_dir, ddp, opt, keep=1,
                                                    async_save=mode == "async")
                    stalls.append(time.perf_counter() - began)
                    if mode == "sync":
                        writes.append(stalls[-1])
                    else:
                        pending = (saved, began)
            if pending is not None:
                pending[0].wait()
                writes.append(time.perf_counter() - pending[1])
            quiet = [t for t, busy in zip(steps, in_flight, strict=True) if not busy]
            base = statistics.median(quiet)
            row[mode] = {
                "stall_s": stalls, "write_s": writes, "step_s": base,
                "slowdown_s": sum(t - base for t, busy in zip(steps, in_flight, strict=True)
                                  if busy) / max(1, len(stalls)),
            }
        row["staging_bytes"] = staging_bytes(opt)
        results[name] = row
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def _step(ddp: Any, opt: Any, generator: Any, device: Any, args: argparse.Namespace) -> float:
    """One training step on random tokens; its seconds."""
    import torch

    x = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=generator).to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    opt.zero_grad()
    _, loss = ddp(x, x)
    loss.backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began


def _summary(per_rank: list[dict], args: argparse.Namespace) -> dict:
    """The slowest rank's figures, medians over the saves."""
    summary = {}
    for name in args.model:
        rows = [r[name] for r in per_rank]
        entry = {"params": rows[0]["params"],
                 "staging_MiB_per_rank": max(r["staging_bytes"] for r in rows) / MiB}
        for mode in ("sync", "async"):
            stall = [max(col) for col in zip(*(r[mode]["stall_s"] for r in rows), strict=True)]
            write = [max(col) for col in zip(*(r[mode]["write_s"] for r in rows), strict=True)]
            entry[mode] = {"stall_s": statistics.median(stall),
                           "write_s": statistics.median(write),
                           "step_s": max(r[mode]["step_s"] for r in rows),
                           "slowdown_s": max(r[mode]["slowdown_s"] for r in rows)}
        entry["stall_ratio"] = entry["async"]["stall_s"] / entry["sync"]["stall_s"]
        summary[name] = entry
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["small", "medium"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per mode")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary "
                        "directory on /tmp's disk)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="distopt-async-") as tmp:
        args.dir = args.dir or tmp
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, args.nproc, tmp, args, out))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        per_rank = out.get()
        for p in procs:
            p.join()
    summary = _summary(per_rank, args)
    print(f"{'model':<8}{'params':>12}{'sync stall s':>14}{'async stall s':>15}{'ratio':>8}"
          f"{'async write s':>15}{'slowdown s':>12}{'step s':>9}{'staging MiB':>13}")
    for name, e in summary.items():
        print(f"{name:<8}{e['params']:>12,}{e['sync']['stall_s']:>14.3f}"
              f"{e['async']['stall_s']:>15.3f}{e['stall_ratio']:>8.3f}"
              f"{e['async']['write_s']:>15.3f}{e['async']['slowdown_s']:>12.3f}"
              f"{e['sync']['step_s']:>9.3f}{e['staging_MiB_per_rank']:>13.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
             "nproc": args.nproc, "device": args.device, "summary": summary,
             "per_rank": per_rank}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
