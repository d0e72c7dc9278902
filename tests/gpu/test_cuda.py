"""distopt on one CUDA GPU, at world size 1 under NCCL and under gloo.

Run on a machine with a CUDA GPU, from the repository root::

    PYTHONPATH=src:tests python -m pytest tests/gpu -q -rs -s

(``-s`` prints the memory report.) Without CUDA the whole module is skipped, with the reason,
before anything is built. The cases live in tests/device_cases.py and take the device as an
argument; tests/test_device_cases.py runs every one of them on the CPU with the same
assertions. Here they run on ``cuda:0``:

- fp32 parity against plain torch.optim on the same GPU (AdamW, SGD with Nesterov, Adagrad),
  clipping and a cosine schedule, with distopt's default fused kernel against torch's default;
  and torch.optim.Muon for the hidden matrices beside AdamW in one distopt optimizer;
- bf16 params with fp32 grads against fp32 master weights;
- fp16 with a DynamicLossScaler and an injected overflow step (skipped, nothing changed);
- no_sync accumulation, with the full grad buffer and with sharded grads;
- optimizer state held in bf16, fp16 and fp8 after one step: the fp32-state step's state
  narrowed once;
- a checkpoint saved on CUDA, loaded on the CPU, and back;
- memory: what the GPU holds against ``distopt.measure_state_bytes`` and the theory, and the
  peak of ``step()`` against one bucket's fp32 shard and the inner optimizer's temporaries;
- ordering: ``torch.cuda._sleep`` on the compute stream before each forward and before each
  bucket's grads must not change a bit of the result, overlap on or off;
- ``distopt train --device cuda --steps 50``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False", allow_module_level=True)

import device_cases as cases  # noqa: E402

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
BACKENDS = ["nccl", "gloo"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory):
    """A process group of one rank on cuda:0 for the module's tests, once per backend."""
    if request.param == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    torch.cuda.set_device(CUDA)
    with cases.single_rank_group(request.param, tmp_path_factory.mktemp(request.param)):
        yield request.param


@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "adagrad"])
def test_fp32_parity(backend, opt_name):
    value = cases.parity_fp32(CUDA, opt_name)
    cases.check_parity_fp32(value)
    assert value["kernel"] == cases.CUDA_KERNEL and value["devices"] == {"cuda"}


def test_muon_with_adamw_parity(backend):
    value = cases.parity_muon(CUDA)
    cases.check_parity_muon(value)
    assert value["adamw_kernel"] == cases.CUDA_KERNEL  # fused AdamW beside Muon


def test_bf16_params_fp32_grads(backend):
    cases.check_parity_bf16(cases.parity_bf16(CUDA))


def test_fp16_overflow_step_is_skipped(backend):
    cases.check_fp16_dynamic_scaler(cases.fp16_dynamic_scaler(CUDA))


@pytest.mark.parametrize("shard_grads", [False, True], ids=["full", "shard-grads"])
def test_no_sync(backend, shard_grads):
    cases.check_no_sync(cases.no_sync_accumulation(CUDA, shard_grads))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_held_state(backend, state_dtype):
    value = cases.held_state_one_step(CUDA, state_dtype)
    cases.check_held_state(value, state_dtype)
    assert value["devices"] == {"cuda"}


def test_checkpoint_from_cuda_to_cpu_and_back(backend, tmp_path):
    value = cases.checkpoint_round_trip(tmp_path, CUDA, CPU)
    cases.check_round_trip(value, [cases.CPU_KERNEL, cases.CUDA_KERNEL])
    assert value["devices"] == [{"cuda"}, {"cpu"}, {"cuda"}]


def test_memory_held_and_step_peak(backend):
    value = cases.memory_figures(CUDA)
    print(f"\n[{backend}] " + cases.memory_lines(value))
    assert value["held"] is not None and value["step_peak"] is not None
    cases.check_memory(value)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_delays_on_the_stream_change_nothing(backend, overlap):
    expected = cases.delayed_run(CUDA, overlap=False, delay=cases.no_delay)
    delayed = cases.delayed_run(CUDA, overlap=overlap, delay=cases.cuda_sleep())
    assert all(torch.equal(a, b) for a, b in zip(expected, delayed, strict=True))


def test_train_on_cuda(tmp_path):
    proc = cases.run_train(tmp_path, "cuda", steps=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["device"] == "cuda" and summary["world_size"] == 1
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"]  # it learns
