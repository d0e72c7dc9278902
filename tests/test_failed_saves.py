"""A save that cannot complete loses nothing: a disk that fills up mid-write on one rank, a
manifest or ``latest`` pointer that cannot be written, a directory that is not writable; with
an async save, the same faults in its background write.

Every case saves a first checkpoint, takes a step, and makes the second save fail. Then on every
rank: the same clear ``CheckpointError``, ``latest`` still naming the first checkpoint, no debris
left in the run directory, the first checkpoint loading back exactly what was saved, the run
going on from it to the bits of the uninterrupted run, and a third save that succeeds. All cases
run in one spawned group of two ranks.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import distopt
from distopt.checkpoint import files as files_module
from distopt.checkpoint import writing as writer_module

from dist_harness import case_result, run_cases
from helpers import numbers_by_name, same_by_name
from models import AwkwardLM, batches, rank_slice

WORLD = 2
FULL_AFTER = 2048  # bytes a rank's checkpoint file takes before its disk is full


def _enospc(path: object = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)


class _FillingFile(io.FileIO):
    """A file on a disk that is full once the file holds FULL_AFTER bytes."""

    def write(self, data) -> int:  # type: ignore[override]
        if self.tell() + memoryview(data).nbytes > FULL_AFTER:
            raise _enospc(self.name)
        return super().write(data)


@contextlib.contextmanager
def _disk_fills_while_writing(rank: int, run_dir: Path) -> Iterator[None]:
    """On ``rank``, the checkpoint writer's file stops growing after FULL_AFTER bytes."""
    if dist.get_rank() != rank:
        yield
        return
    with mock.patch.object(writer_module, "open", _FillingFile, create=True):
        yield


@contextlib.contextmanager
def _cannot_write(name: str, run_dir: Path) -> Iterator[None]:
    """On rank 0 (which commits), writing the file ``name`` fails with ENOSPC."""
    real = files_module._write_durably

    def write(path: Path, text: str) -> None:
        if path.name == name:
            raise _enospc(path)
        real(path, text)

    with mock.patch.object(files_module, "_write_durably", write):
        yield


@contextlib.contextmanager
def _unwritable(rank: int, run_dir: Path) -> Iterator[None]:
    """The run directory loses its write permission. Root ignores permissions, so there the
    directory's mkdir also answers EACCES, as it would for anyone else."""
    mode = run_dir.stat().st_mode
    run_dir.chmod(stat.S_IRUSR | stat.S_IXUSR)
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == run_dir:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, *args, **kwargs)

    try:
        with mock.patch.object(os, "mkdir", mkdir):
            yield
    finally:
        run_dir.chmod(mode)


FAULTS = {
    "disk full on rank 1": (lambda d: _disk_fills_while_writing(1, d), "rank 1", "ENOSPC"),
    "disk full on rank 0": (lambda d: _disk_fills_while_writing(0, d), "rank 0", "ENOSPC"),
    "manifest not written": (lambda d: _cannot_write(files_module.MANIFEST, d), "rank 0",
                             "ENOSPC"),
    "latest not written": (lambda d: _cannot_write(f".latest{files_module.TMP_SUFFIX}", d),
                           "rank 0", "ENOSPC"),
    "directory not writable": (lambda d: _unwritable(0, d), "", "EACCES"),
}


# Each fault with a synchronous save, and the faults of the write with an async save, where
# they strike in the background, after save_checkpoint has returned.
CASES = {fault: (fault, False) for fault in FAULTS} | {
    f"{fault}, async": (fault, True)
    for fault in ("disk full on rank 1", "latest not written", "directory not writable")
}


# ---------------------------------------------------------------------- the case (in the ranks)


def _step(ddp, opt, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batches(step)
    opt.zero_grad()
    ddp.module.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                    step=0).backward()
    opt.step()


def failed_save(case: str, root: str) -> dict:
    fault, async_save = CASES[case]
    run_dir = Path(root) / case.replace(" ", "-").replace(",", "")
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=100)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    _step(ddp, opt, 0)
    distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": 1})
    saved = numbers_by_name(model, opt)
    _step(ddp, opt, 1)
    moved = numbers_by_name(model, opt)

    error = raised_by = None
    with FAULTS[fault][0](run_dir):
        try:
            raised_by = "save_checkpoint"
            pending = distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": 2},
                                              async_save=async_save)
            if async_save:  # the fault strikes in the background write
                raised_by = "wait"
                pending.wait(60)
        except distopt.CheckpointError as exc:
            error = str(exc)
    after_failure = sorted(os.listdir(run_dir))
    latest = files_module.latest_name(run_dir)
    untouched = same_by_name(moved, numbers_by_name(model, opt))

    extra = distopt.load_checkpoint(run_dir, ddp, opt)
    restored = same_by_name(saved, numbers_by_name(model, opt))
    _step(ddp, opt, 1)  # the run goes on, to where the uninterrupted run was
    resumed = same_by_name(moved, numbers_by_name(model, opt))
    again = distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": 2},
                                    async_save=async_save)
    again = again.wait(60) if async_save else again
    return {"error": error, "raised_by": raised_by, "after_failure": after_failure,
            "latest": latest, "untouched": untouched, "step": extra["step"],
            "restored": restored, "resumed": resumed, "again": again.name,
            "latest_again": files_module.latest_name(run_dir),
            "after_again": sorted(os.listdir(run_dir))}


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("failed-saves")
    return run_cases(WORLD, [(case, failed_save, (case, str(root))) for case in CASES])


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_save_raises_everywhere_and_loses_nothing(results, case):
    fault, async_save = CASES[case]
    _, culprit, code = FAULTS[fault]
    per_rank = case_result(results, case)
    errors = {r["error"] for r in per_rank}
    assert len(errors) == 1, errors  # the same error on every rank
    error = errors.pop()
    assert error is not None and error.startswith("cannot save"), error
    assert culprit in error and os.strerror(getattr(errno, code)) in error, error
    for r in per_rank:
        assert r["latest"] == "ckpt-000001"
        # No debris: no temporary directory, no half-published checkpoint, no stray pointer.
        assert r["after_failure"] == ["ckpt-000001", "latest"]
        assert r["untouched"]  # the failed save changed nothing in memory either
        assert r["step"] == 1 and r["restored"]  # latest loads back what it saved, bit for bit
        assert r["resumed"]  # and the run goes on from it to the same bits
        # Where the directory itself refuses, even an async save fails before it returns.
        assert r["raised_by"] == ("wait" if async_save and code == "ENOSPC"
                                  else "save_checkpoint")
        assert r["again"] == r["latest_again"] == "ckpt-000002"
        assert r["after_again"] == ["ckpt-000001", "ckpt-000002", "latest"]


def test_the_error_says_what_is_kept(results):
    error = case_result(results, "disk full on rank 1")[0]["error"]
    assert "'latest' still names ckpt-000001" in error
    assert "Nothing of it was kept" in error
