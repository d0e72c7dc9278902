"""``distopt train --ft-groups G``: G replica groups of ``--nproc`` ranks under torchft.

Each group is one elastic launch of its own (its own ranks, store and restarts), run in a
process of its own beside the others; the groups meet only in a torchft Lighthouse, which
this launcher starts unless ``--ft-lighthouse`` names one. A group's ranks shard the state
among themselves; the groups average their grads through the Manager of each rank, so a group
that fails leaves the quorum and the others go on, and its launcher's restart heals from them
(see [Note: fault-tolerant replicas] in distopt/parallel/managed_replicas.py). Each group
writes its run into ``OUT/groups/gG``; at the end this launcher writes ``OUT/summary.json``:
the first group's summary, every group's held-out loss, and the ``ft`` entry, what each group
went through: ``{"groups": [{"group", "failed_at", "healed_at", "restarts", ...}]}``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

# GROUP_ENV: the replica group of a launch's ranks, set by this launcher
from .elastic import GROUP_ENV, restart_count
from .faults import FAIL_SCHEDULE_ENV, parse_schedule, read_events

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the Lighthouse's address, read by the Manager."""
FT_LOG = "ft.jsonl"
"""In each group's folder, written by its rank 0: its starts, heals and uncommitted steps."""

# How fast the Lighthouse forms a quorum: a group whose heartbeats stop for HEARTBEAT_MS is
# left out; a quorum waits JOIN_MS for a group that heartbeats but has not asked to join.
JOIN_MS, TICK_MS, HEARTBEAT_MS = 1000, 50, 2000


def group_index() -> int:
    return int(os.environ[GROUP_ENV])


def group_out(out: Path, group: int) -> Path:
    return out / "groups" / f"g{group}"


def build_manager(rank: int, world: int, timeout_s: float) -> tuple[Any, Any]:
    """This rank's torchft Manager over its group (and the store it holds on the group's rank
    0, to be kept alive): a fresh store per start of the group, so that a restart never reads
    the address of the Manager of the start before it."""
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = (dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
             if rank == 0 else None)
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    timeout = datetime.timedelta(seconds=timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=1, use_async_quorum=False, store_addr=host, store_port=port[0],
        rank=rank, world_size=world, replica_id=f"group{group_index()}", timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout)
    return manager, store


def log_event(out: Path, record: dict[str, Any]) -> None:
    with (out / FT_LOG).open("a") as f:
        f.write(json.dumps(record) + "\n")


def log_step(out: Path, rank: int, step: int, manager: Any, record: Any,
             heals_logged: int) -> int:
    """After a step with --ft-groups: rank 0 logs the heals received since the last step and
    whether the step committed. Returns the heals logged."""
    if rank == 0:
        for heal in record.received[heals_logged:]:
            log_event(out, {"event": "healed", **heal})
        committed = manager.current_step() > step
        log_event(out, {"event": "committed" if committed else "uncommitted",
                        "step": step + 1 if committed else step,
                        "attempt": restart_count()})
    return len(record.received)


def _launch_group(launch_one: Any, config: Any, group: int, lighthouse: str) -> None:
    os.environ[GROUP_ENV] = str(group)
    os.environ[LIGHTHOUSE_ENV] = lighthouse
    raise SystemExit(launch_one(config))


def check_schedule(config: Any, nproc: int) -> None:
    """A bad DISTOPT_TRAIN_FAIL_SCHEDULE is one ValueError, before any group starts."""
    if os.environ.get(FAIL_SCHEDULE_ENV):
        parse_schedule(os.environ[FAIL_SCHEDULE_ENV], groups=config.ft_groups, nproc=nproc,
                       steps=config.steps)


def launch_groups(config: Any, launch_one: Any, nproc: int) -> int:
    """Run ``launch_one(config)`` once per group, side by side, under one Lighthouse; write
    the run's summary; the exit status is the worst of the groups'."""
    server = None
    lighthouse = config.ft_lighthouse
    if lighthouse is None:
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=config.ft_min_groups,
                                  join_timeout_ms=JOIN_MS,
                                  quorum_tick_ms=TICK_MS, heartbeat_timeout_ms=HEARTBEAT_MS)
        lighthouse = server.address()
    out = Path(config.out)
    for group in range(config.ft_groups):
        group_out(out, group).mkdir(parents=True, exist_ok=True)
        (group_out(out, group) / FT_LOG).unlink(missing_ok=True)
    # Forked before any torch op; each group's launch starts its ranks from its own server.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_launch_group, args=(launch_one, config, g, lighthouse))
             for g in range(config.ft_groups)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if server is not None:
        server.shutdown()
    status = max(p.exitcode or 0 for p in procs)
    if status == 0:
        write_ft_summary(out, config.ft_groups, nproc, config.steps)
    return status


def group_record(folder: Path, group: int) -> dict[str, Any]:
    """One group's ``ft`` entry, from its ``ft.jsonl``: the steps at which a start of it ended
    in a failure (the committed steps it had reached), the steps at which it healed, the
    restarts of each rank, and the steps it tried and did not commit."""
    events = read_events(folder / FT_LOG)
    starts = [e for e in events if e["event"] == "start"]
    reached: dict[int, int] = {}
    for e in events:
        if e["event"] == "committed":
            reached[e["attempt"]] = max(reached.get(e["attempt"], 0), e["step"])
    last = max(e["attempt"] for e in starts)
    finished = [e for e in events if e["event"] == "finished"]
    return {
        "group": group,
        "failed_at": [reached.get(s["attempt"], s["step"]) for s in starts
                      if s["attempt"] < last],
        "healed_at": [e["step"] for e in events if e["event"] == "healed"],
        "restarts": finished[-1]["restarts"] if finished else [last],
        "uncommitted_steps": [e["step"] for e in events if e["event"] == "uncommitted"],
        "heals": [{k: e[k] for k in ("step", "bytes", "seconds")} for e in events
                  if e["event"] == "healed"],
        # DISTOPT_TRAIN_FAIL_SCHEDULE's kills that fired: the step each fired at, its phase.
        "kills": [{"step": e["step"], "phase": e["kill"]["phase"], "rank": e["kill"]["rank"],
                   "attempt": e["attempt"]} for e in events if e["event"] == "killed"],
    }


def schedule_record(records: list[dict[str, Any]], groups: int, nproc: int,
                    steps: int) -> dict[str, Any]:
    """The kills planned by DISTOPT_TRAIN_FAIL_SCHEDULE, and those that never fired."""
    planned = parse_schedule(os.environ[FAIL_SCHEDULE_ENV], groups=groups, nproc=nproc,
                             steps=steps)
    fired = [(r["group"], k["rank"], k["phase"]) for r in records for k in r["kills"]]
    unfired = []
    for kill in planned:
        key = (kill.group, kill.rank, kill.phase)
        if key in fired:
            fired.remove(key)
        else:
            unfired.append(dataclasses.asdict(kill))
    return {"planned": [dataclasses.asdict(k) for k in planned],
            "unfired": unfired}


def write_ft_summary(out: Path, groups: int, nproc: int = 1,
                     steps: int = 0) -> dict[str, Any]:
    """``OUT/summary.json``: the first group's summary, each group's held-out loss and the
    ``ft`` entry."""
    summaries = [json.loads((group_out(out, g) / "summary.json").read_text())
                 for g in range(groups)]
    summary = dict(summaries[0])
    summary["ft"] = {"groups": [group_record(group_out(out, g), g) for g in range(groups)]}
    summary["ft"]["heldout_loss"] = [s.get("heldout_loss_end") for s in summaries]
    if os.environ.get(FAIL_SCHEDULE_ENV):
        summary["ft"]["schedule"] = schedule_record(summary["ft"]["groups"], groups, nproc,
                                                    steps)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
