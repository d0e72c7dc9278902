"""The worker pools of dist_harness: a case that fails, dies or hangs fails alone.

The cases after it run on a fresh group, so that a collective left half done by a failed case
cannot eat theirs, and a hang ends in a timeout instead of stopping the suite.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import CaseFailed, case_result, run_cases

D = 2
pytestmark = pytest.mark.slow  # it ends and respawns the d = 2 pool three times


def all_reduce_rank() -> tuple[int, float]:
    """This rank's pid and the sum of every rank's rank, through the group."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return os.getpid(), t.item()


def raise_on_rank_one() -> None:
    """Rank 1 raises before a collective that rank 0 enters: rank 0 waits in it."""
    if dist.get_rank() == 1:
        raise RuntimeError("a failure on rank 1")
    dist.barrier()


def die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


HANG_TIMEOUT = 1.0  # seconds: what the hung case is given; the others get the default
# Seconds rank 0 is given, once rank 1 raised, before the pool is ended: it waits in a barrier
# that rank 1 never joins, so any grace is spent in full.
GRACE = 0.5


@pytest.fixture(scope="module")
def results():
    cases = [
        ("before", all_reduce_rank, ()),
        ("again", all_reduce_rank, ()),
        ("raises", raise_on_rank_one, ()),
        ("after-raise", all_reduce_rank, ()),
    ]
    out = run_cases(D, cases, grace=GRACE)
    # The default grace: rank 0's barrier fails as soon as rank 1 is gone, and the death is
    # named only once the fork server has reported it, which on a loaded machine can take
    # longer than GRACE. No grace is spent when it comes sooner.
    died = run_cases(D, [("dies", die_on_rank_one, ()), ("after-death", all_reduce_rank, ())])
    hung = run_cases(D, [("hangs", sleep, (600.0,))], timeout=HANG_TIMEOUT)
    after = run_cases(D, [("after-hang", all_reduce_rank, ())])
    for per_rank, *more in zip(out, died, hung, after, strict=True):
        for extra in more:
            per_rank.update(extra)
    return out


def test_cases_share_the_processes_until_one_fails(results):
    out = results
    before, again = case_result(out, "before"), case_result(out, "again")
    assert [v[1] for v in before] == [v[1] for v in again] == [1.0, 1.0]
    assert before == again  # the same two processes ran both
    after = case_result(out, "after-raise")
    assert [v[1] for v in after] == [1.0, 1.0]
    assert {v[0] for v in after}.isdisjoint(v[0] for v in before)  # a fresh group


def test_a_failure_names_the_rank_and_its_traceback(results):
    out = results
    with pytest.raises(CaseFailed, match="failed on rank 0"):
        case_result(out, "raises")  # rank 0 was ended, waiting for rank 1
    status, value = out[1]["raises"]
    assert status == "error" and "a failure on rank 1" in value


@pytest.mark.parametrize("case,rank,why", [("dies", 1, "died (exit code 3)"),
                                           ("hangs", 0, "no answer within 1 s")])
def test_a_dead_or_hung_case_fails_and_the_next_one_runs(results, case, rank, why):
    out = results
    with pytest.raises(CaseFailed):
        case_result(out, case)
    status, value = out[rank][case]
    assert status == "error" and why in value, value
    after = case_result(out, f"after-{'death' if case == 'dies' else 'hang'}")
    assert [v[1] for v in after] == [1.0, 1.0]
