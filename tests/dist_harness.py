"""Run test cases inside gloo process groups started once per world size for the whole session.

Starting processes, importing torch and building a process group cost seconds, so the first
``run_cases(d, ...)`` of a session starts a pool of d worker processes joined in one gloo group
and every later call with the same d reuses it: the suite starts one group per world size, not
one per test module. The workers are forked from a server process that imported torch once
(``context()``), so that a pool, or a fresh one after a failure, starts in a fraction of a
second. Test modules build lists of cases (a name, a module-level function, its arguments), run
them with ``run_cases`` in a module-scoped fixture, and assert on the values each rank returned.

Cases run one at a time, in lockstep on every rank. A case that fails on any rank, a worker
that dies and a case that runs past ``CASE_TIMEOUT`` each end the pool: its workers are killed
and the next case starts a fresh one, so that a failure cannot leave a collective half done for
the cases after it, and a hang fails its case instead of the suite. The rendezvous is a
FileStore in a fresh temporary directory (no ports to pick or collide on), and the group has a
timeout so that a collective waiting on a dead peer raises. tests/conftest.py ends the pools
when the session ends.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distopt._forkserver import forkserver_preloading
from distopt.comm.gloo_io import idle_gloo_io_threads

Case = tuple[str, Callable[..., Any], tuple]
TIMEOUT = datetime.timedelta(seconds=120)
# The longest a case may run on a loaded machine before it counts as hung.
CASE_TIMEOUT = float(os.environ.get("DISTOPT_TEST_CASE_TIMEOUT", "600"))
# Once a rank reported a failure, how long the others get to finish before the pool is ended
# (they may wait in a collective that the failed rank never joins).
FAILURE_GRACE = 5.0
# How often the session checks, while it waits for a case, whether a worker died or the case's
# time is up: a dead worker or a spent grace is seen within this.
POLL = 0.2


class CaseFailed(AssertionError):
    pass


def yield_gloo_io_to_compute() -> None:
    """Idle-class the gloo I/O threads of the world group now and of every group made later (a
    case's meshes and subgroups each start a gloo device of their own). On the 2-core machine
    the sharded-grads grid at d = 2 and 3 took 51 s with them as gloo starts them and 37 s
    idle-class (``pytest tests/test_shard_grads.py -k "d2 or d3"``; [Note: gloo's I/O thread])."""
    idle_gloo_io_threads()
    c10d = dist.distributed_c10d
    make_group = c10d._new_process_group_helper

    def make_group_then_idle_its_io(*args: Any, **kwargs: Any) -> Any:
        made = make_group(*args, **kwargs)
        idle_gloo_io_threads()
        return made

    c10d._new_process_group_helper = make_group_then_idle_its_io


def _serve(rank: int, world_size: int, store_path: str, jobs: Any, results: Any) -> None:
    """A worker: join the group, then run the cases sent on ``jobs`` until told to stop or
    until the session's process is gone (the fork server it came from ends with the session,
    and the worker is then handed to another parent)."""
    parent = os.getppid()
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    yield_gloo_io_to_compute()
    results.put((rank, None, pickle.dumps(("ok", "ready"))))
    while os.getppid() == parent:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            continue
        if job is None:
            break
        name = "?"
        try:
            name, fn, args = pickle.loads(job)
            outcome = ("ok", fn(*args))
        except Exception:
            outcome = ("error", traceback.format_exc())
        try:
            payload = pickle.dumps(outcome)
        except Exception:
            payload = pickle.dumps(("error", f"the result could not be pickled:\n"
                                             f"{traceback.format_exc()}"))
        results.put((rank, name, payload))
    # No collective is in flight: leave without tearing the group down, whose gloo threads can
    # abort the process at exit ("terminate called without an active exception").
    os._exit(0)


def context() -> Any:
    """The multiprocessing context of the test processes: forked from one server process that
    imported torch, distopt and pytest once.

    A spawned process starts a fresh interpreter and imports torch (seconds of CPU each); the
    fork server pays for that once per session. The server runs no torch op, so torch's thread
    pools do not exist yet when a worker is forked from it. Workers still import their own test
    modules (which import pytest), on the session's sys.path.
    """
    # The library's preload (torch, torch._dynamo, distopt: see distopt/_forkserver.py) and
    # pytest; the integrations' frameworks take seconds each to import, in every worker that
    # runs their cases (the server skips any that is not installed).
    return mp.get_context(forkserver_preloading("pytest", "transformers.trainer", "lightning",
                                                "torchft"))


# Names the directory that conftest.py makes for the session's temporary files and removes when
# it ends; the test processes inherit it.
SESSION_TMP = "DISTOPT_TEST_SESSION_TMP"


def session_tmp() -> str | None:
    """The session's temporary directory (None outside a pytest session: the system's)."""
    return os.environ.get(SESSION_TMP)


class WorkerPool:
    """``world_size`` processes in one gloo group, running one case at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = context()
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"distopt-pool-d{world_size}-", dir=session_tmp())
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_serve, name=f"distopt-test-rank{rank}-of-{world_size}",
                        args=(rank, world_size, os.path.join(self.tmp, "store"),
                              self.jobs[rank], self.results))
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        ready = self._collect(None, CASE_TIMEOUT)
        if any(status != "ok" for status, _ in ready):
            self.close()
            raise RuntimeError(f"the d={world_size} worker pool did not start: {ready}")

    def run(self, name: str, fn: Callable[..., Any], args: tuple, timeout: float,
            grace: float = FAILURE_GRACE) -> tuple[list[tuple], bool]:
        """Run one case on every rank: each rank's (status, value), and whether the pool is
        still fit for the next case."""
        job = pickle.dumps((name, fn, args))
        for jobs in self.jobs:
            jobs.put(job)
        outcomes = self._collect(name, timeout, grace)
        return outcomes, all(status == "ok" for status, _ in outcomes)

    def _collect(self, name: str | None, timeout: float, grace: float = FAILURE_GRACE
                 ) -> list[tuple]:
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while len(got) < self.world_size:
            try:
                rank, case, payload = self.results.get(timeout=POLL)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                now = time.monotonic()
                grace_over = failed_at is not None and now - failed_at > grace
                if dead or now > deadline or grace_over:
                    why = (f"worker {dead[0].name} died (exit code {dead[0].exitcode})" if dead
                           else "another rank failed first" if grace_over
                           else f"no answer within {timeout:.0f} s (a hang?)")
                    for rank in range(self.world_size):
                        got.setdefault(rank, ("error", f"case {name!r}: {why}"))
                    break
                continue
            if case != name:  # a stray answer of an earlier, abandoned case
                continue
            got[rank] = pickle.loads(payload)
            if got[rank][0] != "ok" and failed_at is None:
                failed_at = time.monotonic()
        return [got[rank] for rank in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        """End the workers: ask each to leave and give them 5 s in all, or with ``kill`` (a
        pool unfit after a failed case, whose workers may wait in a collective that never
        ends) kill them at once."""
        CPU_SECONDS[self.world_size] += sum(cpu_seconds(proc.pid) for proc in self.procs)
        if not kill:
            for proc, jobs in zip(self.procs, self.jobs, strict=True):
                if proc.is_alive():
                    with contextlib.suppress(OSError, ValueError):
                        jobs.put(None)
            deadline = time.monotonic() + 5
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in (self.results, *self.jobs):
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: dict[int, WorkerPool] = {}
# CPU seconds (user + system, every thread) that the workers of each world size used, counted
# as their pools end: where the suite's time goes (conftest.py's --cpu-report).
CPU_SECONDS: collections.Counter = collections.Counter()


def cpu_seconds(pid: int) -> float:
    """The CPU seconds a live process has used, from /proc (0 where it is gone or there is no
    /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _discard(world_size: int, *, kill: bool = False) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close(kill=kill)


def close_pools() -> None:
    """End every worker pool (at the end of the session)."""
    for world_size in list(_POOLS):
        _discard(world_size)


atexit.register(close_pools)


def pools_at_two_and_three(cases: Callable[[], list[Case]]) -> tuple[Any, Any, Any]:
    """The module-scoped fixtures ``two``, ``three`` and ``both`` of a test module whose
    ``cases()`` run in the pools of d = 2 and d = 3: ``both`` is either, the d = 3 one marked
    slow (the inner loop, ``pytest -m "not slow"``, runs d = 2). Assign them to the module's
    names: ``two, three, both = pools_at_two_and_three(_cases)``."""
    import pytest

    @pytest.fixture(scope="module")
    def two() -> dict:
        return run_cases(2, cases())

    @pytest.fixture(scope="module")
    def three() -> dict:
        return run_cases(3, cases())

    @pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                    ids=["d2", "d3"])
    def both(request: Any) -> dict:
        return request.getfixturevalue({2: "two", 3: "three"}[request.param])

    return two, three, both


def run_cases(world_size: int, cases: list[Case], timeout: float = CASE_TIMEOUT, *,
              grace: float = FAILURE_GRACE, end_pool: bool = False) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world_size`` ranks; return each rank's {name: (status, value)}. A
    case that runs longer than ``timeout`` seconds fails on every rank; once one rank failed,
    the others get ``grace`` seconds to report before the pool is ended. ``end_pool``: end the
    pool afterwards, for cases that leave the workers changed for later ones (peers that
    import Megatron-Core or DeepSpeed make every tensor the workers pickle refer to them)."""
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for name, fn, args in cases:
        if world_size not in _POOLS:
            _POOLS[world_size] = WorkerPool(world_size)
        outcomes, fit = _POOLS[world_size].run(name, fn, args, timeout, grace)
        if not fit:
            _discard(world_size, kill=True)
        for rank, outcome in enumerate(outcomes):
            out[rank][name] = outcome
    if end_pool:
        _discard(world_size)
    return out


def case_result(results: list[dict[str, Any]], name: str) -> list[Any]:
    """The value every rank returned for a case; raise with the traceback if any rank failed."""
    values = []
    for rank, per_rank in enumerate(results):
        status, value = per_rank[name]
        if status != "ok":
            raise CaseFailed(f"case {name!r} failed on rank {rank}:\n{value}")
        values.append(value)
    return values
