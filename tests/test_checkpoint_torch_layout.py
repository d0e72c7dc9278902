"""``save_checkpoint`` in torch's layout ([Note: torch's layout on disk] in
checkpoint/layout.py): torch's own recipe (``get_state_dict``, ``dcp.load``,
``set_state_dict``) resumes it in torch DDP and FSDP2 at another data-parallel size, in
processes that never import distopt (tests/torch_resume.py), in every sharding mode; and a
checkpoint of the earlier layout (tests/data/v1-checkpoint, written before the change) still
loads, resumes bit for bit and exports.

Every run trains the same MLP on the same global batches (12 rows a step, each rank its rows),
so every system at every d follows the trajectory of one process with torch's AdamW on the
whole batch: ``torch_resume.reference()``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch_resume import LR, SAVED_AT, STEPS, batch, model, reference

import distopt

from dist_harness import case_result, run_cases
from helpers import FP32_TOL

MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}
V1 = Path(__file__).parent / "data" / "v1-checkpoint"


def build_distopt(mode: str):
    ddp = distopt.DistributedDataParallel(model(), **MODES[mode])
    return ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)


def train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = (t[rank::world] for t in batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def ends(ddp, opt) -> dict[str, torch.Tensor]:
    """Params and AdamW state, whole, keyed as torch_resume keys them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    ddp.finish_param_sync()
    out = {f"param/{n}": p.detach().clone() for n, p in ddp.full_state_dict().items()}
    full = get_optimizer_state_dict(ddp, opt, options=StateDictOptions(full_state_dict=True))
    for fqn, state in full["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{fqn}"] = state[key].detach().clone()
    return out


def save_after_two_steps(mode: str, root: str) -> str:
    ddp, opt = build_distopt(mode)
    train(ddp, opt, range(SAVED_AT))
    return str(distopt.save_checkpoint(Path(root) / mode, ddp, opt, extra={"step": SAVED_AT}))


def resume_v1(mode: str) -> dict:
    """The earlier layout's checkpoint (saved at d = 2 in shard_params), resumed here in
    ``mode``; and, at d = 2 in its own mode, the run that was never interrupted."""
    ddp, opt = build_distopt(mode)
    extra = distopt.load_checkpoint(V1, ddp, opt)
    train(ddp, opt, range(SAVED_AT, STEPS))
    out = {"extra": extra, "resumed": ends(ddp, opt)}
    if dist.get_world_size() == 2 and mode == "params":
        ddp, opt = build_distopt(mode)
        train(ddp, opt, range(STEPS))
        out["uninterrupted"] = ends(ddp, opt)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torch-layout"))
    results = run_cases(2, [(f"save-{m}", save_after_two_steps, (m, root)) for m in MODES])
    return {m: case_result(results, f"save-{m}")[0] for m in MODES}


@pytest.fixture(scope="module")
def torch_resumed(saved, tmp_path_factory):
    """Each mode's checkpoint resumed at d = 3 by torch DDP and by FSDP2, without distopt."""
    out = tmp_path_factory.mktemp("torch-resumed") / "ends.pt"
    jobs = [f"{saved[m]}:{system}" for m in MODES for system in ("torch", "fsdp")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, str(Path(__file__).parent / "torch_resume.py"), str(out),
                    "3", *jobs], check=True, env=env, timeout=600)
    return saved, torch.load(out)


# As test_torch_dcp_state_dict.py's TOL: round-off of another order of the same sums, which
# AdamW carries (helpers.FP32_TOL); a lost or doubled step moves weights by lr = 1e-2.
def _assert_near(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        diff = (got[key].double() - value.double()).abs().max().item()
        scale = value.double().abs().max().item()
        bound = FP32_TOL * max(scale, 1.0) if not key.startswith("exp_avg_sq") else (
            2 * FP32_TOL * scale)
        assert diff <= bound, (key, diff, scale)


def test_the_loading_processes_never_import_distopt(torch_resumed):
    assert torch_resumed[1]["distopt_imported"] is False


@pytest.mark.parametrize("system", ["torch", "fsdp"])
@pytest.mark.parametrize("mode", list(MODES))
def test_torch_resumes_a_save_checkpoint_at_another_size(torch_resumed, mode, system):
    saved, result = torch_resumed
    runs = result["ends"][f"{saved[mode]}:{system}"]
    assert len(runs) == 3
    want = reference()
    for got in runs:
        _assert_near(got, want)


def test_the_checkpoint_is_torch_s_layout_beside_distopt_s_manifest(saved):
    """DCP's keys are torch's nested ones; the manifest lists the files with their digests,
    which are those of the bytes on disk (taken as they were written)."""
    import json

    import torch.distributed.checkpoint as dcp

    from distopt.checkpoint import files

    ckpt = Path(saved["params"])
    manifest = json.loads((ckpt / "distopt.json").read_text())
    assert manifest["layout"] == "torch" and manifest["version"] == 3
    for name, listed in manifest["files"].items():
        assert files.checksum(ckpt / name) == listed, name
    paths = {tuple(p) for p in dcp.FileSystemReader(ckpt).read_metadata().planner_data.values()}
    names = [n for n, _ in model().named_parameters()]
    assert {("model", n) for n in names} <= paths
    assert {("optimizer", "state", n, k) for n in names
            for k in ("step", "exp_avg", "exp_avg_sq")} <= paths
    assert ("optimizer", "param_groups", 0, "lr") in paths
    assert not any(p[0] not in ("model", "optimizer", "distopt") for p in paths)


@pytest.fixture(scope="module")
def v1_resumed():
    return {d: run_cases(d, [(f"v1-{m}", resume_v1, (m,)) for m in MODES]) for d in (2, 3)}


def test_a_checkpoint_of_the_earlier_layout_resumes_bit_for_bit(v1_resumed):
    for rank in case_result(v1_resumed[2], "v1-params"):
        assert rank["extra"] == {"step": SAVED_AT}
        assert rank["resumed"].keys() == rank["uninterrupted"].keys()
        for key, value in rank["uninterrupted"].items():
            assert torch.equal(rank["resumed"][key], value), key


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_of_the_earlier_layout_resumes_in_every_mode(v1_resumed, d, mode):
    want = reference()
    for rank in case_result(v1_resumed[d], f"v1-{mode}"):
        assert rank["extra"] == {"step": SAVED_AT}
        _assert_near(rank["resumed"], want)


def test_both_layouts_export_the_same_file(saved, tmp_path):
    """The earlier layout's checkpoint and one of today's of the same run (both d = 2,
    shard_params, step 2) export to the same plain file, which torch.optim resumes."""
    old = distopt.export_checkpoint(V1, tmp_path / "v1.pt")
    new = distopt.export_checkpoint(saved["params"], tmp_path / "v2.pt")
    a, b = torch.load(old, weights_only=True), torch.load(new, weights_only=True)
    assert a["extra"] == b["extra"] == {"step": SAVED_AT}
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), (pid, key)
    net = model()
    net.load_state_dict(b["model"])
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    opt.load_state_dict(b["optimizer"])
    for step in range(SAVED_AT, STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    want = reference()
    for n, p in net.named_parameters():
        assert (p.detach() - want[f"param/{n}"]).abs().max() <= FP32_TOL, n


def test_the_fixture_is_of_the_earlier_layout():
    import json

    manifest = json.loads((V1 / "ckpt-000001" / "distopt.json").read_text())
    assert manifest["version"] == 1 and "layout" not in manifest
