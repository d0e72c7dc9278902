"""``distopt bench``: distopt against torch DDP, ZeroRedundancyOptimizer and FSDP2, side by side.

With the ``peers`` extra, ``--systems`` also takes Megatron-Core's DistributedOptimizer and
DeepSpeed ZeRO-1/2 (``systems.PEER_SYSTEMS``, built in ``peers.py``).

One invocation runs every configuration (``systems.SYSTEMS``) on each model and data-parallel
size asked for, each in its own freshly spawned process group, and reports per configuration:
median step time and tokens/s over the warm steps, the ratio to DDP and to the fastest peer,
the bytes per parameter a rank holds (measured, and the theory), peak RSS, the collectives
issued per step with their payloads (counted) and a per-phase breakdown. It prints a table and
writes ``bench.json`` and ``bench.png`` into ``--out``.

``distopt bench --pp 2 --nproc 4`` runs the gpt model in pipeline stages instead, each sharded
over its row of a (pp, dp) mesh, distopt's stages beside FSDP2's under the same torch schedule
(``stages.py``, reported by ``stage_report.py``).

``distopt bench --host-overhead`` runs the host-overhead microbenchmark instead
(see ``host_overhead.py``), and ``distopt bench --collectives`` times distopt's collectives
against the backend's own (see ``comm/collectives.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch

from .models import MODELS, build_model
from .muon import MUON_SYSTEMS
from .peers import INSTALL_HINT
from .runner import RunConfig, merge_rounds, run_config
from .stages import SCHEDULES, STAGE_DEFAULT_SYSTEMS
from .systems import (
    PEER_SYSTEMS,
    SHARDED_PARAMS,
    SPLIT_OVERLAP,
    STAGE_SYSTEMS,
    SYSTEMS,
    system_bytes_per_param,
)

__all__ = ["RunConfig", "main", "run_config"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distopt bench",
        description="Benchmark distopt against DDP, ZeroRedundancyOptimizer and FSDP2.",
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4],
                   help="data-parallel sizes to run (default: 2 4)")
    p.add_argument("--model", nargs="+", choices=MODELS, default=None,
                   help="models to run (default: gpt mlp; with --pp: gpt)")
    p.add_argument("--systems", nargs="+",
                   choices=SYSTEMS + SPLIT_OVERLAP + SHARDED_PARAMS + MUON_SYSTEMS
                   + PEER_SYSTEMS,
                   default=None,
                   help="configurations to run (default: all but the split-overlap, the "
                        "Muon and the other projects' ones: Megatron-Core and DeepSpeed, "
                        "which need the peers extra; with --pp: "
                        f"{' '.join(STAGE_DEFAULT_SYSTEMS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of every configuration, interleaved (default 3)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per rank (default 1); with --pp, per pipeline, split into "
                        "the micro-batches (default: --microbatches)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / nproc, at least 1)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="elements per bucket of distopt, Megatron-Core (with overlap) and "
                        "DeepSpeed (default: each one's own choice)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: run the gpt model split into this many stages, "
                        "each sharded over --nproc / --pp ranks (default 1: no stages)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step of the --pp schedule (default 4)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="torch schedule of the --pp stages (default 1f1b)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json, bench.png")
    p.add_argument("--host-overhead", action="store_true",
                   help="run the step()+zero_grad() host-overhead microbenchmark instead")
    p.add_argument("--collectives", action="store_true",
                   help="time distopt's reduce-scatter and all-gather against the backend's "
                        "own collectives on one tensor instead (--steps calls each)")
    p.add_argument("--numel", type=int, default=3_260_000,
                   help="elements of the --collectives tensor (default: the gpt model's)")
    return p


def muon_state_bytes(model: str, seq_len: int) -> float:
    """The Muon recipe's mean optimizer state per param on benchmark model ``model``."""
    from .muon import muon_state_bytes as of_module

    with torch.device("meta"):  # shapes only
        return of_module(build_model(model, seq_len).module)


def _check(args: argparse.Namespace) -> None:
    """Refuse bad options before anything is spawned."""
    for name in (
        "nproc", "steps", "repeat", "batch_size", "seq_len", "threads", "bucket_size", "numel",
        "pp", "microbatches",
    ):
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v < 1 for v in values):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be at least 1, got {value}; pass a positive number")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.pp > 1:
        _check_pipeline(args)
    elif args.microbatches is not None or args.schedule is not None:
        raise ValueError("--microbatches and --schedule set the pipeline of --pp: pass "
                         "--pp 2 (or more) with them, or drop them")
    args.model = args.model or (["gpt"] if args.pp > 1 else ["gpt", "mlp"])
    args.systems = args.systems or list(STAGE_DEFAULT_SYSTEMS if args.pp > 1 else SYSTEMS)
    args.batch_size = args.batch_size or (args.microbatches if args.pp > 1 else 1)


def _check_pipeline(args: argparse.Namespace) -> None:
    """Refuse a ``--pp`` run that cannot be laid out, naming the fix; fill in its defaults."""
    pp = args.pp
    if args.host_overhead or args.collectives:
        raise ValueError("--pp runs the training benchmark in stages: drop --host-overhead "
                         "and --collectives, or drop --pp")
    bad = [n for n in args.nproc if n % pp]
    if bad:
        raise ValueError(f"--pp {pp} does not divide --nproc {' '.join(map(str, bad))}: each "
                         f"stage needs the same number of ranks; pass --nproc multiples of "
                         f"{pp} (e.g. --nproc {2 * pp} for (pp, dp) = ({pp}, 2))")
    no_stages = [s for s in args.systems or [] if s not in STAGE_SYSTEMS]
    if no_stages:
        raise ValueError(f"--pp: no pipeline-stage mode in {', '.join(no_stages)}; pass "
                         f"--systems from {', '.join(STAGE_SYSTEMS)} (default: "
                         f"{' '.join(STAGE_DEFAULT_SYSTEMS)})")
    for model in args.model or ["gpt"]:
        if model.startswith("mlp"):
            raise ValueError(f"--pp: the {model} model has no pipeline stages; pass --model gpt "
                             "(or gpt-tiny)")
        with torch.device("meta"):  # shapes only
            layers = build_model(model, args.seq_len).module.config.n_layer
        if layers % pp:
            raise ValueError(f"--pp {pp} does not divide the {layers} blocks of --model "
                             f"{model}: pass a --pp that divides {layers}")
    args.microbatches = args.microbatches or 4
    args.schedule = args.schedule or "1f1b"
    batch = args.batch_size or args.microbatches
    if batch % args.microbatches:
        raise ValueError(f"--batch-size {batch} does not split into --microbatches "
                         f"{args.microbatches}: pass a --batch-size that is a multiple of it")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check(args)
    if args.host_overhead:
        from .host_overhead import main as host_main

        return host_main(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("distopt bench: --device cuda needs a CUDA build of torch and a GPU",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and max(args.nproc) > torch.cuda.device_count():
        print(f"distopt bench: --nproc {max(args.nproc)} needs as many GPUs, "
              f"found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    peers = [s for s in args.systems if s in PEER_SYSTEMS]
    if peers and not args.host_overhead and not args.collectives:
        from .peers import missing_peers

        absent = missing_peers(peers)
        if absent:
            print(f"distopt bench: {', '.join(peers)} need {' and '.join(absent)} (not "
                  f"installed): {INSTALL_HINT}", file=sys.stderr)
            return 2
    if args.collectives:
        from .collective_timings import main as collectives_main

        return collectives_main(args)
    cores = os.cpu_count() or 1
    results: list[dict[str, Any]] = []
    started = time.time()
    for model in args.model:
        for nproc in args.nproc:
            threads = args.threads or max(1, cores // nproc)
            rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
            for round_index in range(args.repeat):
                # Rotate the order every round, so that a slow spell of the machine does not
                # always fall on the same configuration.
                shift = round_index % len(args.systems)
                for system in args.systems[shift:] + args.systems[:shift]:
                    config = RunConfig(
                        system=system, model=model, nproc=nproc, steps=args.steps,
                        warmup=args.warmup, batch_size=args.batch_size, seq_len=args.seq_len,
                        device=args.device, threads=threads, bucket_size=args.bucket_size,
                        pp=args.pp, microbatches=args.microbatches or 1,
                        schedule=args.schedule or "1f1b",
                    )
                    layout = f"pp={args.pp} d={nproc // args.pp}" if args.pp > 1 else f"d={nproc}"
                    print(f"round {round_index + 1}/{args.repeat}: {model} {layout} {system}",
                          file=sys.stderr, flush=True)
                    rounds[system].append(run_config(config))
            for system in args.systems:
                result = merge_rounds(rounds[system])
                state = muon_state_bytes(model, args.seq_len) if system in MUON_SYSTEMS else 8
                # With stages, per param of a stage, sharded over the stage's DP ranks.
                result["theory_bytes_per_param"] = system_bytes_per_param(
                    system, nproc // args.pp, optimizer_state_bytes=state)
                results.append(result)

    from . import report

    report.add_ratios(results)
    print(report.format_table(results))
    print(report.format_phases(results))
    print(report.format_muon(results))
    meta = {
        "argv": ["distopt", "bench", *(argv if argv is not None else sys.argv[1:])],
        "torch": torch.__version__,
        "cpu_count": cores,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cuda_device": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "wall_s": time.time() - started,
    }
    os.makedirs(args.out, exist_ok=True)
    report.write_json(results, meta, os.path.join(args.out, "bench.json"))
    report.plot(results, os.path.join(args.out, "bench.png"))
    print(f"\nwrote {args.out}/bench.json and {args.out}/bench.png")
    return 1 if any("error" in r for r in results) else 0
