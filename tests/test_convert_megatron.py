"""``distopt convert``: a Megatron-Core run brought to distopt, FSDP2 and torch DDP.

Megatron-Core (the ``peers`` install, with the shims of [Note: peers on CPU] in
distopt/bench/peers.py) trains the MLP of test_torch_dcp_state_dict.py at d = 2 with its
``DistributedDataParallel`` and ``DistributedOptimizer`` (Adam with decoupled weight decay:
torch's ``AdamW``, fp32, no clipping), on the same global batches (each rank its rows), saves
with ``dist_checkpointing.save`` after ``SAVED_AT`` steps and goes on to ``STEPS``. ``distopt
convert`` turns the save into a DCP checkpoint in torch's layout; torch's recipe resumes it
under another system at another d, with Megatron's two param groups (weights; biases, which
its default rule exempts from weight decay through ``wd_mult``), and trains to ``STEPS``: the
params must end where Megatron's uninterrupted run ends. A conversion that lost a step, an
``exp_avg``, a param group's options or put a param in the wrong group moves the weights by
about lr = 1e-2.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_convert import _left_behind, modules_a_conversion_imports
from test_convert import assert_ends_where_deepspeed_ends as assert_ends_where_it_ends
from test_convert import resume as resume_converted
from test_torch_dcp_state_dict import LR, SAVED_AT, STEPS, _batch, _model
from torch import nn

from distopt.checkpoint import CheckpointError
from distopt.checkpoint.convert import convert
from distopt.cli import main as cli

from dist_harness import case_result, run_cases

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="Megatron-Core is not installed (make peers)")

SAVED_D = 2
SHARDINGS = ("fully_reshardable", "dp_reshardable")


def megatron_run(root: str) -> dict[str, list[float]]:
    """Megatron-Core at d = 2: saved after SAVED_AT steps (in each sharding of SHARDINGS),
    trained to STEPS; its final params, as lists."""
    from megatron_cpu import megatron_saving_on_cpu

    from distopt.bench.peers import (
        _cuda_calls_on_cpu,
        import_megatron,
        megatron_built_on_cpu,
        megatron_stepping_on_cpu,
    )

    mc = import_megatron()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.transformer.module import MegatronModule

    config = mc.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)

    class Net(MegatronModule):
        """The MLP's layers as this module's children: its sharded keys are their FQNs."""

        def __init__(self) -> None:
            super().__init__(config)
            for name, layer in _model().named_children():
                self.add_module(name, layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.children():
                x = layer(x)
            return x

    parallel_state.initialize_model_parallel(1, 1)
    try:
        net = Net()
        with megatron_built_on_cpu():
            ddp = mc.DistributedDataParallel(
                config, mc.DistributedDataParallelConfig(use_distributed_optimizer=True), net)
            opt = mc.get_megatron_optimizer(mc.OptimizerConfig(
                optimizer="adam", lr=LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=True), [ddp])
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(STEPS):
            if step == SAVED_AT:
                for sharding in SHARDINGS:
                    path = Path(root) / sharding
                    path.mkdir(parents=True, exist_ok=True)
                    with megatron_saving_on_cpu():
                        msd = net.sharded_state_dict()
                        osd = opt.sharded_state_dict(
                            msd, metadata={"distrib_optim_sharding_type": sharding})
                        dist_checkpointing.save({"model": msd, "optimizer": osd}, str(path))
            x, y = (t[rank::world] for t in _batch(step))
            ddp.zero_grad_buffer()
            opt.zero_grad()
            with _cuda_calls_on_cpu():
                nn.functional.mse_loss(ddp(x), y).backward()
                ddp.finish_grad_sync()
            with megatron_stepping_on_cpu():
                opt.step()
        return {name: p.detach().reshape(-1).tolist() for name, p in net.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()
        # torch_dist's writer starts a multiprocessing Manager for its results queue; ended
        # here, or it outlives this worker (whose pool is ended) and holds the suite's output.
        for child in multiprocessing.active_children():
            child.terminate()
            child.join()


def _groups(params: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """Megatron's two groups: weights; biases and 1-D params."""
    no_decay = [p for n, p in params if n.endswith(".bias") or p.dim() == 1]
    decay = [p for n, p in params if not (n.endswith(".bias") or p.dim() == 1)]
    return [{"params": decay}, {"params": no_decay}]


def resume(system: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """test_convert's resume, with Megatron's two param groups."""
    return resume_converted(system, checkpoint, _groups)


_RUN: dict[str, tuple[Path, dict[str, list[float]]]] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path, dict[str, list[float]]]:
    """Megatron's run (once per session): its saves, each converted (the fully_reshardable
    one to dcp, the others to dcp-<sharding>), and its final params."""
    if "run" not in _RUN:
        root = tmp_path_factory.mktemp("megatron")
        results = run_cases(SAVED_D, [("megatron", megatron_run, (str(root),))], end_pool=True)
        final = case_result(results, "megatron")[0]
        for sharding in SHARDINGS:
            assert cli(["convert", str(root / sharding), str(root / _converted(sharding))]) == 0
        _RUN["run"] = root, final
    root, final = _RUN["run"]
    return root, root / "dcp", final


def _converted(sharding: str) -> str:
    return "dcp" if sharding == "fully_reshardable" else f"dcp-{sharding}"


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_megatron_run_resumes_under_distopt(saved, sharding):
    """The fast case: saved at d = 2 (in each sharding), resumed under distopt at d = 2."""
    root, _, final = saved
    dst = root / _converted(sharding)
    ends = case_result(run_cases(2, [("distopt<-megatron", resume,
                                      ("distopt-optim", str(dst)))]), "distopt<-megatron")
    for rank_ends in ends:
        assert_ends_where_it_ends(rank_ends, final)


def test_the_groups_carry_megatrons_options_and_membership(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, dst, _ = saved
    dcp_to_torch_save(dst, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    groups = whole["optimizer"]["param_groups"]
    assert {k: v["step"].item() for k, v in whole["optimizer"]["state"].items()} == {
        n: float(SAVED_AT) for n in ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                     "4.bias"]}
    assert [sorted(g["params"]) for g in groups] == [
        ["0.weight", "2.weight", "4.weight"], ["0.bias", "2.bias", "4.bias"]]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    assert all(g["lr"] == LR and g["weight_decay"] == 0.01 and "step" not in g for g in groups)


LOADERS = ["distopt-optim", "distopt-grads", "distopt-params", "fsdp", "torch"]


@pytest.fixture(scope="module")
def at_three(saved):
    root = saved[0]
    return run_cases(3, [(f"{loader}<-megatron-{sharding}", resume,
                          (loader, str(root / _converted(sharding))))
                         for sharding in SHARDINGS for loader in LOADERS])


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("loader", LOADERS)
def test_a_megatron_run_resumes_at_three_under_each_system(saved, at_three, loader, sharding):
    for rank_ends in case_result(at_three, f"{loader}<-megatron-{sharding}"):
        assert_ends_where_it_ends(rank_ends, saved[2])


# ---------------------------------------------------------------- bad sources


@pytest.fixture
def source(saved, tmp_path) -> Path:
    """A copy of Megatron's fully_reshardable save, to damage."""
    return Path(shutil.copytree(saved[0] / "fully_reshardable", tmp_path / "copy"))


def test_a_missing_data_file_is_named_and_nothing_is_written(source, tmp_path, capsys):
    victim = sorted(source.glob("*.distcp"))[-1]
    victim.unlink()
    dst = tmp_path / "out"
    assert cli(["convert", str(source), str(dst), "--from", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "is partial" in err and victim.name in err
    assert _left_behind(dst) == []


def test_a_truncated_data_file_is_refused(source, tmp_path):
    victim = sorted(source.glob("*.distcp"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{victim.name} is truncated"):
        convert(source, tmp_path / "out")


def test_a_missing_backend_file_or_metadata_is_named(source, tmp_path):
    (source / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="metadata.json"):
        convert(source, tmp_path / "out", "megatron")
    (source / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no \.metadata"):
        convert(source, tmp_path / "out", "megatron")


def test_megatron_lms_iteration_directories_are_followed(source, tmp_path):
    (tmp_path / "run").mkdir()
    source.rename(tmp_path / "run" / "iter_0000002")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("2\n")
    converted = convert(tmp_path / "run", tmp_path / "out")
    assert sorted(converted.model) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias",
                                       "4.weight"]
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="iter_0000007 is missing"):
        convert(tmp_path / "run", tmp_path / "out2")


def _whole(dst: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dst, tmp_path / f"{dst.name}.pt")
    return torch.load(tmp_path / f"{dst.name}.pt", weights_only=False)


def test_the_bucket_sharding_converts_bit_for_bit_as_the_named_one(saved, tmp_path):
    """dp_reshardable's flat buckets, placed by Megatron-Core's layout, give each param's
    master, exp_avg and exp_avg_sq exactly as fully_reshardable names them (whose masters
    are Megatron's fp32 params: the resumes above end where its run ends)."""
    root = saved[0]
    named, buckets = (_whole(root / _converted(s), tmp_path) for s in SHARDINGS)
    assert sorted(buckets["model"]) == sorted(named["model"])
    for fqn, value in named["model"].items():
        assert torch.equal(buckets["model"][fqn], value), fqn
    def groups(whole: dict) -> list[dict]:  # a group's params are keyed by FQN: any order
        return [{**g, "params": sorted(g["params"])} for g in whole["optimizer"]["param_groups"]]

    assert groups(buckets) == groups(named)
    for fqn, state in named["optimizer"]["state"].items():
        assert sorted(buckets["optimizer"]["state"][fqn]) == sorted(state)
        for name, value in state.items():
            assert torch.equal(buckets["optimizer"]["state"][fqn][name], value), (fqn, name)


def test_bucket_places_that_do_not_match_the_params_are_refused(saved, tmp_path, monkeypatch):
    from distopt.checkpoint import from_megatron

    placed = from_megatron.buckets.places

    def out_of_order(tensors, params, where):
        # Megatron-Core's order is model.parameters(): any other misplaces the params
        return placed(tensors, [params[1], params[0], *params[2:]], where)

    monkeypatch.setattr(from_megatron.buckets, "places", out_of_order)
    with pytest.raises(CheckpointError, match="'0.weight'.*does not fall where.*fully_reshardable"):
        convert(saved[0] / "dp_reshardable", tmp_path / "out")

    def swapped(tensors, params, where):  # places that the chunks allow, values refute
        out = placed(tensors, params, where)
        out["0.bias"], out["2.bias"] = out["2.bias"], out["0.bias"]
        return out

    monkeypatch.setattr(from_megatron.buckets, "places", swapped)
    with pytest.raises(CheckpointError, match="place derived for '.\\.bias' does not hold"):
        convert(saved[0] / "dp_reshardable", tmp_path / "out")
    assert _left_behind(tmp_path / "out") == []


def test_the_source_is_read_without_megatron(source, tmp_path):
    """Not one of Megatron-Core's modules is imported by a conversion."""
    assert modules_a_conversion_imports(source, tmp_path / "out", "megatron") == "[]"
