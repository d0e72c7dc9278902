"""The cases of tests/gpu/test_cuda.py, run on the CPU under a one-rank gloo group, with the
same assertions; and `distopt train --device`."""

from __future__ import annotations

import json

import pytest
import torch

from distopt.train import launch
from distopt.train.config import parse_args
from distopt.train.worker import _device

import device_cases as cases
from early_launches import Command, launch_early

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    with cases.single_rank_group("gloo", tmp_path_factory.mktemp("store")):
        yield


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_fp32_parity(gloo, opt_name):
    value = cases.parity_fp32(CPU, opt_name)
    cases.check_parity_fp32(value)
    assert value["kernel"] == cases.CPU_KERNEL and value["devices"] == {"cpu"}


def test_muon_with_adamw_parity(gloo):
    value = cases.parity_muon(CPU)
    cases.check_parity_muon(value)
    assert value["adamw_kernel"] == cases.CPU_KERNEL


def test_bf16_params_fp32_grads(gloo):
    cases.check_parity_bf16(cases.parity_bf16(CPU))


def test_fp16_overflow_step_is_skipped(gloo):
    cases.check_fp16_dynamic_scaler(cases.fp16_dynamic_scaler(CPU))


@pytest.mark.parametrize("shard_grads", [False, True], ids=["full", "shard-grads"])
def test_no_sync(gloo, shard_grads):
    cases.check_no_sync(cases.no_sync_accumulation(CPU, shard_grads))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_held_state(gloo, state_dtype):
    value = cases.held_state_one_step(CPU, state_dtype)
    cases.check_held_state(value, state_dtype)
    assert value["devices"] == {"cpu"}


def test_checkpoint_between_kernels(gloo, tmp_path):
    # The CPU has a fused AdamW too: a checkpoint of a fused run resumes with foreach and back,
    # as one saved on CUDA resumes on the CPU.
    value = cases.checkpoint_round_trip(tmp_path, CPU, CPU, {"fused": True}, {})
    cases.check_round_trip(value, [cases.CPU_KERNEL, {"foreach": None, "fused": True}])


def test_memory_figures(gloo):
    value = cases.memory_figures(CPU)
    assert value["held"] is None and value["step_peak"] is None  # measured on CUDA only
    cases.check_memory(value)
    assert "measure_state_bytes" in cases.memory_lines(value)


def test_delays_do_not_change_overlap(gloo):
    on = cases.delayed_run(CPU, True, cases.no_delay)
    off = cases.delayed_run(CPU, False, cases.no_delay)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


# Started with the session (see early_launches.py).
TRAIN_ON_CPU = launch_early("test_train_on_the_cpu_device",
                            lambda workdir: [Command(cases.train_command(workdir, "cpu", 2))])


@pytest.mark.slow
def test_train_on_the_cpu_device():
    (proc,) = TRAIN_ON_CPU.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((TRAIN_ON_CPU.workdir / "summary.json").read_text())
    assert summary["config"]["device"] == "cpu" and summary["world_size"] == 1


def test_device_option():
    assert parse_args([]).device == "auto"
    assert parse_args(["--device", "cpu"]).device_type() == "cpu"
    assert launch.check_device(parse_args(["--device", "cpu"])) == 2
    assert launch.check_device(parse_args(["--device", "cpu", "--nproc", "3"])) == 3
    assert _device("cpu") == CPU
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda, got tpu"):
        parse_args(["--device", "tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys):
    assert launch.main(["--device", "cuda"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distopt train: error: --device cuda"), lines
