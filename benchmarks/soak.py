"""Soak: a long ``distopt train`` run, each rank's resident memory and handles sampled as it goes.

Runs ``distopt train`` (by default 2,000 steps of the tiny GPT with Muon + AdamW, bf16 params with
``--store-param-remainders``, ``--shard-size 2`` on 4 ranks, a checkpoint every 250 steps) and
every ``--interval`` seconds reads, for each rank process, from /proc: the resident set (VmRSS),
the open file descriptors, the threads and the memory mappings, next to the step rank 0 last
logged. After the warm-up (``--warmup-steps``) a rank that leaks grows; the verdict compares
each rank's last samples of training with its first ones after the warm-up (each the median of
three samples): resident memory within
``--rss-tolerance`` (2%) and no more descriptors, threads or mappings than then. Linux only.

    python benchmarks/soak.py --out runs/soak --json benchmarks/results/soak.json
    python benchmarks/soak.py --analyze benchmarks/results/soak.json   # judge it again

The rank processes are the launcher's spawned children, numbered in the order they started
(the launcher starts local rank 0 first). Options after ``--`` go to ``distopt train``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

TRAIN = ["--model", "tiny", "--optimizer", "muon", "--dtype", "bf16",
         "--store-param-remainders", "--shard-size", "2", "--batch-size", "8", "--seq-len",
         "64", "--max-bytes", "2000000", "--eval-every", "500", "--eval-batches", "2",
         "--save-every", "250", "--keep", "2", "--timeout", "300", "--no-progress"]
EDGE = 3  # samples averaged (median) at each end of the post-warm-up window


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def rank_processes(launcher: int) -> list[int]:
    """The launcher's spawned rank processes (not its resource tracker), oldest first."""
    ranks, todo = [], [launcher]
    while todo:
        for child in _children(todo.pop()):
            todo.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                ranks.append(child)
    return sorted(ranks, key=_start_time)


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def sample(pid: int) -> dict[str, int] | None:
    """RSS (bytes), open descriptors, threads and memory mappings of ``pid``; None if gone."""
    try:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        with open(f"/proc/{pid}/maps", "rb") as maps:
            mappings = sum(1 for _ in maps)
        return {"rss": int(status["VmRSS"].split()[0]) * 1024,
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": int(status["Threads"]),
                "maps": mappings}
    except (OSError, KeyError, ValueError):
        return None


def last_step(metrics: Path) -> int:
    """The step of the last record rank 0 appended to metrics.jsonl (0 before the first)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line cut by the seek, or still being written
    return 0


def verdict(samples: list[dict[str, Any]], ranks: int, warmup_steps: int, steps: int,
            rss_tolerance: float) -> list[dict[str, Any]]:
    """Per rank: its figures at the end of the warm-up and at the end of training (before the
    last step, after which rank 0 writes the summary and the plot)."""
    report = []
    for rank in range(ranks):
        rows = [s["ranks"][rank] for s in samples
                if warmup_steps <= s["step"] < steps and s["ranks"][rank] is not None]
        if len(rows) < 2 * EDGE:
            raise SystemExit(f"rank {rank}: {len(rows)} samples after the warm-up, too few to "
                             "judge; run longer or sample more often (--interval)")
        first = {k: statistics.median(r[k] for r in rows[:EDGE]) for k in rows[0]}
        last = {k: statistics.median(r[k] for r in rows[-EDGE:]) for k in rows[0]}
        rss = [r["rss"] for r in rows]
        growth = last["rss"] / first["rss"] - 1
        report.append({
            "rank": rank, "samples": len(rows),
            "rss_mib_after_warmup": first["rss"] / 2**20, "rss_mib_end": last["rss"] / 2**20,
            "rss_growth": growth,
            "rss_range": (max(rss) - min(rss)) / first["rss"],
            **{f"{k}_after_warmup": first[k] for k in ("fds", "threads", "maps")},
            **{f"{k}_end": last[k] for k in ("fds", "threads", "maps")},
            **{f"{k}_max": max(r[k] for r in rows) for k in ("fds", "threads", "maps")},
            "flat": abs(growth) <= rss_tolerance
            and all(last[k] <= first[k] for k in ("fds", "threads", "maps")),
        })
    return report


def print_verdict(report: list[dict[str, Any]], warmup_steps: int, rss_tolerance: float) -> bool:
    print(f"after step {warmup_steps}, to the last step:")
    print("rank  RSS MiB warm -> end   growth   range    fds warm/end/max   threads    maps")
    for r in report:
        print(f"{r['rank']:>4}  {r['rss_mib_after_warmup']:8.1f} -> {r['rss_mib_end']:6.1f}"
              f"  {r['rss_growth']:+7.2%}  {r['rss_range']:6.2%}   "
              f"{r['fds_after_warmup']:>4.0f}/{r['fds_end']:.0f}/{r['fds_max']:<4}   "
              f"{r['threads_after_warmup']:.0f}/{r['threads_end']:.0f}   "
              f"{r['maps_after_warmup']:.0f}/{r['maps_end']:.0f}")
    flat = all(r["flat"] for r in report)
    print("flat: " + ("yes" if flat else "NO") + f" (RSS within {rss_tolerance:.0%}, no more "
          "descriptors, threads or mappings at the end than after the warm-up)")
    return flat


def soak(args: argparse.Namespace, extra: list[str]) -> dict[str, Any] | None:
    """Run distopt train and sample its ranks; None if the run failed."""
    out = Path(args.out)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "distopt", "train", *TRAIN, "--nproc", str(args.nproc),
               "--steps", str(args.steps), "--out", str(out), *extra]
    print("$", shlex.join(command[1:]), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    launcher = subprocess.Popen(command, env=env)
    samples: list[dict[str, Any]] = []
    ranks: list[int] = []
    while launcher.poll() is None:
        time.sleep(args.interval)
        if len(ranks) < args.nproc:
            ranks = rank_processes(launcher.pid)
        if len(ranks) == args.nproc:
            step = last_step(metrics)
            samples.append({"t": round(time.time() - started, 2), "step": step,
                            "ranks": [sample(pid) for pid in ranks]})
            if len(samples) % 30 == 0:
                mib = " ".join(f"{r['rss'] / 2**20:.1f}" for r in samples[-1]["ranks"] if r)
                print(f"step {step:5d}  RSS MiB per rank: {mib}", flush=True)
    if launcher.returncode != 0:
        print(f"distopt train failed (exit {launcher.returncode})", file=sys.stderr)
        return None
    return {
        "command": shlex.join(["distopt", *command[3:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "seconds": round(time.time() - started, 1), "steps": args.steps, "nproc": args.nproc,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=300,
                   help="steps before the first sample that counts (past the first checkpoint, "
                   "which imports torch.distributed.checkpoint)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--rss-tolerance", type=float, default=0.02)
    p.add_argument("--out", default="runs/soak", help="distopt train's output folder")
    p.add_argument("--json", default=None, help="write every sample and the verdict here")
    p.add_argument("--analyze", default=None, metavar="JSON",
                   help="judge the samples of an earlier run's --json instead of running")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    if args.analyze:
        result = json.loads(Path(args.analyze).read_text())
        result.setdefault("steps", args.steps)
        result.setdefault("nproc", args.nproc)
    else:
        result = soak(args, extra)
        if result is None:
            return 1
        print(f"\n{args.steps} steps in {result['seconds'] / 60:.1f} min")
    report = verdict(result["samples"], result["nproc"], args.warmup_steps, result["steps"],
                     args.rss_tolerance)
    flat = print_verdict(report, args.warmup_steps, args.rss_tolerance)
    if args.json:
        result.update(warmup_steps=args.warmup_steps, flat=flat, ranks=report)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
