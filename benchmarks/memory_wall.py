"""The memory wall: a GPT whose replicated training state does not fit this machine trains under
``shard_params=True`` at d = 4, beside FSDP2 ``fully_shard`` on the same model.

The model is ``distopt.train.model.GPT`` built on the meta device (no rank ever holds it whole):
distopt materializes it module by module into each rank's param shards
([Note: meta-device models] in src/distopt/ddp/materialize.py); FSDP2 shards it with
``fully_shard`` on every block and the root, then ``to_empty`` and ``reset_parameters`` on the
local shards, as its documentation shows. Both train fp32 params and grads with AdamW for a few
steps on tiny batches, one gloo process per rank with one thread each. Each rank reports its
peak resident set (``ru_maxrss``: the process's high-water mark, the torch import included), its
resident set after importing torch and distopt (what any rank pays before the model), the step
times and the losses. The bytes torch DDP and distopt's ZeRO-1 and ZeRO-2 would need are
computed from their bytes per parameter and compared with this machine's memory, not run: they
would be killed for memory, and so could be the machine's other work.

    nice -n 15 python benchmarks/memory_wall.py --layers 14 --width 2048 --steps 3
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
SYSTEMS = ("distopt-shard-params", "fsdp2")
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _rss_bytes() -> int:
    """This process's resident set now."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def meminfo() -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable, in bytes."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":")
        values[key] = int(value.split()[0]) * 1024
    return {"total": values["MemTotal"], "available": values["MemAvailable"]}


def build_on_meta(args: argparse.Namespace):
    import torch
    from torch import nn

    from distopt.train.model import GPT, GPTConfig

    config = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width)
    with torch.device("meta"):
        model = GPT(config)
    # Meta-device init goes through each module's reset_parameters (both systems call it on
    # their shards): GPT-2's normal(0, 0.02) here rather than torch's defaults, whose
    # unit-variance embedding, tied to the head, starts the loss far above log(vocab).
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.reset_parameters = functools.partial(GPT._init_weights, module)
    return model


def wrap(system: str, model, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(the module to call, its optimizer, the distopt wrapper or None), the model's values
    created on this rank's shards only."""
    import torch

    if system == "distopt-shard-params":
        import distopt

        ddp = distopt.DistributedDataParallel(model, shard_params=True,
                                              bucket_size=args.bucket_size)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW)
        return ddp, opt, ddp
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # one unit per block and one at the root, as FSDP2's docs do
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return model, torch.optim.AdamW(model.parameters(), **ADAMW), None


def run_rank(rank: int, system: str, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import distopt  # noqa: F401  (imported before the baseline, as every rank pays it)

    torch.set_num_threads(1)
    baseline = _rss_bytes()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, f"store-{system}"),
                                                         args.nproc),
                            rank=rank, world_size=args.nproc)
    start = time.perf_counter()
    model = build_on_meta(args)
    num_params = sum(p.numel() for p in model.parameters())
    module, opt, ddp = wrap(system, model, args)
    setup_s = time.perf_counter() - start
    after_setup = _rss_bytes()
    generator = torch.Generator().manual_seed(1000 + rank)
    losses, times = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=generator)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = module(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / args.nproc)
    record = {
        "num_params": num_params, "baseline": baseline, "after_setup": after_setup,
        "after_steps": _rss_bytes(), "peak": _peak_rss_bytes(), "setup_s": setup_s,
        "step_s": times, "loss": losses,
    }
    if ddp is not None:
        import distopt

        record["state"] = distopt.measure_state_bytes(opt).as_dict()
        record["gathered_peak"] = sum(pool.peak_bytes for pool in ddp.param_pools.values())
        record["gathered_peak_buckets"] = max(pool.peak_buffers
                                              for pool in ddp.param_pools.values())
        record["buckets"] = len(ddp.buckets)
    with open(os.path.join(tmp, f"{system}-{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)
    dist.barrier()
    os._exit(0)  # every result written: no group teardown to wait on


def launch(system: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(system, args, tmp), nprocs=args.nproc, join=True)
        out = []
        for rank in range(args.nproc):
            with open(os.path.join(tmp, f"{system}-{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out


def wall_arithmetic(num_params: int, d: int, memory: dict[str, int]) -> list[str]:
    """What each replicated or partly sharded system needs per rank and for d ranks, from its
    bytes per parameter (fp32 params and grads, Adam's two fp32 moments)."""
    import torch

    import distopt

    fp32 = torch.float32
    rows = [
        ("torch DDP + AdamW", distopt.theoretical_bytes_per_param(fp32, fp32, d,
                                                                   distributed=False)),
        ("distopt ZeRO-1 (default)", distopt.theoretical_bytes_per_param(fp32, fp32, d)),
        ("distopt ZeRO-2 (shard_grads)",
         distopt.theoretical_bytes_per_param(fp32, fp32, d, shard_grads=True)),
        ("distopt shard_params / FSDP2",
         distopt.theoretical_bytes_per_param(fp32, fp32, d, shard_params=True)),
    ]
    lines = [f"{'system':30s} {'B/param':>8s} {'GiB/rank':>9s} {f'GiB x{d}':>8s}  fits?"]
    for name, per_param in rows:
        rank_bytes = per_param * num_params
        total = rank_bytes * d
        verdict = ("no: over the machine's memory" if total > memory["total"]
                   else "no: over what is available" if total > memory["available"]
                   else "yes")
        lines.append(f"{name:30s} {per_param:8.2f} {rank_bytes / GiB:9.2f} "
                     f"{total / GiB:8.2f}  {verdict}")
    return lines


def report(system: str, ranks: list[dict[str, Any]]) -> list[str]:
    peaks = [r["peak"] / GiB for r in ranks]
    first = ranks[0]
    lines = [
        f"{system}: peak RSS per rank (GiB) {' '.join(f'{p:.2f}' for p in peaks)}; "
        f"sum {sum(peaks):.2f}",
        f"  after import {first['baseline'] / GiB:.2f}, after setup "
        f"{first['after_setup'] / GiB:.2f}, after the steps {first['after_steps'] / GiB:.2f} "
        f"(rank 0, GiB); setup {first['setup_s']:.1f} s",
        "  step s (slowest rank): "
        + " ".join(f"{max(r['step_s'][i] for r in ranks):.1f}" for i in range(len(first["step_s"])))
        + f"; loss {' '.join(f'{x:.4f}' for x in first['loss'])}",
    ]
    if "state" in first:
        state = first["state"]
        lines.append(
            f"  distopt's state (rank 0): {state['total'] / GiB:.2f} GiB = "
            f"{state['total'] / first['num_params']:.2f} B/param; at most "
            f"{first['gathered_peak_buckets']} gathered buckets at once "
            f"({first['gathered_peak'] / GiB:.2f} GiB) of {first['buckets']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=None, help="distopt's, elements")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)

    memory = meminfo()
    with_torch = build_on_meta(args)
    num_params = sum(p.numel() for p in with_torch.parameters())
    del with_torch
    print(f"GPT: {args.layers} blocks, width {args.width}: {num_params / 1e6:.0f}M params "
          f"(fp32, AdamW); d = {args.nproc}; batch {args.batch_size} x {args.seq_len} tokens "
          f"per rank")
    print(f"machine: {memory['total'] / GiB:.1f} GiB, {memory['available'] / GiB:.1f} GiB "
          f"available at the start; {os.cpu_count()} cores")
    print("\n".join(wall_arithmetic(num_params, args.nproc, memory)))
    for system in args.systems:
        print()
        print("\n".join(report(system, launch(system, args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
