"""``distopt convert``: a DeepSpeed ZeRO run brought to distopt, FSDP2 and torch DDP.

DeepSpeed (the ``peers`` extra) trains the MLP of test_torch_dcp_state_dict.py at d = 2 with a
client ``torch.optim.AdamW``, on the same global batches (each rank its rows), saves with
``engine.save_checkpoint`` after ``SAVED_AT`` steps and goes on to ``STEPS``. ``distopt
convert`` turns the save into a DCP checkpoint in torch's layout, and torch's recipe
(``get_state_dict``, ``dcp.load``, ``set_state_dict``) resumes it under another system at
another d, which trains to ``STEPS``: its params must end where DeepSpeed's uninterrupted run
ends. A conversion that lost a step, an ``exp_avg`` or a piece of a param (every shape here
is cut across DeepSpeed's partitions) moves the weights by about lr = 1e-2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_torch_dcp_state_dict import LR, ROWS, SAVED_AT, STEPS, _batch, _build, _model, _train
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distopt.checkpoint import CheckpointError
from distopt.checkpoint.convert import convert
from distopt.cli import main as cli

from dist_harness import case_result, run_cases
from helpers import FP32_TOL

SAVED_D = 2


def deepspeed_run(stage: int, root: str) -> dict[str, list[float]]:
    """DeepSpeed ZeRO-``stage`` at d = 2: saved after SAVED_AT steps, trained to STEPS; its
    final params, as lists (a tensor pickled here could name DeepSpeed's classes)."""
    from distopt.bench.peers import import_deepspeed

    deepspeed = import_deepspeed()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    deepspeed.init_distributed("gloo")
    model = _model()
    config = {"train_micro_batch_size_per_gpu": ROWS // SAVED_D,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
              "steps_per_print": 2**31, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        if step == SAVED_AT:
            engine.save_checkpoint(str(Path(root) / f"zero{stage}"))
        x, y = (t[rank::world] for t in _batch(step))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        return {name: p.detach().reshape(-1).tolist() for name, p in params.items()}


def resume(system: str, checkpoint: str, groups: Any = None) -> dict[str, torch.Tensor]:
    """torch's recipe under ``system`` at this d (AdamW over ``groups`` of the model's named
    params, or over all of them), then training to STEPS: the final params."""
    model, opt = _build(system, groups)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _train(model, opt, range(SAVED_AT, STEPS))
    if hasattr(model, "finish_param_sync"):
        model.finish_param_sync()
        return {k: v.detach().clone() for k, v in model.full_state_dict().items()}
    return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for n, p in model.named_parameters()}


_RUNS: dict[int, tuple[Path, dict[str, list[float]]]] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


def deepspeed_saved(stage: int, root: Path) -> tuple[Path, dict[str, list[float]]]:
    """DeepSpeed's run at ``stage`` (once per session): its save converted by ``distopt
    convert``, and its final params."""
    if stage not in _RUNS:
        results = run_cases(SAVED_D, [(f"zero{stage}", deepspeed_run, (stage, str(root)))],
                            end_pool=True)
        final = case_result(results, f"zero{stage}")[0]
        dst = root / f"zero{stage}-dcp"
        assert cli(["convert", str(root / f"zero{stage}"), str(dst)]) == 0
        _RUNS[stage] = dst, final
    return _RUNS[stage]


def assert_ends_where_deepspeed_ends(ends: dict[str, torch.Tensor],
                                     final: dict[str, list[float]]) -> None:
    # Both runs follow the one-process trajectory within the suite's bound for AdamW's fp32
    # drift (helpers.FP32_TOL, two runs and orders not tried); weights here are of size ~1.
    assert set(ends) == set(final)
    for name, values in final.items():
        theirs = torch.tensor(values, dtype=torch.float64)
        diff = (ends[name].double().reshape(-1) - theirs).abs().max().item()
        assert diff <= FP32_TOL * max(1.0, theirs.abs().max().item()), (name, diff)


def test_a_zero2_run_resumes_under_distopt(root):
    """The fast case: ZeRO-2 at d = 2, resumed under distopt at d = 2."""
    dst, final = deepspeed_saved(2, root)
    ends = case_result(run_cases(2, [("distopt", resume, ("distopt-optim", str(dst)))]),
                       "distopt")
    for rank_ends in ends:
        assert_ends_where_deepspeed_ends(rank_ends, final)


LOADERS = ["distopt-optim", "distopt-grads", "distopt-params", "fsdp", "torch"]


@pytest.fixture(scope="module")
def at_three(root):
    saved = {stage: deepspeed_saved(stage, root) for stage in (1, 2, 3)}
    cases = [(f"{loader}<-zero{stage}", resume, (loader, str(dst)))
             for stage, (dst, _) in saved.items() for loader in LOADERS]
    return saved, run_cases(3, cases)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("loader", LOADERS)
def test_every_zero_stage_resumes_at_three_under_each_system(at_three, stage, loader):
    saved, results = at_three
    for rank_ends in case_result(results, f"{loader}<-zero{stage}"):
        assert_ends_where_deepspeed_ends(rank_ends, saved[stage][1])


# ---------------------------------------------------------------- bad sources


@pytest.fixture
def source(root, tmp_path):
    """A copy of DeepSpeed's ZeRO-2 save (its tag directory), to damage."""
    import shutil

    deepspeed_saved(2, root)
    tag = root / "zero2" / (root / "zero2" / "latest").read_text().strip()
    return Path(shutil.copytree(tag, tmp_path / "zero2-copy"))


def _left_behind(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if dst.name in p.name)


def test_a_partial_source_names_what_is_missing_and_writes_nothing(source, tmp_path, capsys):
    (source / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    dst = tmp_path / "out"
    assert cli(["convert", str(source), str(dst)]) == 2
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt are missing" in capsys.readouterr().err
    assert _left_behind(dst) == []


def test_a_missing_model_states_file_is_named(source, tmp_path):
    (source / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt"):
        convert(source, tmp_path / "out")


def test_a_truncated_rank_file_is_refused(source, tmp_path):
    path = source / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        convert(source, tmp_path / "out")


def test_a_failure_while_writing_leaves_nothing(source, tmp_path, monkeypatch):
    from distopt.checkpoint import from_deepspeed

    gather, calls = from_deepspeed._gather, []

    def failing(*args):  # the third tensor written fails, as a read error would
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return gather(*args)

    monkeypatch.setattr(from_deepspeed, "_gather", failing)
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="disk gone"):
        convert(source, dst)
    assert _left_behind(dst) == []


def test_an_existing_destination_or_an_unknown_source_is_refused(source, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="exists"):
        convert(source, tmp_path / "taken")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="--from"):
        convert(tmp_path / "empty", tmp_path / "out")


def modules_a_conversion_imports(source: Path, out: Path, prefix: str) -> str:
    """The modules named ``prefix...`` that ``convert(source, out)`` imports, run in a fresh
    interpreter: the printed sorted list."""
    import subprocess
    import sys

    code = ("import sys; from distopt.checkpoint.convert import convert; "
            f"convert({str(source)!r}, {str(out)!r}); "
            f"print(sorted(m for m in sys.modules if m.startswith({prefix!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return run.stdout.strip().splitlines()[-1]


def test_the_source_is_read_without_deepspeed(source, tmp_path):
    """Not one of DeepSpeed's modules is imported by a conversion (its pickles name them)."""
    assert modules_a_conversion_imports(source, tmp_path / "out", "deepspeed") == "[]"


# ---------------------------------------------------------------- bf16 with fp32 masters


def deepspeed_bf16_run(root: str) -> dict[str, list[float]]:
    """DeepSpeed ZeRO-2 with bf16 params (fp32 masters) at d = 2, saved after SAVED_AT steps:
    its bf16 params then, as lists. Its files are named bf16_zero_pp_rank_*."""
    from distopt.bench.peers import import_deepspeed

    deepspeed = import_deepspeed()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    deepspeed.init_distributed("gloo")
    model = _model()
    config = {"train_micro_batch_size_per_gpu": ROWS // SAVED_D, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
              "steps_per_print": 2**31, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(SAVED_AT):
        x, y = (t[rank::world].bfloat16() for t in _batch(step))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(Path(root) / "bf16"))
    return {name: p.detach().float().reshape(-1).tolist()
            for name, p in engine.module.named_parameters()}


def resume_bf16(checkpoint: str) -> dict[str, torch.Tensor]:
    """torch's recipe under distopt with bf16 params at this d: the fp32 masters and AdamW
    state it then holds, whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import distopt

    ddp = distopt.DistributedDataParallel(_model().bfloat16())
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)
    msd, osd = get_state_dict(ddp, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=checkpoint)
    set_state_dict(ddp, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(ddp, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"param/{k}": v.detach().float().clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{fqn}"] = state[key].detach().clone()
    return out


def test_a_bf16_run_with_fp32_masters_converts_and_resumes(root, tmp_path):
    """The masters (not the bf16 params) and the fp32 moments come through, exactly: distopt
    at d = 3 holds after the load what DeepSpeed saved, and its bf16 params are the masters
    rounded, as DeepSpeed's were."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    bf16_params = case_result(run_cases(SAVED_D, [("bf16", deepspeed_bf16_run, (str(root),))],
                                        end_pool=True), "bf16")[0]
    dst = root / "bf16-dcp"
    assert cli(["convert", str(root / "bf16"), str(dst)]) == 0
    dcp_to_torch_save(dst, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    for name, values in bf16_params.items():
        master = saved["model"][name]
        assert master.dtype == torch.float32
        assert torch.equal(master.bfloat16().float().reshape(-1), torch.tensor(values)), name
    masters = torch.cat([saved["model"][n].reshape(-1) for n in bf16_params])
    assert not torch.equal(masters, masters.bfloat16().float())  # more than bf16's bits
    held = case_result(run_cases(3, [("distopt<-bf16", resume_bf16, (str(dst),))]),
                       "distopt<-bf16")
    for rank_held in held:
        for name in bf16_params:
            assert torch.equal(rank_held[f"param/{name}"], saved["model"][name]), name
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(rank_held[f"{key}/{name}"],
                                   saved["optimizer"]["state"][name][key]), (key, name)
