"""What distopt's per-step agreements cost: the same steps with them and without them, side by
side in one launch, and the ratio.

    python benchmarks/agreements.py --nproc 2 --model mlp --steps 24 \
        --systems distopt distopt-shard-params distopt-shard-params-keep

Two promises are kept by small collectives that carry no gradient or param bytes
(``distopt.ddp.agreements``): a read of ``p.grad`` on one rank communicates nothing, so each
backward's grad statistics are agreed over the ranks in advance; and a forward run on one rank
alone under sharded params is refused on every rank instead of hanging, so each forward and
backward starts with a check. For each configuration the benchmark builds three DDPs on the
same ranks from the same seed: two with the agreements (A and A again) and one without (built
inside ``agreements.without()``, a switch private to benchmarks). They train in turn, a block
of ``--block`` consecutive steps each (so that a param gather overlapped with the next forward
keeps its overlap), on the same batches, after a barrier; a step's time is the slowest
rank's, and a block's first step is not counted. It prints each DDP's median step, the median
over blocks of A's step over the step without agreements run next to it, and the same ratio
of A over A again, which two identical DDPs give: the run-to-run noise the first ratio is read
against. The promise is a first ratio of 1.00 within that noise.
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
from distopt.bench.runner import init_rank, slowest_rank, timed_step
from distopt.bench.systems import LABELS, build_system
from distopt.ddp import agreements

VARIANTS = ("with", "again", "without")


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    device = init_rank(rank, args.nproc, "cpu", 1, tmp)
    built = []
    for name in args.systems:
        for variant in VARIANTS:
            torch.manual_seed(0)
            model = build_model(args.model, args.seq_len)
            if variant == "without":
                with agreements.without():
                    system = build_system(name, model.module, device)
            else:
                system = build_system(name, model.module, device)
            built.append(((name, variant), system, model))
    times: dict[tuple[str, str], list[list[float]]] = {key: [] for key, _, _ in built}
    step = 0
    for cycle in range(args.cycles):
        shift = cycle % len(built)
        for key, system, model in built[shift:] + built[:shift]:
            block = [timed_step(system, model,
                                model.batch(step + k, rank, args.batch_size, device))
                     for k in range(args.block)]
            times[key].append(block[1:])
        step += args.block
    slowest = {key: slowest_rank(blocks) for key, blocks in times.items()}
    if rank == 0:
        _report(args, slowest)
    dist.barrier()
    dist.destroy_process_group()


def _report(args: argparse.Namespace, slowest: dict[tuple[str, str], list[list[float]]]) -> None:
    warm = args.warmup_cycles
    print(f"{args.model}, d = {args.nproc}, {args.cycles - warm} cycles of {args.block} steps "
          f"(the first of each block not counted); median ms of the slowest rank")
    print(f"{'configuration':40s} {'with':>8s} {'again':>8s} {'without':>8s} "
          f"{'with/without':>13s} {'noise with/again':>17s}")
    results = {}
    for name in args.systems:
        blocks = {v: slowest[name, v][warm:] for v in VARIANTS}
        median = {v: statistics.median(t for b in blocks[v] for t in b) * 1e3 for v in VARIANTS}
        # Per cycle: the block medians of two variants, which ran seconds apart.
        ratio = statistics.median(statistics.median(a) / statistics.median(b) for a, b in
                                  zip(blocks["with"], blocks["without"], strict=True))
        noise = statistics.median(statistics.median(a) / statistics.median(b) for a, b in
                                  zip(blocks["with"], blocks["again"], strict=True))
        print(f"{LABELS[name]:40s} {median['with']:8.1f} {median[VARIANTS[1]]:8.1f} "
              f"{median['without']:8.1f} {ratio:13.3f} {noise:17.3f}")
        results[name] = {"median_ms": median, "with_over_without": ratio,
                         "with_over_with_again": noise}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="mlp", choices=["mlp", "mlp8", "gpt", "gpt-tiny"])
    parser.add_argument("--systems", nargs="+",
                        default=["distopt", "distopt-shard-params", "distopt-shard-params-keep"])
    parser.add_argument("--cycles", type=int, default=8, help="rounds of blocks (default 8)")
    parser.add_argument("--warmup-cycles", type=int, default=1,
                        help="first rounds not counted (default 1)")
    parser.add_argument("--block", type=int, default=4,
                        help="consecutive steps of one DDP (default 4)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=None, help="a JSON file for the figures")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, tmp), nprocs=args.nproc)


if __name__ == "__main__":
    main()
