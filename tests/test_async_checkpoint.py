"""Async saves: ``save_checkpoint(..., async_save=True)`` stages and returns, writes while the
next steps train, and publishes as a synchronous save does.

Two gloo ranks run one case. The writer is held at the start of its write (a gate on the DCP
writer) while the ranks train two more steps, so the write is in flight for certain while they
do; the checkpoint then holds the state of the step it was taken at, bit for bit, and a run
resumed from it ends where the uninterrupted run ends. A second save asked for while one is in
flight waits for it. The staging buffer is measured: allocated once, reused, and exactly the
bytes the rank's file holds. A full disk and a lost rank during the background write are in
test_failed_saves.py and test_checkpoint.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import distopt
from distopt.checkpoint import dcp as dcp_module
from distopt.checkpoint import files as files_module
from distopt.checkpoint import staging_bytes
from distopt.checkpoint.staging import staging_of
from distopt.memory import checkpoint_bytes_per_param

from checkpoint_index import untiled_keys, written_bytes
from dist_harness import case_result, run_cases
from helpers import numbers_by_name, same_by_name
from models import AwkwardLM, batches, rank_slice

WORLD = 2
SAVE_AT, END = 2, 4


def _build():
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=100)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    return model, ddp, opt


def _train(ddp, opt, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = batches(step)
        opt.zero_grad()
        ddp.module.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                        step).backward()
        opt.step()


class _Gate:
    """Holds every DCP write until opened, on this rank."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.reached = threading.Event()
        real = dcp_module._Writer.write_data

        def write_data(writer, plan, planner):
            self.reached.set()
            assert self.open.wait(120), "the gate was never opened"
            return real(writer, plan, planner)

        self.patch = mock.patch.object(dcp_module._Writer, "write_data", write_data)


def overlapped(root: str) -> dict:
    run_dir = Path(root) / "run"
    model, ddp, opt = _build()
    _train(ddp, opt, range(SAVE_AT))
    staging = staging_of(opt)
    gate = _Gate()
    with gate.patch:
        began = time.perf_counter()
        first = distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": SAVE_AT},
                                        async_save=True)
        returned = time.perf_counter() - began
        at_save = numbers_by_name(model, opt)
        buffer = staging.buffer.data_ptr()
        assert gate.reached.wait(60)  # the writer thread is at its write
        _train(ddp, opt, range(SAVE_AT, END))  # training goes on meanwhile
        in_flight_while_training = not first.done()
        latest_while_in_flight = files_module.latest_name(run_dir)
        gate.open.set()
        published = first.wait(60)
    at_end = numbers_by_name(model, opt)

    # A second save while one is in flight waits for it.
    gate = _Gate()
    with gate.patch:
        second = distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": END},
                                         async_save=True)
        threading.Timer(0.5, gate.open.set).start()
        third = distopt.save_checkpoint(run_dir, ddp, opt, extra={"step": END},
                                        async_save=True)
        second_done_when_third_returned = second.done()
        names = [second.wait(60).name, third.wait(60).name]
    reused = staging.buffer.data_ptr() == buffer
    # The latest after the two is loadable: the third save's state (no step between them).
    latest_extra = distopt.load_checkpoint(run_dir, ddp, opt)
    latest_loads = latest_extra["step"] == END and same_by_name(at_end, numbers_by_name(model, opt))

    extra = distopt.load_checkpoint(published, ddp, opt)
    restored = same_by_name(at_save, numbers_by_name(model, opt))
    _train(ddp, opt, range(extra["step"], END))
    rank = dist.get_rank()
    num_params = sum(t.numel() for t in model.state_dict().values())
    return {
        "returned_s": returned, "stall_s": first.stall_s,
        "in_flight_while_training": in_flight_while_training,
        "latest_while_in_flight": latest_while_in_flight, "published": published.name,
        "restored": restored, "resumed_to_end": same_by_name(at_end, numbers_by_name(model, opt)),
        "second_done": second_done_when_third_returned, "waited_s": third.waited_s,
        "names": names, "latest": files_module.latest_name(run_dir), "latest_loads": latest_loads,
        "listing": sorted(p.name for p in run_dir.iterdir()),
        "allocations": staging.allocations, "reused": reused,
        "capacity": staging_bytes(opt), "staged": staging.staged_bytes,
        "written": sum(written_bytes(published)[rank].values()),
        "untiled": untiled_keys(published), "num_params": num_params,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad),
        "owned": sum(m.numel() for m in opt.main_params),
        "largest_entry": max(t.numel() * 4 for t in model.state_dict().values()),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("async")
    return case_result(run_cases(WORLD, [("overlapped", overlapped, (str(root),))]),
                       "overlapped")


def test_the_write_overlaps_the_next_steps_and_publishes_after(results):
    for v in results:
        assert v["in_flight_while_training"], v  # two steps trained while it was written
        assert v["latest_while_in_flight"] is None  # nothing published before the write ended
        assert v["published"] == "ckpt-000001"
        assert v["stall_s"] == pytest.approx(v["returned_s"], abs=0.05)


def test_the_checkpoint_is_the_state_at_the_save_and_resumes_bitwise(results):
    for v in results:
        assert v["restored"]  # the state of step SAVE_AT, though training went on meanwhile
        assert v["resumed_to_end"]  # and the resumed run ends where the uninterrupted one did


def test_a_second_save_waits_for_the_one_in_flight(results):
    for v in results:
        assert v["second_done"] and v["waited_s"] >= 0.3, v
        assert v["names"] == ["ckpt-000002", "ckpt-000003"] and v["latest"] == "ckpt-000003"
        assert v["latest_loads"]  # and it loads back the state it was asked for
        assert v["listing"] == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "latest"]


def test_staging_is_what_the_rank_writes_allocated_once(results):
    for v in results:
        assert v["allocations"] == 1 and v["reused"], v  # three saves, one buffer
        assert v["untiled"] == []
        # Exactly the tensor bytes this rank's file holds, each staged tensor padded to 64.
        assert v["staged"] == v["written"], v
        assert 0 <= v["capacity"] - v["staged"] < 64 * 40, v
    # Together the ranks stage the checkpoint once: the model (trainable params as their fp32
    # main params, in torch's layout), AdamW's two moments and a step count per param, no more.
    v = results[0]
    steps = 4 * v["trainable_tensors"]
    frozen = v["num_params"] - v["trainable"]
    total = v["num_params"] * 4 + v["trainable"] * 8 + steps
    assert sum(w["staged"] for w in results) == total
    # Each rank: its shard of the main params and the state, and half of the frozen params
    # (dealt out a tensor at a time, so give or take the largest).
    for w in results:
        rest = w["staged"] - 12 * w["owned"] - 2 * frozen
        assert -v["largest_entry"] <= rest <= v["largest_entry"] + steps, w
    # Without frozen params the stated bound, checkpoint_bytes_per_param / d per param, is
    # the same count: (4 + 8) / 2 for fp32 params and AdamW.
    assert checkpoint_bytes_per_param(torch.float32) == 12
