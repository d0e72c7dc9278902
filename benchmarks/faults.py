"""What failures cost with torchft's replica groups against torchrun restarts: the same training
three ways in one launch, on the same data and the same failure schedule.

    python benchmarks/faults.py --groups 2 --nproc 2 --steps 60 --kills 3 --seed 1 \
        --save-every 10 -- --model tiny --batch-size 8 --seq-len 32 --max-bytes 300000

1. ``clean``: ``distopt train --ft-groups G --nproc N --ft-min-groups G``, no failure (every
   step with every group: without ``--ft-min-groups`` the group that starts first may take a
   step or two alone before the others join);
2. ``ft``: the same with ``DISTOPT_TRAIN_FAIL_SCHEDULE=SEED:COUNT``: a killed group restarts
   alone and heals from the others, which go on stepping without it meanwhile;
3. ``ft-wait``: the same with ``--ft-min-groups G``: the others wait for it, so every committed
   step averages every group's batches, as in the clean run (the same held-out loss);
4. ``restart``: ``distopt train --nproc G*N --max-restarts COUNT`` (torchrun's road, no torchft)
   with the same kills, each named by its rank among the G*N (a ``heal`` kill, which this road
   has no heal for, dies in the forward instead): every rank restarts and resumes from the
   last save;
5. ``plain``: the same without failures: what ``restart`` costs beyond it is the failures',
   what ``clean`` costs beyond it is torchft's (a quorum every step).

The global batch is split over the same G*N ranks in each; the held-out loss is each run's
last. Printed for each: the wall time, the steps tried and not committed (``ft``: a step that
a failure interrupted, tried again in the next quorum), the committed steps lost (redone after
a restart from the last save), and the held-out loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distopt.train.faults import FAIL_SCHEDULE_ENV, draw_schedule


def _run(args: list[str], out: Path, env: dict[str, str]) -> float:
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "distopt", "train", *args, "--out", str(out),
                           "--no-progress"], env={**os.environ, **env}, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{out.name} failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - began


def _steps_redone(metrics: Path) -> int:
    """Committed steps logged more than once: lost to a restart and trained again."""
    steps = [e["step"] for e in map(json.loads, metrics.read_text().splitlines())
             if "loss" in e]
    return len(steps) - len(set(steps))


def _commits_redone(ft_log: Path) -> int:
    """Steps a replica group committed more than once (a heal never goes back: 0)."""
    steps = [e["step"] for e in map(json.loads, ft_log.read_text().splitlines())
             if e["event"] == "committed"]
    return len(steps) - len(set(steps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--out", default=None, help="folder of the three runs (default: a temp one)")
    p.add_argument("train_args", nargs="*", help="after --: more distopt train options")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="distopt-faults-"))
    common = ["--steps", str(a.steps), "--save-every", str(a.save_every),
              "--timeout", str(a.timeout), "--eval-every", "0", *a.train_args]
    ft = ["--ft-groups", str(a.groups), "--nproc", str(a.nproc), "--max-restarts",
          str(a.kills), *common]
    plain = ["--nproc", str(a.groups * a.nproc), "--max-restarts", str(a.kills), *common]
    kills = draw_schedule(a.seed, a.kills, groups=a.groups, nproc=a.nproc, steps=a.steps)
    flat = ",".join(f"0/{k.group * a.nproc + k.rank}/{k.step}/"
                    f"{'forward' if k.phase == 'heal' else k.phase}" for k in kills)
    print("schedule:", ", ".join(f"group {k.group} rank {k.rank} step {k.step} {k.phase}"
                                 for k in kills))
    rows = []
    schedule = {FAIL_SCHEDULE_ENV: f"{a.seed}:{a.kills}"}
    for name, args, env in (
        ("clean", [*ft, "--ft-min-groups", str(a.groups)], {}),
        ("ft", ft, schedule),
        ("ft-wait", [*ft, "--ft-min-groups", str(a.groups)], schedule),
        ("restart", plain, {FAIL_SCHEDULE_ENV: flat}),
        ("plain", plain, {}),
    ):
        seconds = _run(args, out / name, env)
        summary = json.loads((out / name / "summary.json").read_text())
        if name in ("restart", "plain"):
            tried, lost = 0, _steps_redone(out / name / "metrics.jsonl")
            log = out / name / "ft.jsonl"
            fired = sum(1 for line in (log.read_text().splitlines() if log.exists() else ())
                        if '"killed"' in line)
        else:
            groups = summary["ft"]["groups"]
            tried = sum(len(g["uncommitted_steps"]) for g in groups)
            lost = sum(_commits_redone(out / name / "groups" / f"g{g['group']}" / "ft.jsonl")
                       for g in groups)
            fired = sum(len(g["kills"]) for g in groups)
        rows.append((name, seconds, fired, tried, lost, summary["heldout_loss_end"]))
    print(f"\n{'run':8} {'wall s':>8} {'kills':>6} {'retried':>8} {'lost':>5} {'held-out':>10}")
    for name, seconds, fired, tried, lost, loss in rows:
        print(f"{name:8} {seconds:8.1f} {fired:6d} {tried:8d} {lost:5d} {loss:10.5f}")
    print(f"\noutputs: {out}")


if __name__ == "__main__":
    main()
