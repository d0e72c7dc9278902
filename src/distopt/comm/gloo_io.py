"""Keep gloo's I/O threads from taking the cores of a CPU run's compute.

[Note: gloo's I/O thread]
gloo's TCP transport reads every socket of a device on one thread ("gloo_tcp_loop"), whose
epoll loop polls again at once while a message waits for its receiver to post a buffer: a rank
that sent early spins until its peer, still computing, reaches the matching receive. On a CPU
run with as many ranks as cores that spin takes the very core whose compute would end it. On
the 2-core machine a 4 KB all-reduce took 0.87 ms at 2 ranks and 6.7 ms at 4 with the threads
as gloo starts them, and 0.53 and 2.1 ms with them in Linux's idle scheduling class
(``SCHED_IDLE``), medians of the slowest rank from ``distopt bench --collectives --nproc 2 4
--numel 1000 --steps 500``: the threads still run whenever a core has nothing else to do,
which is whenever a rank waits for their message, but no longer preempt a rank that computes.
Each process group starts a gloo device and thread of its own, so a caller moves them once its
groups exist. On CUDA the step's collectives run on NCCL and this does not apply.
"""

from __future__ import annotations

import contextlib
import os
import sys

_IO_THREAD_NAME = "gloo_tcp_loop"


def gloo_io_threads() -> list[int]:
    """The thread ids of this process's gloo I/O threads (none outside Linux, where ``/proc``
    names no threads)."""
    if not sys.platform.startswith("linux"):
        return []
    tids = []
    for tid in os.listdir("/proc/self/task"):
        # A thread may end between the listing and the read.
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as comm:
            if comm.read().strip() == _IO_THREAD_NAME:
                tids.append(int(tid))
    return tids


def idle_gloo_io_threads() -> int:
    """Put this process's gloo I/O threads in the idle scheduling class; return how many.

    Threads that already are count again (the call is idempotent). Outside Linux, where
    neither ``/proc`` thread names nor ``SCHED_IDLE`` exist, it does nothing and returns 0.
    """
    tids = gloo_io_threads()
    for tid in tids:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    return len(tids)
