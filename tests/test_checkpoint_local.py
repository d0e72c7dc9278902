"""Checkpoints on one process: the run directory, the in-memory format, loss scalers, model
chunks, BasicOptimizer, export (file format, CLI, bounded memory) and plain checkpoints."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distopt
from distopt.checkpoint import FlatShard, merge_state_dicts
from distopt.checkpoint.format import as_shard
from distopt.cli import main as cli_main

from early_launches import Command, launch_early
from models import VOCAB, AwkwardLM, batches, mlp

ROOT = Path(__file__).resolve().parents[1]


def build(dtype=torch.float32, scaler=None, cls=torch.optim.AdamW, **kwargs):
    torch.manual_seed(0)
    model = AwkwardLM().to(dtype)
    ddp = distopt.DistributedDataParallel(model, bucket_size=40, find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, cls, loss_scaler=scaler, lr=1e-2, **kwargs)
    return model, ddp, opt


def train(ddp, opt, steps) -> list[bool]:
    updated = []
    for step in steps:
        tokens, targets = batches(step)
        opt.zero_grad()
        logits = ddp(tokens, use_sometimes=step % 2 == 0)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        opt.scale_loss(loss).backward()
        updated.append(opt.step().updated)
    return updated


def values(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_run_directory_latest_keep_and_names(tmp_path):
    model, ddp, opt = build()
    run = tmp_path / "run"
    (run).mkdir()
    (run / ".ckpt-000009.distopt-tmp").mkdir()  # debris of an interrupted save
    for step in range(4):
        train(ddp, opt, [step])
        saved = distopt.save_checkpoint(run, ddp, opt, extra={"step": step + 1}, keep=2)
        assert saved == run / f"ckpt-{step + 1:06d}"
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-000003", "ckpt-000004", "latest"]
    assert (run / "latest").read_text() == "ckpt-000004\n"
    manifest = json.loads((run / "ckpt-000004" / "distopt.json").read_text())
    assert manifest["sequence"] == 4 and manifest["dp_size"] == 1
    assert distopt.has_checkpoint(run) and distopt.has_checkpoint(run / "ckpt-000003")
    assert not distopt.has_checkpoint(tmp_path / "nothing")
    assert not distopt.has_checkpoint(tmp_path)

    assert distopt.save_checkpoint(run, ddp, opt, name="best").name == "best"
    assert (run / "latest").read_text() == "best\n"
    with pytest.raises(distopt.CheckpointError, match="already exists"):
        distopt.save_checkpoint(run, ddp, opt, name="best")
    with pytest.raises(distopt.CheckpointError, match="is a checkpoint itself"):
        distopt.save_checkpoint(run / "best", ddp, opt)
    # latest=False, for a folder another tool owns: the checkpoint, and no pointer to it.
    side = tmp_path / "other-tool"
    assert distopt.save_checkpoint(side, ddp, opt, name="a", latest=False) == side / "a"
    assert sorted(p.name for p in side.iterdir()) == ["a"] and distopt.has_checkpoint(side / "a")
    assert distopt.save_checkpoint(run, ddp, opt, name="side", latest=False).name == "side"
    assert (run / "latest").read_text() == "best\n"
    # Loading a run directory loads its latest; a checkpoint directory loads that one.
    fresh = build()
    assert distopt.load_checkpoint(run, fresh[1], fresh[2]) is None
    assert same(values(fresh[0]), values(model))
    assert distopt.load_checkpoint(run / "ckpt-000003", fresh[1], fresh[2]) == {"step": 3}


def test_bad_arguments_raise_at_once(tmp_path):
    model, ddp, opt = build()
    with pytest.raises(TypeError, match="DistributedOptimizer or distopt.BasicOptimizer"):
        distopt.save_checkpoint(tmp_path, ddp, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="keep must be a positive"):
        distopt.save_checkpoint(tmp_path, ddp, opt, keep=True)
    with pytest.raises(ValueError, match="not the model the optimizer was built over"):
        distopt.save_checkpoint(tmp_path, build()[1], opt)
    with pytest.raises(distopt.CheckpointError, match="cannot save"):
        distopt.save_checkpoint(tmp_path, ddp, opt, extra=lambda: 0)  # not picklable
    with pytest.raises(distopt.CheckpointError, match="does not exist"):
        distopt.load_checkpoint(tmp_path / "nothing", ddp, opt)
    with pytest.raises(distopt.CheckpointError, match="neither a distopt checkpoint"):
        distopt.load_checkpoint(tmp_path, ddp, opt)
    assert list(tmp_path.iterdir()) == []  # the failed saves left nothing behind


def test_state_dict_format_and_round_trip():
    model, ddp, opt = build()
    train(ddp, opt, range(3))
    sd = opt.state_dict()
    assert sd["format"] == "distopt.optimizer/1"
    assert sd["optimizer"] == "torch.optim.adamw.AdamW"
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(sd["param_groups"][0]["params"]) == sorted(names)
    for name, p in model.named_parameters():
        if p.requires_grad:
            # Boxes of the param's shape that DCP reshards, viewing the flat shard
            # (checkpoint/reshardable.py); as_shard gives the shard.
            assert sd["main_params"][name].shape == p.shape
            shard = as_shard(sd["main_params"][name])
            assert (shard.offset, shard.numel, shard.local.numel()) == (0, p.numel(), p.numel())
            assert torch.equal(shard.local, p.detach().reshape(-1))
            assert set(sd["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
            assert sd["state"][name]["step"].dim() == 0
    snapshot = copy.deepcopy(sd)
    train(ddp, opt, range(3, 6))
    expected = values(model)
    opt.load_state_dict(snapshot)
    train(ddp, opt, range(3, 6))
    assert same(values(model), expected)  # bitwise: the whole state came back

    other = build(cls=torch.optim.SGD)
    with pytest.raises(distopt.CheckpointError, match="torch.optim.adamw.AdamW"):
        other[2].load_state_dict(snapshot)
    cut = copy.deepcopy(snapshot)
    shard = as_shard(cut["main_params"]["l1.weight"])
    cut["main_params"]["l1.weight"] = FlatShard(shard.local[5:], 5, shard.numel)
    before = values(model)
    with pytest.raises(distopt.CheckpointError, match=r"holds elements \[5, 42\)"):
        opt.load_state_dict(cut)
    assert same(values(model), before)
    # Shards of several ranks, merged, cover the parameter again.
    halves = copy.deepcopy(snapshot), copy.deepcopy(snapshot)
    for index, half in enumerate(halves):
        for entries in [half["main_params"], *half["state"].values()]:
            for key, value in entries.items():
                value = as_shard(value)
                if isinstance(value, FlatShard):
                    cut_at = value.numel // 2
                    lo, hi = (0, cut_at) if index == 0 else (cut_at, value.numel)
                    entries[key] = FlatShard(value.local[lo:hi], lo, value.numel)
    opt.load_state_dict(merge_state_dicts(list(halves)))
    train(ddp, opt, range(3, 6))
    assert same(values(model), expected)


def test_loss_scaler_state_survives(tmp_path):
    def scaler():
        return distopt.DynamicLossScaler(initial_scale=2.0**19, growth_interval=2, hysteresis=1)

    model, ddp, opt = build(torch.float16, scaler())
    updated = train(ddp, opt, range(8))
    assert not all(updated) and any(updated)  # steps were skipped, and the scale moved
    distopt.save_checkpoint(tmp_path, ddp, opt)
    state = opt.loss_scaler.state_dict()
    train(ddp, opt, range(8, 12))
    expected = values(model)

    fresh, fresh_ddp, fresh_opt = build(torch.float16, scaler())
    distopt.load_checkpoint(tmp_path, fresh_ddp, fresh_opt)
    assert fresh_opt.loss_scaler.state_dict() == state != scaler().state_dict()
    train(fresh_ddp, fresh_opt, range(8, 12))
    assert same(values(fresh), expected)
    plain = build(torch.float16)
    with pytest.raises(distopt.CheckpointError, match="loss scaler DynamicLossScaler"):
        distopt.load_checkpoint(tmp_path, plain[1], plain[2])


def test_basic_optimizer_checkpoint_loads_into_distributed_optimizer(tmp_path):
    torch.manual_seed(0)
    module = mlp([8, 16, 4])
    basic = distopt.BasicOptimizer(module, torch.optim.SGD, lr=0.1, momentum=0.9)
    x = torch.randn(6, 8)
    for _ in range(3):
        basic.zero_grad()
        module(x).square().mean().backward()
        basic.step()
    distopt.save_checkpoint(tmp_path, module, basic)
    torch.manual_seed(1)
    model = mlp([8, 16, 4])
    ddp = distopt.DistributedDataParallel(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1, momentum=0.9)
    distopt.load_checkpoint(tmp_path, ddp, opt)
    for _ in range(2):
        for o, fwd in ((basic, module), (opt, ddp)):
            o.zero_grad()
            fwd(x).square().mean().backward()
            o.step()
    assert same(values(model), values(module))


def _chunks(seed: int):
    """Two model chunks, each its own DDP, under one optimizer: (modules, DDPs, optimizer)."""
    torch.manual_seed(seed)
    first, second = mlp([4, 6]), mlp([6, 3])
    ddps = [distopt.DistributedDataParallel(m) for m in (first, second)]
    return (first, second), ddps, distopt.DistributedOptimizer(ddps, torch.optim.AdamW)


def _chunks_step(models, opt) -> None:
    opt.zero_grad()
    models[1](models[0](torch.ones(2, 4))).sum().backward()
    opt.step()


def _chunks_resume_as_the_saver(run, models, opt) -> None:
    """Fresh chunks (another seed) loaded from ``run`` take their next step as the chunks that
    saved it do, bit for bit."""
    fresh, fresh_ddps, fresh_opt = _chunks(1)
    distopt.load_checkpoint(run, fresh_ddps, fresh_opt)
    _chunks_step(models, opt)
    _chunks_step(fresh, fresh_opt)
    for a, b in zip(models, fresh, strict=True):
        assert same(values(a), values(b))


def test_model_chunks_save_load_and_export(tmp_path):
    models, ddps, opt = _chunks(0)
    _chunks_step(models, opt)
    saved = distopt.save_checkpoint(tmp_path / "run", ddps, opt)
    assert sorted(opt.state_dict()["main_params"]) == [
        "chunk0.0.bias", "chunk0.0.weight", "chunk1.0.bias", "chunk1.0.weight"]
    # torch's layout, each chunk's entries under its prefix.
    import torch.distributed.checkpoint as dcp

    paths = {tuple(p) for p in dcp.FileSystemReader(saved).read_metadata().planner_data.values()}
    assert {p for p in paths if p[0] == "model"} == {
        ("model", f"chunk{i}.0.{k}") for i in range(2) for k in ("weight", "bias")}
    assert {p[2] for p in paths if p[:2] == ("optimizer", "state")} == {
        f"chunk{i}.0.{k}" for i in range(2) for k in ("weight", "bias")}
    _chunks_resume_as_the_saver(tmp_path / "run", models, opt)
    out = distopt.export_checkpoint(tmp_path / "run", tmp_path / "chunks.pt")
    exported = torch.load(out, weights_only=True)
    assert [list(sd) for sd in exported["model"]] == [["0.weight", "0.bias"]] * 2
    assert sorted(exported["optimizer"]["state"]) == [0, 1, 2, 3]


def test_model_chunks_of_the_earlier_layout_load(tmp_path):
    """Chunks saved in the earlier layout (``main/chunk0.…``) load and train on exactly as
    the run that saved them."""
    from distopt.checkpoint import layout

    models, ddps, opt = _chunks(0)
    _chunks_step(models, opt)
    layout.write_earlier_layout = True
    try:
        saved = distopt.save_checkpoint(tmp_path / "run", ddps, opt)
    finally:
        layout.write_earlier_layout = False
    import torch.distributed.checkpoint as dcp

    assert "main/chunk1.0.weight" in dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    _chunks_resume_as_the_saver(tmp_path / "run", models, opt)


def test_export_master_weights_and_cli(tmp_path, capsys):
    model, ddp, opt = build(torch.bfloat16)
    train(ddp, opt, range(2))
    run = tmp_path / "run"
    distopt.save_checkpoint(run, ddp, opt)
    main = {n: as_shard(s).local.reshape(dict(model.named_parameters())[n].shape)
            for n, s in opt.state_dict()["main_params"].items()}
    assert cli_main(["export", str(run), str(tmp_path / "bf16.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    exported = torch.load(tmp_path / "bf16.pt", weights_only=True)["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], value)
    assert cli_main(["export", "--master-weights", str(run), str(tmp_path / "fp32.pt")]) == 0
    exported = torch.load(tmp_path / "fp32.pt", weights_only=True)["model"]
    for name, value in main.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], value)
    assert not torch.equal(exported["l1.weight"], model.l1.weight.float())  # more precise

    assert cli_main(["export", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distopt export: error: no checkpoint at")


def test_plain_checkpoint_is_checked_before_anything_changes(tmp_path):
    model, ddp, opt = build()
    train(ddp, opt, range(2))
    before = values(model), copy.deepcopy(opt.state_dict())
    wrong = {"model": nn.Linear(2, 2).state_dict(), "optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(distopt.CheckpointError, match="of another model"):
        distopt.load_plain_checkpoint(wrong, ddp, opt)
    with pytest.raises(distopt.CheckpointError, match="'optimizer'"):
        distopt.load_plain_checkpoint({"model": model.state_dict()}, ddp, opt)
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": [
        {"params": [0, 1]}]}}, tmp_path / "few.pt")
    with pytest.raises(distopt.CheckpointError, match="the optimizer state has 2 params"):
        distopt.load_plain_checkpoint(tmp_path / "few.pt", ddp, opt)
    assert same(values(model), before[0])
    after = opt.state_dict()
    for name, entries in before[1]["state"].items():
        assert torch.equal(as_shard(entries["exp_avg"]).local,
                           as_shard(after["state"][name]["exp_avg"]).local)


def _memory_benchmark(workdir: Path) -> list[Command]:
    """benchmarks/checkpoint_memory.py in a process of its own, writing WORKDIR/memory.json;
    no command where Linux's /proc/self/clear_refs, which it measures with, is missing."""
    if not Path("/proc/self/clear_refs").exists():
        return []
    shm = Path("/dev/shm")  # memory, not disk: no fsync to wait for (the files take 0.8 GB)
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 << 30
    where = shm if roomy else workdir
    return [Command([sys.executable, str(ROOT / "benchmarks" / "checkpoint_memory.py"),
                     "--params", "26", "--numel", str(2**20), "--dir", str(where),
                     "--json", str(workdir / "memory.json")],
                    {"PYTHONPATH": os.pathsep.join(sys.path)})]


# Started with the session (see early_launches.py).
MEMORY_BENCHMARK = launch_early("test_save_load_export_memory_is_bounded", _memory_benchmark)


@pytest.mark.slow
def test_save_load_export_memory_is_bounded():
    """Peak RSS above the start of each operation, in a process of its own, on a model whose
    AdamW state (208 MiB) is 17 times the bound: 3 x the largest parameter (4 MiB)."""
    launched = MEMORY_BENCHMARK.result()
    if not launched:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    (proc,) = launched
    out = MEMORY_BENCHMARK.workdir / "memory.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    bound = 3 * result["largest_param_MiB"]
    assert result["optimizer_state_MiB"] >= 16 * bound
    for op in ("save", "load", "export"):
        assert result[f"{op}_peak_MiB"] <= bound, result
    assert result["checkpoint_MiB"] > 3 * result["optimizer_state_MiB"] / 2  # it all got written


def test_pickled_state_dicts_load_across_versions():
    """opt.state_dict() saved with torch.save loads back, and so does one of earlier versions,
    whose entries were flat shards: under FlatShard's public module, and under the module that
    held it before (distopt.checkpoint_state)."""
    import io
    import pickle

    model, ddp, opt = build()
    train(ddp, opt, range(2))
    name = next(n for n, p in model.named_parameters() if p.requires_grad)
    today = io.BytesIO()
    torch.save(opt.state_dict(), today)
    today.seek(0)
    opt.load_state_dict(torch.load(today, weights_only=False))
    live = opt.state_dict()
    sd = {**live, "main_params": {n: as_shard(v) for n, v in live["main_params"].items()},
          "state": {n: {k: as_shard(v) for k, v in entries.items()}
                    for n, entries in live["state"].items()}}
    fresh = io.BytesIO()
    torch.save(sd, fresh)
    assert b"distopt.checkpoint\nFlatShard" in fresh.getvalue()
    FlatShard.__module__ = "distopt.checkpoint_state"
    try:
        old = io.BytesIO()
        torch.save(sd, old)
    finally:
        FlatShard.__module__ = "distopt.checkpoint"
    assert b"distopt.checkpoint_state\nFlatShard" in old.getvalue()
    for data in (fresh, old):
        data.seek(0)
        loaded = torch.load(data, weights_only=False)
        shard = loaded["main_params"][name]
        assert isinstance(shard, FlatShard)
        assert torch.equal(shard.local, sd["main_params"][name].local)
        opt.load_state_dict(loaded)
    assert pickle.loads(pickle.dumps(FlatShard(torch.ones(2), 1, 3))).offset == 1
