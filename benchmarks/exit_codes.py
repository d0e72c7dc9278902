"""Exit codes: launch a short ``distopt train`` many times and count how each launch ended.

A launch that trained to the end must exit 0, every time: a rank that aborts at interpreter exit
(gloo's threads torn down by the C++ runtime, "terminate called without an active exception")
turns a finished run into a failed one for the launcher and for any script that checks the code.
Each launch is a fresh ``distopt train --nproc 2`` on the CPU (the tiny GPT, 2 steps, a save and
an evaluation, so the checkpoint and evaluation paths end too); the verdict counts the exit codes
and the launches whose output holds an abort.

    nice python benchmarks/exit_codes.py --runs 50 --json benchmarks/results/exit_codes.json

Options after ``--`` go to ``distopt train``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TRAIN = ["--nproc", "2", "--device", "cpu", "--model", "tiny", "--steps", "2", "--batch-size",
         "8", "--seq-len", "32", "--max-bytes", "300000", "--warmup", "1", "--eval-every", "2",
         "--eval-batches", "1", "--save-every", "2", "--no-progress"]
ABORT = "terminate called"


def launch(extra: list[str], timeout: float) -> dict[str, Any]:
    """One ``distopt train`` launch in a fresh output folder: its exit code and whether any
    process printed an abort."""
    with tempfile.TemporaryDirectory(prefix="distopt-exit-") as out:
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "distopt", "train", *TRAIN, "--out", out, *extra],
                capture_output=True, text=True, timeout=timeout,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code = "timeout"
            output = (exc.stdout or b"").decode(errors="replace") + (
                exc.stderr or b"").decode(errors="replace")
        return {"code": code, "aborted": ABORT in output, "seconds": time.monotonic() - start,
                "tail": output[-2000:] if code != 0 or ABORT in output else ""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--json", default=None, help="write every launch and the verdict here")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    launches = []
    for i in range(args.runs):
        result = launch(extra, args.timeout)
        launches.append(result)
        print(f"launch {i + 1}/{args.runs}: exit {result['code']}"
              f"{' (abort printed)' if result['aborted'] else ''}, {result['seconds']:.1f} s",
              flush=True)
    codes = collections.Counter(str(r["code"]) for r in launches)
    clean = sum(r["code"] == 0 and not r["aborted"] for r in launches)
    verdict = {"runs": args.runs, "exit_codes": dict(codes), "clean": clean,
               "aborts": sum(r["aborted"] for r in launches)}
    print(f"{clean} of {args.runs} launches exited 0 without an abort; exit codes {dict(codes)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": TRAIN + extra, "verdict": verdict, "launches": launches}, indent=1) + "\n")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
