"""gloo's I/O threads in the idle scheduling class ([Note: gloo's I/O thread]).

``idle_gloo_io_threads`` moves every "gloo_tcp_loop" thread of the process, and the test pool
applies it to the world group and to every group a case makes (the harness's own speed rests
on it). A collective still completes with the threads idle-class.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distopt.comm.gloo_io import gloo_io_threads, idle_gloo_io_threads

from dist_harness import case_result, run_cases

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def _io_policies() -> list[int]:
    return [os.sched_getscheduler(tid) for tid in gloo_io_threads()]


def _set_policy(policy: int) -> None:
    for tid in gloo_io_threads():
        os.sched_setscheduler(tid, policy, os.sched_param(0))


def policies_of_new_groups() -> dict[str, object]:
    """The I/O threads' policies as the pool left them, after a case's new group, and after
    the library call on threads set back to the normal class; an all-reduce over the new group."""
    before = _io_policies()
    group = dist.new_group([0, 1])
    after_group = _io_policies()
    _set_policy(os.SCHED_OTHER)
    reset = _io_policies()
    moved = idle_gloo_io_threads()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=group)
    dist.destroy_process_group(group)
    return {"before": before, "after_group": after_group, "reset": reset, "moved": moved,
            "after_call": _io_policies(), "sum": t.item()}


@pytest.fixture(scope="module")
def seen() -> list[dict[str, object]]:
    return case_result(run_cases(2, [("policies", policies_of_new_groups, ())]), "policies")


def test_the_pools_io_threads_are_idle_class_and_so_are_a_new_groups(seen) -> None:
    for rank in seen:
        assert rank["before"] and set(rank["before"]) == {os.SCHED_IDLE}, rank
        assert len(rank["after_group"]) > len(rank["before"]), rank
        assert set(rank["after_group"]) == {os.SCHED_IDLE}, rank


def test_the_call_moves_every_io_thread_and_collectives_still_complete(seen) -> None:
    for rank in seen:
        assert set(rank["reset"]) == {os.SCHED_OTHER}, rank
        assert rank["moved"] == len(rank["reset"]), rank
        assert set(rank["after_call"]) == {os.SCHED_IDLE}, rank
        assert rank["sum"] == 3.0
