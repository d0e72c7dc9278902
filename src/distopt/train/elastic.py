"""What ``distopt train`` needs of the elastic launcher: a store per attempt, whether this start
is a restart, and the test hooks that fail a rank or a node.

[Note: elastic restarts]
torchrun (and ``distopt train``'s own launcher, the same engine) starts the ranks again in two
cases: after a failure, counted in ``TORCHELASTIC_RESTART_COUNT`` and bounded by
``--max-restarts``, and, under ``--nnodes MIN:MAX``, when a node joins, which it does not count.
Both restarts may change the world size: a lost node leaves fewer ranks, a node that comes back
adds them. Every start builds the model, the optimizer and the data-parallel layout for the
world it is given and, being a restart, loads the latest checkpoint, which reshards to any DP
size; the global batch is the same at any world size that divides it ([Note: global batches]
in data.py), so a lost node costs the steps since the last save.

A restart is told from a first start by the launcher's run id: the first start of a run writes
it into the output folder, and a start that finds its own run id there is a restart (rank 0
decides, the others follow, so that every rank loads or none). torchrun's run id when
``--rdzv-id`` is not given, ``none``, names no run, so it tells nothing: an elastic run that
should resume when a node joins needs its own ``--rdzv-id``. The gloo rendezvous of each
start goes under a prefix of its own in the launcher's store, which outlives the starts:
``(restart count, world size)`` differs from one start to the next, as a node that joins
grows the world and one that is lost fails the ranks (a counted restart).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

RUN_ID_FILE = "run_id"
UNNAMED_RUN_ID = "none"  # torchrun's --rdzv-id when none is given

# Test hook for the fault-tolerance tests: the rank named here sends itself a signal at this
# step of the first attempt: SIGKILL (by default), exactly like a crashed or preempted process,
# or SIGSTOP, like a hung one.
FAIL_AT_STEP_ENV = "DISTOPT_TRAIN_FAIL_AT_STEP"
FAIL_RANK_ENV = "DISTOPT_TRAIN_FAIL_RANK"
FAIL_SIGNAL_ENV = "DISTOPT_TRAIN_FAIL_SIGNAL"
# "launcher": the rank (numbered within its launcher) takes its launcher and the launcher's
# other ranks down with it, as when a node is lost.
FAIL_SCOPE_ENV = "DISTOPT_TRAIN_FAIL_SCOPE"
# With --ft-groups: the replica group whose rank fails (ranks numbered within their group);
# unset, the rank of every group fails.
FAIL_GROUP_ENV = "DISTOPT_TRAIN_FAIL_GROUP"
GROUP_ENV = "DISTOPT_FT_GROUP"  # set by train/ft.py's launcher on each group's ranks


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_restart(out: Path, rank: int) -> bool:
    """Whether this start is a restart of a run that started before; collective. See
    [Note: elastic restarts]."""
    decision = None
    if rank == 0:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id == UNNAMED_RUN_ID:
            run_id = None
        marker = out / RUN_ID_FILE
        seen = None
        with suppress(OSError):
            seen = marker.read_text().strip()
        decision = restart_count() > 0 or (run_id is not None and seen == run_id)
        if run_id is not None and seen != run_id:
            out.mkdir(parents=True, exist_ok=True)
            marker.write_text(run_id + "\n")
    box = [decision]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def attempt_store(rank: int, world: int) -> dist.Store:
    """The launcher's TCPStore, under a prefix of its own for each start of the ranks.

    After a restart the launcher may hand the ranks the store of the failed attempt, where
    gloo would find the dead ranks' addresses and fail to connect; a prefix per start keeps
    each start's keys apart (see [Note: elastic restarts]).
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
        is_master=not agent_hosts and rank == 0, wait_for_workers=False,
    )
    return dist.PrefixStore(f"distopt/attempt_{restart_count()}_{world}", store)


def failure_injection(rank: int) -> tuple[int, Callable[[], None]]:
    """(the step of the first attempt at which this rank fails, or -1; how it fails)."""
    kind = getattr(signal, os.environ.get(FAIL_SIGNAL_ENV, "SIGKILL"))
    launcher = os.environ.get(FAIL_SCOPE_ENV) == "launcher"
    if launcher:  # the launcher's own rank numbers: the test sets the hook on one launcher
        rank = int(os.environ.get("LOCAL_RANK", "0"))
    if restart_count() > 0 or rank != int(os.environ.get(FAIL_RANK_ENV, "0")):
        return -1, lambda: None
    if os.environ.get(FAIL_GROUP_ENV, os.environ.get(GROUP_ENV)) != os.environ.get(GROUP_ENV):
        return -1, lambda: None
    step = int(os.environ.get(FAIL_AT_STEP_ENV, "-1"))
    if launcher:
        return step, lambda: _kill_launcher(kind)
    return step, lambda: os.kill(os.getpid(), kind)


def _kill_launcher(kind: signal.Signals) -> None:
    """The loss of a node: this rank's launcher (torchrun's agent, the parent) and every rank
    it started, this one last."""
    agent = os.getppid()
    ranks = [int(pid) for pid in Path(f"/proc/{agent}/task/{agent}/children").read_text().split()]
    os.kill(agent, kind)  # first, so that it restarts nothing
    for pid in ranks:
        if pid != os.getpid():
            with suppress(ProcessLookupError):
                os.kill(pid, kind)
    os.kill(os.getpid(), kind)
