"""``pytest --cpu-report`` (tests/cpu_report.py): the machine's busy and idle core-seconds over
the session, and the CPU the pools' workers used, read from /proc."""

from __future__ import annotations

import os
import re
import time

import cpu_report
import dist_harness


def test_a_process_cpu_is_read_and_a_gone_one_counts_nothing():
    start = time.process_time()
    while time.process_time() - start < 0.05:  # burn some CPU to be counted
        pass
    assert dist_harness.cpu_seconds(os.getpid()) >= 0.05
    assert dist_harness.cpu_seconds(2**22 + 1) == 0.0  # above the kernel's largest pid


def test_the_report_gives_the_cores_and_the_pools(monkeypatch):
    monkeypatch.setattr(dist_harness, "CPU_SECONDS", dist_harness.collections.Counter({4: 3.0}))
    monkeypatch.setattr(cpu_report, "_start", None)  # the session's own start comes back after
    cpu_report.start()
    time.sleep(0.05)
    machine, pools = cpu_report.lines()
    assert re.fullmatch(r"\d+ s wall, cores busy \d+ core-s and idle \d+ core-s \(\d+% busy\)",
                        machine), machine
    assert pools == "the pools' workers: 3 core-s; d = 4: 3"


def test_without_proc_stat_it_says_so(monkeypatch):
    monkeypatch.setattr(cpu_report, "_machine", lambda: None)
    monkeypatch.setattr(cpu_report, "_start", None)
    cpu_report.start()
    assert cpu_report.lines() == ["no /proc/stat on this machine: no CPU report"]
