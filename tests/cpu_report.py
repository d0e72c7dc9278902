"""``pytest --cpu-report``: where the session's CPU went.

On the 2-core machine the suite is bound by CPU, not by waits: its cores are busy nearly the
whole run, so a test is made faster only by making it do less. The report says how busy the
machine's cores were over the session (from /proc/stat, so it counts every process: pytest, the
fork server, the pools' workers, the early launches and whatever else ran), and how much of
that the pools' workers used, by world size (dist_harness.CPU_SECONDS). Linux only; elsewhere it
says so.
"""

from __future__ import annotations

import os
import time

import dist_harness

_start: tuple[float, float, float] | None = None  # wall, busy and idle core-seconds


def _machine() -> tuple[float, float] | None:
    """Core-seconds the machine's cores have been busy and idle since boot."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, *_ = map(int, f.readline().split()[1:])
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, (idle + iowait) / tick


def start() -> None:
    global _start
    machine = _machine()
    _start = None if machine is None else (time.monotonic(), *machine)


def lines() -> list[str]:
    machine = _machine()
    if _start is None or machine is None:
        return ["no /proc/stat on this machine: no CPU report"]
    wall = time.monotonic() - _start[0]
    busy, idle = machine[0] - _start[1], machine[1] - _start[2]
    pools = dist_harness.CPU_SECONDS
    out = [f"{wall:.0f} s wall, cores busy {busy:.0f} core-s and idle {idle:.0f} core-s "
           f"({busy / max(busy + idle, 1e-9):.0%} busy)",
           f"the pools' workers: {sum(pools.values()):.0f} core-s; "
           + ", ".join(f"d = {d}: {pools[d]:.0f}" for d in sorted(pools))]
    return out
