"""``save_checkpoint`` of pipeline stages in torch's layout ([Note: torch's layout on disk] in
checkpoint/layout.py): each stage writes its params under the whole model's FQNs (the tie
once, by the first stage), so the checkpoint of a run at (pp, dp) = (2, 1) resumes at (1, 2)
unpipelined and at (2, 1) under distopt, and in the unpipelined model under torch DDP with
torch's own recipe, in processes that never import distopt (tests/torch_resume_stages.py); and
a checkpoint of stages in the earlier layout (``main/``, ``state/``, ``model/``) still loads.

Every run trains the same model on the same global batches, so each follows the trajectory of
one process with torch's AdamW on the whole batch: ``torch_resume_stages.reference()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_pipeline import pipeline_step, pp_dp_mesh
from torch.distributed.pipelining import ScheduleGPipe
from torch_resume_stages import (
    BATCH,
    LR,
    SAVED_AT,
    STEPS,
    batch,
    loss_fn,
    model,
    reference,
    stage_of,
)

import distopt
from distopt.checkpoint import layout
from distopt.pipelining import PipelineStage

from dist_harness import case_result, run_cases
from helpers import FP32_TOL

MICRO_BATCHES = 4


def train(pp: int, dp: int, start: int, stop: int, load: str | None = None,
          save: str | None = None, earlier: bool = False) -> dict:
    """Steps ``start`` to ``stop`` at (pp, dp) (pp = 1: the whole model), from the run
    directory ``load`` if given, saving into ``save`` at the end (``earlier``: in the earlier
    layout); the params this rank holds, by the whole model's names, and what the save wrote."""
    mesh, pp_rank, dp_rank = pp_dp_mesh(pp, dp)
    module, tied = stage_of(model(), pp_rank, pp)
    ddp = distopt.DistributedDataParallel(module, device_mesh=mesh, tied_params=tied)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)
    if load is not None:
        distopt.load_checkpoint(load, ddp, opt)
    sched = None
    if pp > 1:
        sched = ScheduleGPipe(PipelineStage(ddp, pp_rank, pp, torch.device("cpu")),
                              n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    per = BATCH // dp
    for step in range(start, stop):
        x, y = (t[dp_rank * per : (dp_rank + 1) * per] for t in batch(step))
        opt.zero_grad()
        if sched is None:
            loss_fn(ddp(x), y).backward()
        else:
            pipeline_step(sched, pp_rank, pp, x, y)
        opt.step()
    saved = None
    if save is not None:
        layout.write_earlier_layout = earlier
        try:
            saved = str(distopt.save_checkpoint(save, ddp, opt))
        finally:
            layout.write_earlier_layout = False
    ddp.finish_param_sync()
    params = {("wte.weight" if n == "head.weight" else n): p.detach().clone()
              for n, p in module.named_parameters()}
    return {"params": params, "saved": saved}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    new, old = str(root / "torch"), str(root / "earlier")
    cases = [("save", train, (2, 1, 0, SAVED_AT, None, new)),
             ("save-earlier", train, (2, 1, 0, SAVED_AT, None, old, True)),
             ("resume-1x2", train, (1, 2, SAVED_AT, STEPS, new)),
             ("resume-2x1", train, (2, 1, SAVED_AT, STEPS, new)),
             ("resume-earlier-1x2", train, (1, 2, SAVED_AT, STEPS, old))]
    return run_cases(2, cases)


def _ended(ranks: list[dict]) -> dict[str, torch.Tensor]:
    return {n: p for rank in ranks for n, p in rank["params"].items()}


def _assert_ends_where_one_process_ends(got: dict[str, torch.Tensor]) -> None:
    # The same sums in other orders (micro-batches, DP ranks), which AdamW carries
    # (helpers.FP32_TOL); a lost or doubled step moves weights by lr = 1e-2.
    want = {n.removeprefix("param/"): v for n, v in reference().items()
            if n.startswith("param/")}
    assert sorted(got) == sorted(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst < FP32_TOL, worst


def _paths(ckpt: str) -> set[tuple]:
    data = dcp.FileSystemReader(ckpt).read_metadata().planner_data
    return {tuple(p) for p in data.values()}


def test_the_stages_write_torch_s_layout_under_the_whole_model_s_fqns(runs):
    ckpt = case_result(runs, "save")[0]["saved"]
    manifest = json.loads((Path(ckpt) / "distopt.json").read_text())
    assert manifest["layout"] == "torch"
    assert manifest["pipeline"] == {
        "stages": [["wte.weight", "wpe.weight", "layers.0.weight", "layers.0.bias"],
                   ["layers.1.weight", "layers.1.bias", "wte.weight"]],
        "tied": ["wte.weight"]}
    paths = _paths(ckpt)
    whole = model()
    assert {p for p in paths if p[0] == "model"} == {("model", k) for k in whole.state_dict()}
    # The tie's state once, under the FQN torch's optimizer state dict gives it.
    assert {p[:3] for p in paths if p[:2] == ("optimizer", "state")} == {
        ("optimizer", "state", n) for n, _ in whole.named_parameters()}
    assert {p[3] for p in paths if p[:2] == ("optimizer", "state")} == {
        "step", "exp_avg", "exp_avg_sq"}
    assert ("optimizer", "param_groups", 0, "params") in paths
    assert all(p[0] in ("model", "optimizer", "distopt") for p in paths)


@pytest.mark.parametrize("name", ["resume-1x2", "resume-2x1", "resume-earlier-1x2"])
def test_a_stages_checkpoint_resumes_at_another_layout(runs, name):
    _assert_ends_where_one_process_ends(_ended(case_result(runs, name)))


def test_the_earlier_layout_of_stages_is_what_the_earlier_release_wrote(runs):
    ckpt = case_result(runs, "save-earlier")[0]["saved"]
    assert "layout" not in json.loads((Path(ckpt) / "distopt.json").read_text())
    assert ("main/layers.1.weight",) in {(k,) for k in
                                         dcp.FileSystemReader(ckpt).read_metadata()
                                         .state_dict_metadata}


@pytest.fixture(scope="module")
def torch_resumed(runs, tmp_path_factory):
    """The pipelined run's checkpoint resumed at d = 2 in the unpipelined model by torch DDP,
    without distopt."""
    out = tmp_path_factory.mktemp("torch-resumed-stages") / "ends.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, str(Path(__file__).parent / "torch_resume_stages.py"),
                    str(out), "2", case_result(runs, "save")[0]["saved"]],
                   check=True, env=env, timeout=600)
    return torch.load(out)


def test_torch_ddp_resumes_the_stages_checkpoint_in_the_whole_model(torch_resumed):
    assert torch_resumed["distopt_imported"] is False
    want = reference()
    for got in torch_resumed["ends"]:
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if key.startswith("step/"):
                assert torch.equal(got[key], value), key
                continue
            bound = FP32_TOL * max(value.abs().max().item(), 1.0)
            if key.startswith("exp_avg_sq"):  # squares of grads: relative to their scale
                bound = 2 * FP32_TOL * value.abs().max().item()
            assert (got[key] - value).abs().max().item() <= bound, key
