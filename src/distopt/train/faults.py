"""``DISTOPT_TRAIN_FAIL_SCHEDULE``: many kills in one ``distopt train --ft-groups`` run, at
chosen phases of the step, for tests and for rehearsing a run.

[Note: failure schedules]
``DISTOPT_TRAIN_FAIL_SCHEDULE=SEED:COUNT`` draws COUNT kills from a seeded generator, the same
on every rank of every group: for each, the replica group, the rank within it, the step and
the phase. The steps are spread over the run (one in each of COUNT equal slices of its middle
80%), so that a group is back before the next kill, as on a real cluster where failures are
hours apart. ``DISTOPT_TRAIN_FAIL_SCHEDULE=G/R/S/PHASE,...`` names the kills instead. The
phases:

* ``forward``: after the step's quorum, before the forward (the other groups are then in the
  step's reductions when the Lighthouse notices);
* ``backward``: after the forward, before the backward (its reductions then fail);
* ``step``: after the backward, before ``opt.step()`` (the group's other ranks wait in the
  commit);
* ``heal``: during a heal the rank takes part in, sending its state to a healing group (the
  healing source fails) or loading it (the healing group fails again);
* ``save``: on entering a checkpoint save (the group's other ranks are in the save's
  collectives; the last published checkpoint stays the last one).

A kill fires once, at the first moment of its phase at or after its step; its rank writes it
into the group's ``ft.jsonl`` before dying, so that the group's next start (its launcher
restarts it) knows it fired. A ``heal`` kill waits for a heal that its rank takes part in;
one that never comes is reported as not fired. Without ``--ft-groups`` (a run that torchrun
restarts whole, resuming from its last save) the schedule's ranks are those of one group, 0,
and its kills are written into ``OUT/ft.jsonl``: a fresh output folder starts a fresh
schedule.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAIL_SCHEDULE_ENV = "DISTOPT_TRAIN_FAIL_SCHEDULE"
PHASES = ("forward", "backward", "step", "heal", "save")


@dataclass(frozen=True)
class Kill:
    """One scheduled kill: rank ``rank`` of replica group ``group`` at the first ``phase`` at or
    after step ``step``."""

    group: int
    rank: int
    step: int
    phase: str


def parse_schedule(text: str, *, groups: int, nproc: int, steps: int) -> list[Kill]:
    """The kills of ``DISTOPT_TRAIN_FAIL_SCHEDULE``: ``SEED:COUNT`` or ``G/R/S/PHASE,...``."""
    text = text.strip()
    try:
        if ":" in text and "/" not in text:
            seed, count = (int(v) for v in text.split(":"))
            return draw_schedule(seed, count, groups=groups, nproc=nproc, steps=steps)
        kills = []
        for item in filter(None, text.split(",")):
            group, rank, step, phase = item.split("/")
            kills.append(Kill(int(group), int(rank), int(step), phase))
    except ValueError:
        raise ValueError(f"{FAIL_SCHEDULE_ENV}={text!r}: write SEED:COUNT or "
                         "GROUP/RANK/STEP/PHASE,... (e.g. 1/0/40/heal)") from None
    for kill in kills:
        if kill.phase not in PHASES or not 0 <= kill.group < groups or not 0 <= kill.rank < nproc:
            raise ValueError(
                f"{FAIL_SCHEDULE_ENV}: {kill} names no phase of {PHASES}, group below "
                f"{groups} or rank below {nproc}; write SEED:COUNT or GROUP/RANK/STEP/PHASE,...")
    return kills


def draw_schedule(seed: int, count: int, *, groups: int, nproc: int, steps: int) -> list[Kill]:
    """COUNT kills drawn from ``seed``: one step in each of COUNT slices of the run's middle
    80%; the group, rank and phase at random (see [Note: failure schedules])."""
    rng = random.Random(seed)
    first, span = steps // 10 + 1, max(1, steps * 8 // 10)
    kills = []
    for i in range(count):
        low = first + span * i // count
        high = max(low, first + span * (i + 1) // count - 1)
        kills.append(Kill(rng.randrange(groups), rng.randrange(nproc), rng.randint(low, high),
                          rng.choice(PHASES)))
    return kills


class Faults:
    """This rank's armed kills: those of its group and rank that have not fired yet."""

    def __init__(self, kills: list[Kill], *, group: int, rank: int, log: Path) -> None:
        fired = {(e["kill"]["step"], e["kill"]["phase"], e["kill"]["rank"])
                 for e in read_events(log) if e["event"] == "killed"}
        self.log = log
        self.pending = [k for k in kills if k.group == group and k.rank == rank
                        and (k.step, k.phase, k.rank) not in fired]

    def at(self, phase: str, step: int) -> None:
        """Kill this process (SIGKILL) if a kill of ``phase`` is due at ``step``."""
        for kill in self.pending:
            if kill.phase == phase and step >= kill.step:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with self.log.open("a") as f:
                    f.write(json.dumps({"event": "killed", "step": step, "kill": asdict(kill),
                                        "attempt": int(os.environ.get(
                                            "TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)


def read_events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    events = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
            events.append(json.loads(line))
    return events


def faults_for(group: int, rank: int, *, groups: int, nproc: int, steps: int,
               log: Path) -> Faults | None:
    """This rank's kills under ``DISTOPT_TRAIN_FAIL_SCHEDULE``, or None when it is unset."""
    text = os.environ.get(FAIL_SCHEDULE_ENV)
    if not text:
        return None
    kills = parse_schedule(text, groups=groups, nproc=nproc, steps=steps)
    return Faults(kills, group=group, rank=rank, log=log)
