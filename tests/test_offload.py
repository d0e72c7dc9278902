"""The offload tier (``offload_dir``): main params and optimizer state rest in a file between
steps ([Note: the offload tier] in distopt/optim/offload.py).

An offloaded run computes on the same values in the same order as the same run in memory, so
every case compares the two bit for bit, after every step: each rank's params, fp32 masters and
state. The cases cover each sharding mode (optimizer state, grads, params), fp32 and bf16
params, bf16 state, the lean tier (remainders), fp8 state and a whole-tensor optimizer (Muon);
a checkpoint saved from an offloaded run that loads in memory and back; the window (nothing of
the tier resident after a step); and the refusals, agreed on every rank before any collective.
One spawned group of two ranks runs every case.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt.optim.offload import OffloadError
from distopt.optim.param_groups import CLASS_KEY

from dist_harness import case_result, run_cases
from helpers import shared_tmpdir
from models import mlp

WORLD = 2
STEPS = 3
BUCKET = 300  # elements: several buckets (several step chunks) for the MLP's params
ADAMW = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
BF16 = torch.bfloat16

MODES = {
    "zero1": {},
    "shard_grads": {"shard_grads": True},
    "shard_params": {"shard_params": True},
}
TIERS = {
    "fp32": ({}, {}),
    "bf16_params_bf16_state": ({"dtype": BF16}, {"state_dtype": BF16}),
    "lean": ({"dtype": BF16, "grad_dtype": BF16},
             {"store_param_remainders": True, "state_dtype": BF16}),
    "fp8_state": ({}, {"state_dtype": torch.float8_e4m3fn}),
}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return mlp([24, 40, 40, 17], dtype=dtype)


def _build(mode: str, tier: str, offload_dir: str | None, optimizer: str = "adamw"):
    model_kwargs, opt_kwargs = TIERS[tier]
    model = _model(model_kwargs.get("dtype", torch.float32))
    ddp_kwargs = {k: v for k, v in model_kwargs.items() if k != "dtype"}
    ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET, **MODES[mode],
                                          **ddp_kwargs)
    if optimizer == "muon":
        matrices = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        groups = [{"params": matrices, "lr": 0.02},
                  {"params": rest, CLASS_KEY: torch.optim.AdamW, **ADAMW}]
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=groups,
                                           offload_dir=offload_dir, **opt_kwargs)
    else:
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, offload_dir=offload_dir,
                                           **opt_kwargs, **ADAMW)
    return model, ddp, opt


def _train_step(ddp, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(8, 24, generator=g)
    opt.zero_grad()
    dtype = next(ddp.module.parameters()).dtype
    ddp(x.to(dtype)).float().pow(2).mean().backward()
    opt.step()
    ddp.finish_param_sync()


def _numbers(ddp, opt) -> list[torch.Tensor]:
    """This rank's params (its shard under sharded params), masters and state, in order."""
    out = []
    with ddp.gathered_params() if ddp.options.shard_params else _nothing():
        out += [p.detach().clone() for p in ddp.module.parameters()]
    out += [v.clone() for v in opt.main_param_values()]
    for main in opt.main_params:
        for key in sorted(opt.state.get(main, {})):
            value = opt.state[main][key]
            out.append(value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value))
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                        y.view(torch.uint8) if y.element_size() == 1 else y)
        for x, y in zip(a, b, strict=True))


def _tier_resident_bytes(opt) -> int:
    """Bytes of the tier's mapping resident in this process (/proc/self/smaps)."""
    start = opt.offload_tier._base.data_ptr()
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= start < hi:
            return int(re.search(r"^Rss:\s+(\d+) kB", block, re.M).group(1)) * 1024
    raise AssertionError("the tier's mapping is not in /proc/self/smaps")


# ---------------------------------------------------------------- the cases


def offloaded_equals_memory(mode: str, tier: str, optimizer: str) -> dict:
    """The same run in memory and offloaded, compared bit for bit after every step."""
    tmp = shared_tmpdir("offload")
    directory = os.path.join(tmp, f"{mode}-{tier}-{optimizer}")
    os.makedirs(directory, exist_ok=True)
    _, ddp_mem, opt_mem = _build(mode, tier, None, optimizer)
    _, ddp_off, opt_off = _build(mode, tier, directory, optimizer)
    same, resident = [], []
    for step in range(STEPS):
        _train_step(ddp_mem, opt_mem, step)
        _train_step(ddp_off, opt_off, step)
        resident.append(_tier_resident_bytes(opt_off))
        same.append(_same(_numbers(ddp_mem, opt_mem), _numbers(ddp_off, opt_off)))
    tier_ = opt_off.offload_tier
    tier_.wait()
    lo, hi = tier_._base.data_ptr(), tier_._base.data_ptr() + tier_.nbytes
    offloaded = [v for s in opt_off.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
    offloaded += [t for owned in opt_off._owned for t in owned.master_storage()]
    return {"same": same, "resident_after_steps": resident, "regions": len(tier_.regions),
            "all_in_tier": bool(offloaded) and all(lo <= t.data_ptr() < hi for t in offloaded),
            "disk_bytes": tier_.disk_bytes(), "written": tier_.bytes_written,
            "files_left": os.listdir(directory)}


def checkpoint_roundtrip(tier: str) -> dict:
    """An offloaded run saves; a run in memory loads it and saves again; an offloaded run
    loads that: every run ends where the uninterrupted offloaded run ends."""
    tmp = shared_tmpdir("offload-checkpoint")
    directory = os.path.join(tmp, f"ckpt-tier-{tier}")
    os.makedirs(directory, exist_ok=True)
    mode = "shard_params"
    _, ddp_ref, opt_ref = _build(mode, tier, directory)
    _, ddp_a, opt_a = _build(mode, tier, directory)
    for step in range(2):
        _train_step(ddp_ref, opt_ref, step)
        _train_step(ddp_a, opt_a, step)
    first = distopt.save_checkpoint(os.path.join(tmp, f"ckpt-{tier}"), ddp_a, opt_a)
    _, ddp_b, opt_b = _build(mode, tier, None)  # in memory
    distopt.load_checkpoint(first, ddp_b, opt_b)
    _train_step(ddp_ref, opt_ref, 2)
    _train_step(ddp_b, opt_b, 2)
    in_memory = _same(_numbers(ddp_ref, opt_ref), _numbers(ddp_b, opt_b))
    second = distopt.save_checkpoint(os.path.join(tmp, f"ckpt-{tier}"), ddp_b, opt_b)
    _, ddp_c, opt_c = _build(mode, tier, directory)  # offloaded again, state loaded fresh
    distopt.load_checkpoint(second, ddp_c, opt_c)
    resident_after_load = _tier_resident_bytes(opt_c)
    _train_step(ddp_ref, opt_ref, 3)
    _train_step(ddp_c, opt_c, 3)
    back = _same(_numbers(ddp_ref, opt_ref), _numbers(ddp_c, opt_c))
    return {"in_memory": in_memory, "back": back, "resident_after_load": resident_after_load}


def refusals() -> dict:
    """A missing directory on one rank, and a full disk on the other, are every rank's error,
    raised when the optimizer is built (before any step); the group still works after."""
    tmp = shared_tmpdir("offload-refusals")
    out = {}
    missing = os.path.join(tmp, "no-such-dir") if dist.get_rank() == 1 else tmp
    _, ddp, _ = _build("zero1", "fp32", None)
    try:
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, offload_dir=missing, **ADAMW)
        out["missing"] = None
    except OffloadError as error:
        out["missing"] = str(error)
    real = os.posix_fallocate

    def full_disk(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() == 0:
        os.posix_fallocate = full_disk
    try:
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, offload_dir=tmp, **ADAMW)
        out["full"] = None
    except OffloadError as error:
        out["full"] = str(error)
    finally:
        os.posix_fallocate = real
    before = [p.detach().clone() for p in ddp.module.parameters()]
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, offload_dir=tmp, **ADAMW)
    out["unchanged_by_refusals"] = all(
        torch.equal(a, b) for a, b in zip(before, ddp.module.parameters(), strict=True))
    _train_step(ddp, opt, 0)
    out["trains_after"] = True
    return out


CASES = [
    *[(f"equal-{mode}-{tier}", offloaded_equals_memory, (mode, tier, "adamw"))
      for mode in MODES for tier in TIERS
      if not (tier == "fp8_state" and mode != "shard_grads")],
    ("equal-shard_params-bf16-muon", offloaded_equals_memory,
     ("shard_params", "bf16_params_bf16_state", "muon")),
    ("checkpoint-lean", checkpoint_roundtrip, ("lean",)),
    ("checkpoint-fp32", checkpoint_roundtrip, ("fp32",)),
    ("refusals", refusals, ()),
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("name", [name for name, _, _ in CASES if name.startswith("equal")])
def test_offloaded_run_equals_run_in_memory(results: list[dict], name: str) -> None:
    for rank, out in enumerate(case_result(results, name)):
        assert out["same"] == [True] * STEPS, (rank, out["same"])
        # Nothing of the tier stays in the process between steps: the window is the step's.
        assert out["resident_after_steps"] == [0] * STEPS, (rank, out["resident_after_steps"])
        assert out["all_in_tier"]  # every state tensor and master storage is the file's
        assert out["regions"] >= 2  # several step chunks: the window moved
        assert out["disk_bytes"] > 0 and out["written"] > 0
        assert out["files_left"] == []  # the file lives only as long as the process


@pytest.mark.parametrize("tier", ["lean", "fp32"])
def test_checkpoint_from_offloaded_run_loads_in_memory_and_back(results: list[dict],
                                                                tier: str) -> None:
    for out in case_result(results, f"checkpoint-{tier}"):
        assert out == {"in_memory": True, "back": True, "resident_after_load": 0}


def test_missing_directory_and_full_disk_refused_on_every_rank(results: list[dict]) -> None:
    outs = case_result(results, "refusals")
    missing = {out["missing"] for out in outs}
    full = {out["full"] for out in outs}
    assert len(missing) == 1 and len(full) == 1  # the same message on both ranks
    (missing,), (full,) = missing, full
    assert missing is not None and "no-such-dir" in missing and "is not a directory" in missing
    assert full is not None and "GiB free" in full and "distopt memory --offload" in full
    assert all(out["unchanged_by_refusals"] and out["trains_after"] for out in outs)
