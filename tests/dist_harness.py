"""Run many test cases inside one spawned gloo process group per world size.

Spawning processes and building a process group costs seconds, so a test module spawns once
per world size and runs every case of its grid inside that group; the tests then assert on the
results each rank returned. The rendezvous is a FileStore in a fresh temporary directory (no
ports to pick or collide on), and the group has a timeout so that a hang fails the test.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Case = tuple[str, Callable[..., Any], tuple]
TIMEOUT = datetime.timedelta(seconds=120)


class CaseFailed(AssertionError):
    pass


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, cases: list[Case]) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    try:
        for name, fn, args in cases:
            try:
                results[name] = ("ok", fn(*args))
            except Exception:
                results[name] = ("error", traceback.format_exc())
            # Keep ranks in lockstep so a case that failed on one rank cannot eat the next
            # case's collectives on another.
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    # Every case ended in a barrier, so no collective is in flight: leave without tearing the
    # group down, whose gloo threads can abort the process at exit ("terminate called without
    # an active exception") after all the results are safely written.
    os._exit(0)


def run_cases(world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world_size`` ranks; return each rank's {name: (status, value)}."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(world_size, os.path.join(tmp, "store"), tmp, cases),
            nprocs=world_size,
            join=True,
        )
        out = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
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
