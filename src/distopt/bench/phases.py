"""The clock of one benchmark step's phases: compute and host time apart from collective waits.

distopt times its own collectives' waits (``CommStats``); a phase's time is its wall time less
the waits that happened inside it, so that the phases and the three waits add up to the step.
Peers report no waits: their collectives fall inside the phase that issued them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..ddp import agreements

Mark = tuple[float, float]  # (time, seconds waited in distopt's collectives so far)


class PhaseClock:
    """Marks taken between a step's phases, and the row of phase times they make."""

    def __init__(self, stats: Any | None, sync: Callable[[], None]) -> None:
        self.stats = stats  # distopt's CommStats, or None for a peer
        self.sync = sync

    def waits(self) -> dict[str, float]:
        """Seconds spent so far blocked in distopt's reductions, gathers and agreements (the
        collectives that carry no grad or param bytes: ddp/agreements.py); 0 for peers."""
        if self.stats is None:
            return {"reduce": 0.0, "gather": 0.0, "agree": 0.0}
        seconds = self.stats.seconds
        return {"reduce": seconds["reduce_scatter"] + seconds["all_reduce"],
                "gather": seconds["all_gather"],
                "agree": sum(seconds[op] for op in agreements.OPS)}

    def mark(self) -> Mark:
        self.sync()
        return time.perf_counter(), sum(self.waits().values())

    @staticmethod
    def compute(a: Mark, b: Mark) -> float:
        """The time from mark ``a`` to ``b`` less the collective waits in it."""
        return (b[0] - a[0]) - (b[1] - a[1])

    def row(self, first: Mark, last: Mark, before: dict[str, float],
            **phases: float) -> dict[str, float]:
        """A step's row from its first to its last mark: the total, the compute phases in
        the order given, and the waits since ``before``: reductions before "step", gathers
        after it."""
        waits = self.waits()
        row = {"total": last[0] - first[0]}
        for name, seconds in phases.items():
            if name == "step":
                row["wait_reduce"] = waits["reduce"] - before["reduce"]
            row[name] = seconds
        row["wait_gather"] = waits["gather"] - before["gather"]
        row["wait_agree"] = waits["agree"] - before["agree"]
        return row
