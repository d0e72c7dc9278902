"""Launches that start with the session and are waited for by their tests.

A test of a launcher (torchrun, ``distopt train``, a fresh interpreter) spends its wall time on
what one process does alone: importing torch, a rendezvous's last call, the launcher's grace
period for a stopped rank. Meanwhile the pool's ranks leave cores free whenever they wait for
each other's messages (their gloo I/O threads are idle-class and yield the core: see [Note:
gloo's I/O thread]). So the session starts such launches as soon as it has collected its tests,
one after another in the order of their tests, at the lowest CPU priority (nice 19): they run on
the cores the pool leaves, and are done, or nearly, when their tests come. A test then waits for
its own launch and checks its output as before; nothing it checks depends on when it ran.

A test module registers a launch with ``launch_early(tests, build)``: ``build`` gets a fresh
directory (and a rendezvous endpoint if asked for) and returns the commands to start together.
``Launch.result()`` waits for it, and starts it first if the session did not (a test run alone
with ``-k``, say). Launches that mostly wait (``alongside=True``) start at once beside the chain.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from dist_harness import session_tmp

LOWEST_PRIORITY = 19
TIMEOUT = 480  # seconds; a launch still running then is killed and its test fails


@dataclass(frozen=True)
class Command:
    """One process to start: ``python -m MODULE ARGS`` or a script, one thread per process."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def module(cls, module: str, *args: str, env: dict[str, str] | None = None) -> Command:
        return cls([sys.executable, "-m", module, *args], env or {})


@contextlib.contextmanager
def rendezvous_endpoint():
    """HOST:PORT of a c10d rendezvous store this process holds until the block ends.

    The store listens on a port the system picked and that stays bound the whole time, so no
    other process can take it between choosing and using it (as it could a port found free and
    closed again). Launchers join it as clients: ``--rdzv-backend c10d --rdzv-endpoint
    ENDPOINT --rdzv-conf is_host=false``.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield f"127.0.0.1:{store.port}"
    finally:
        del store


Build = Callable[..., list[Command]]


class Launch:
    """Commands started together in a directory of their own; their outputs once all exit."""

    def __init__(self, module: str, tests: tuple[str, ...], build: Build, rendezvous: bool,
                 alongside: bool) -> None:
        self.module, self.tests, self.alongside = module, tests, alongside
        self._build, self._rendezvous = build, rendezvous
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._procs: list[subprocess.Popen] = []
        self._error: BaseException | None = None
        self.workdir: Path | None = None  # made when it starts

    def start(self) -> None:
        """Start the commands on a thread of their own (once; later calls, and calls after
        the session ended, do nothing)."""
        with self._lock:
            if self._thread is None and not _closed.is_set():
                self.workdir = Path(tempfile.mkdtemp(prefix="distopt-launch-", dir=session_tmp()))
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"launch {self.tests[0]}")
                self._thread.start()

    def wait(self) -> None:
        self.start()
        if self._thread is not None:
            self._thread.join()

    def result(self) -> list[subprocess.CompletedProcess]:
        """Each command's return code and output, in the order ``build`` gave them."""
        self.wait()
        if self.workdir is None:
            raise RuntimeError(f"the launch for {self.tests[0]} did not start: the session ended")
        if self._error is not None:
            raise RuntimeError(f"the launch for {self.tests[0]} failed to run") from self._error
        return [subprocess.CompletedProcess(
                    proc.args, proc.returncode, (self.workdir / f"stdout{i}.txt").read_text(),
                    (self.workdir / f"stderr{i}.txt").read_text())
                for i, proc in enumerate(self._procs)]

    def _run(self) -> None:
        try:
            with contextlib.ExitStack() as stack:
                assert self.workdir is not None
                args: list = [self.workdir]
                if self._rendezvous:
                    args.append(stack.enter_context(rendezvous_endpoint()))
                for i, command in enumerate(self._build(*args)):
                    with self._lock:
                        if _closed.is_set():
                            return
                        self._procs.append(self._popen(i, command))
                for proc in self._procs:
                    try:
                        proc.wait(timeout=TIMEOUT)
                    except subprocess.TimeoutExpired:
                        self.stop()
        except BaseException as error:  # noqa: BLE001  (reported by result())
            self._error = error
            self.stop()

    def _popen(self, i: int, command: Command) -> subprocess.Popen:
        assert self.workdir is not None
        # TMPDIR: what the launch leaves in the temporary directory (the launcher's log and
        # error files) goes with its directory.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.workdir), **command.env}
        with (self.workdir / f"stdout{i}.txt").open("w") as out, \
                (self.workdir / f"stderr{i}.txt").open("w") as err:
            # Its own session, so that stop() reaches the launcher's ranks too.
            proc = subprocess.Popen(command.argv, stdout=out, stderr=err, env=env,
                                    start_new_session=True)
        # Children inherit it: the launcher sets it before it has started any.
        os.setpriority(os.PRIO_PROCESS, proc.pid, LOWEST_PRIORITY)
        return proc

    def stop(self) -> None:
        """Kill every process of the launch still running."""
        with self._lock:  # none starts after this
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


_REGISTERED: list[Launch] = []
_closed = threading.Event()  # set when the session ends: no launch starts after it


def launch_early(tests: str | tuple[str, ...], build: Build, *, rendezvous: bool = False,
                 alongside: bool = False) -> Launch:
    """Register a launch for ``tests`` (names of the calling module's test functions): the
    session starts it if any of them is selected. ``build(workdir[, endpoint])`` returns the
    commands; ``rendezvous`` gives it the endpoint of a c10d store held while they run."""
    names = (tests,) if isinstance(tests, str) else tests
    launch = Launch(build.__module__, names, build, rendezvous, alongside)
    _REGISTERED.append(launch)
    return launch


def _first_item(launch: Launch, items: list) -> int | None:
    for index, item in enumerate(items):
        if item.module.__name__ == launch.module and item.originalname in launch.tests:
            return index
    return None


def start_for(items: Iterable) -> None:
    """Start the launches of the selected ``items``: those that mostly wait at once, the others
    one after another in the order of their first test."""
    items = list(items)
    chosen = [(index, launch) for launch in _REGISTERED
              if (index := _first_item(launch, items)) is not None]
    for _, launch in chosen:
        if launch.alongside:
            launch.start()
    chain = [launch for _, launch in sorted(chosen, key=lambda pair: pair[0])
             if not launch.alongside]

    def run_chain() -> None:
        for launch in chain:
            launch.wait()

    threading.Thread(target=run_chain, daemon=True, name="early launches").start()


def stop_all() -> None:
    """Kill what still runs and remove every launch's directory."""
    _closed.set()
    for launch in _REGISTERED:
        launch.stop()
        if launch.workdir is not None:
            shutil.rmtree(launch.workdir, ignore_errors=True)
