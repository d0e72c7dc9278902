"""Checkpoints of whole-tensor optimizers: Muon + AdamW (a group naming its class) and Adafactor
saved at d = 2 resume at d = 1, 2, 3 and 4 bitwise equal to the uninterrupted run, through
save_checkpoint, merged opt.state_dict()s and an exported plain file; the export trains on in
plain torch.optim.Muon + AdamW and Adafactor; a class declared whole-tensor loads into the
element-wise layout of the same class and back; what cannot load fails on every rank and
changes nothing.

Bitwise across DP sizes: a data-parallel run at another DP size sums its ranks' grads in
another order, so its params round differently from the first step after a resume. Here every
rank computes the grads of the whole global batch and rounds them to bf16's 8 significant bits
(a tensor hook, before distopt sees them). The reduce-scatter then sums d equal values of 8
bits, exact in fp32 for d <= 4, and divides by d, exact again since the result is the value
itself: every step sees the same grads bit for bit at any DP size. Without clipping (whose
global norm is summed shard by shard) what remains to differ between the runs is only how the
params and the optimizer state are laid out over the ranks, and a checkpoint that lost,
moved or mis-shaped any element of it would show. A control run that resumes the params
without the optimizer state ends far from the reference, so the comparison can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt
from distopt.checkpoint import merge_state_dicts

from dist_harness import case_result, run_cases
from helpers import lm_loss, max_diff, muon_groups, params_of, same, snapshot, state_diff
from models import AwkwardLM, batches

pytestmark = pytest.mark.slow

SAVE_AT, END = 5, 10
MUON = {"lr": 0.02, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.01}
ADAFACTOR = {"lr": 1e-2}


# ---------------------------------------------------------------------- optimizer classes


class WholeAdamW(torch.optim.AdamW):
    """A user's AdamW declared whole-tensor: its state is per-element, held whole by owners."""


class FactoredAdamW(torch.optim.AdamW):
    """A user's whole-tensor class that also keeps each matrix's row norms: whole-parameter
    state, which no element-wise piece can hold."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    self.state[p]["row_norm"] = p.norm(dim=1, keepdim=True)
        return loss


distopt.register_whole_tensor_optimizer(WholeAdamW)
distopt.register_whole_tensor_optimizer(FactoredAdamW)


def _element_wise_twin(cls: type) -> type:
    """The same class path as ``cls``, not declared whole-tensor: what a job that does not
    register the class builds (distopt then shards it element-wise, as AdamW)."""
    return type(cls.__name__, (torch.optim.AdamW,),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


ELEMENTWISE = {cls: _element_wise_twin(cls) for cls in (WholeAdamW, FactoredAdamW)}


# ---------------------------------------------------------------------- runs

# name: (class that saves, class that loads); "muon" and "adafactor" build their own groups.
RUNS = {
    "muon": ("muon", "muon"),
    "adafactor": ("adafactor", "adafactor"),
    "whole-to-elementwise": (WholeAdamW, ELEMENTWISE[WholeAdamW]),
    "elementwise-to-whole": (ELEMENTWISE[WholeAdamW], WholeAdamW),
}


def _round_to_bf16(grad: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.bfloat16).to(grad.dtype)


def _model() -> AwkwardLM:
    torch.manual_seed(0)
    model = AwkwardLM()
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_round_to_bf16)  # see the module docstring
    return model


def build(kind, second_group=torch.optim.AdamW, group=None):
    model = _model()
    ddp = distopt.DistributedDataParallel(model, process_group=group, bucket_size=60,
                                          find_unused_parameters=True)
    if kind == "muon":
        groups = muon_groups(model, MUON, ADAMW)
        groups[1]["optimizer"] = second_group
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=groups)
    elif kind == "adafactor":
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Adafactor, **ADAFACTOR)
    else:
        opt = distopt.DistributedOptimizer(ddp, kind, **ADAMW)
    return model, ddp, opt, CosineAnnealingLR(opt, T_max=END)


def _loss(forward, step: int) -> torch.Tensor:
    tokens, targets = batches(step)  # the whole global batch on every rank
    return lm_loss(forward, tokens, targets, step)


def train(ddp, opt, sched, steps) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(ddp, step).backward()
        opt.step()
        sched.step()


def _saved_state_dicts(root: Path, run: str) -> dict:
    return merge_state_dicts([torch.load(root / f"{run}-sd-{r}.pt", weights_only=False)
                              for r in range(2)])


# ---------------------------------------------------------------------- cases (in the ranks)


def save_and_continue(run: str, root: Path) -> dict:
    """Train to SAVE_AT at d = 2, save, train on to END; rank 0 writes the trajectory."""
    model, ddp, opt, sched = build(RUNS[run][0])
    train(ddp, opt, sched, range(SAVE_AT))
    distopt.save_checkpoint(root / run, ddp, opt, extra={"step": SAVE_AT,
                                                         "sched": sched.state_dict()})
    torch.save(opt.sharded_state_dict(), root / f"{run}-sd-{dist.get_rank()}.pt")
    ref = {"saved": params_of(model), "sched": sched.state_dict()}
    train(ddp, opt, sched, range(SAVE_AT, END))
    ref["final"] = params_of(model)
    if dist.get_rank() == 0:
        torch.save(ref, root / f"{run}-ref.pt")
    return {"moved": max_diff(model, ref["saved"])}


# The data-parallel groups of the resumed runs, by DP size: the world, or the first ranks of
# the world (d = 3 runs on 3 of the 4 ranks of the d = 4 group, saving a spawn).
_GROUPS: dict[int, dist.ProcessGroup | None] = {}


def make_groups() -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    _GROUPS[world] = None
    if world == 4:
        _GROUPS[3] = dist.new_group([0, 1, 2])  # every rank takes part in creating it


def in_group(d: int) -> bool:
    return not dist.is_initialized() or dist.get_rank() < d


def resume(run: str, root: Path, how: str, d: int | None = None) -> dict | None:
    """Load the d = 2 checkpoint of ``run`` at DP size ``d`` (the world's by default), ``how``:
    through load_checkpoint, merged state dicts or the exported file; train on to END."""
    if d is not None and not in_group(d):
        return None
    model, ddp, opt, sched = build(RUNS[run][1], group=_GROUPS.get(d))
    ref = torch.load(root / f"{run}-ref.pt")
    ddp.comm_stats.reset()
    if how == "checkpoint":
        sched.load_state_dict(distopt.load_checkpoint(root / run, ddp, opt)["sched"])
    elif how == "memory":
        opt.load_state_dict(_saved_state_dicts(root, run))
        sched.load_state_dict(ref["sched"])  # the schedule is the caller's, as with torch.optim
    else:
        sched.load_state_dict(distopt.load_plain_checkpoint(root / f"{run}.pt", ddp,
                                                            opt)["sched"])
    calls = dict(ddp.comm_stats.calls)
    at_load = max_diff(model, ref["saved"])
    worst_state = state_diff(opt, _saved_state_dicts(root, run))
    classes = [g.get("optimizer") for g in opt.param_groups]
    train(ddp, opt, sched, range(SAVE_AT, END))
    return {"at_load": at_load, "state_diff": worst_state, "final": max_diff(model, ref["final"]),
            "calls": calls, "buckets": len(ddp.buckets), "classes": classes}


def control(root: Path) -> float:
    """The params of the Muon run at SAVE_AT without its optimizer state: how far from the
    reference 5 steps take them."""
    model, ddp, opt, sched = build("muon")
    ref = torch.load(root / "muon-ref.pt")
    with torch.no_grad():
        model.load_state_dict(ref["saved"], strict=False)  # fp32: the main params alias them
    sched.load_state_dict(ref["sched"])
    train(ddp, opt, sched, range(SAVE_AT, END))
    return max_diff(model, ref["final"])


def bad_load(case: str, root: Path, d: int) -> dict | None:
    """A load that cannot fit: every rank raises, and nothing changed."""
    if not in_group(d):
        return None
    run, kind, how = BAD[case][:3]
    kind = kind if isinstance(kind, tuple) else (kind,)
    model, ddp, opt, _ = build(*kind, group=_GROUPS[d])
    opt.zero_grad()
    _loss(ddp, 0).backward()
    opt.step()  # non-empty state, which must survive untouched
    before = snapshot(model, opt)
    error = None
    try:
        if how == "checkpoint":
            distopt.load_checkpoint(root / run, ddp, opt)
        elif how == "memory":
            opt.load_state_dict(_saved_state_dicts(root, run))
        else:
            distopt.load_plain_checkpoint(root / f"{run}.pt", ddp, opt)
    except distopt.CheckpointError as exc:
        error = str(exc)
    return {"error": error, "unchanged": same(before, snapshot(model, opt))}


BAD = {
    # case: (saved run, what loads it, how, texts every rank's error holds)
    "factored-into-elementwise": (
        "factored", ELEMENTWISE[FactoredAdamW], "checkpoint",
        ["state 'row_norm' of parameter", "whole-parameter state", "element-wise",
         "register_whole_tensor_optimizer"]),
    "factored-into-elementwise-memory": (
        "factored", ELEMENTWISE[FactoredAdamW], "memory",
        ["state 'row_norm' of parameter", "whole-parameter state", "element-wise"]),
    "factored-into-elementwise-plain": (
        "factored", ELEMENTWISE[FactoredAdamW], "plain",
        ["state 'row_norm' of parameter", "whole-parameter state", "element-wise"]),
    "group-class": (
        "muon", ("muon", torch.optim.SGD), "checkpoint",
        ["param group 1 of checkpoint", "holds torch.optim.adamw.AdamW state",
         "steps the group with torch.optim.sgd.SGD"]),
    "group-class-memory": (
        "muon", ("muon", torch.optim.SGD), "memory",
        ["param group 1 of the state dict", "torch.optim.adamw.AdamW",
         "torch.optim.sgd.SGD"]),
    "group-class-plain": (
        "muon", ("muon", torch.optim.SGD), "plain",
        ["torch optimizer states of", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"]),
    "whole-class-into-adamw": (
        "adafactor", torch.optim.AdamW, "checkpoint",
        ["holds torch.optim.Adafactor state", "wraps torch.optim.adamw.AdamW"]),
}


def save_factored(root: Path) -> None:
    model, ddp, opt, sched = build(FactoredAdamW)
    train(ddp, opt, sched, range(2))
    distopt.save_checkpoint(root / "factored", ddp, opt)
    torch.save(opt.sharded_state_dict(), root / f"factored-sd-{dist.get_rank()}.pt")


# ---------------------------------------------------------------------- the groups

WAYS = ["checkpoint", "memory", "plain"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("whole-checkpoints")


@pytest.fixture(scope="module")
def saved(root) -> list[dict]:
    cases = [(f"save-{run}", save_and_continue, (run, root)) for run in RUNS]
    cases.append(("save-factored", save_factored, (root,)))
    cases += [(f"resume-{run}-{how}", resume, (run, root, how))
              for run in RUNS for how in ("checkpoint", "memory")]
    cases.append(("control", control, (root,)))
    return run_cases(2, cases)


@pytest.fixture(scope="module")
def exported(saved, root) -> dict[str, Path]:
    return {run: distopt.export_checkpoint(root / run, root / f"{run}.pt")
            for run in [*RUNS, "factored"]}


def _resume_cases(d: int, root: Path) -> list:
    cases = [(f"d{d}-resume-{run}-{how}", resume, (run, root, how, d))
             for run in RUNS for how in WAYS]
    return cases + [(f"d{d}-bad-{case}", bad_load, (case, root, d)) for case in BAD]


def _run_here(cases: list) -> list[dict]:
    """The cases on this process alone (d = 1, no process group), one thread as in the ranks,
    in run_cases' format."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [{name: ("ok", fn(*args)) for name, fn, args in cases}]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wide(root, saved, exported) -> list[dict]:
    """d = 4 on 4 ranks and d = 3 on the first 3 of them, in one spawned group."""
    cases = [("groups", make_groups, ())] + _resume_cases(4, root) + _resume_cases(3, root)
    return run_cases(4, cases)


@pytest.fixture(scope="module", params=[1, 3, 4], ids=["d1", "d3", "d4"])
def resumed(request, root, saved, exported):
    d = request.param
    if d == 1:
        make_groups()
        return d, _run_here(_resume_cases(1, root))
    results = request.getfixturevalue("wide")
    return d, results[:d]  # the ranks of the group that resumed at d


def _result(results: list[dict], d: int, name: str) -> list:
    return case_result(results, f"d{d}-{name}")


# ---------------------------------------------------------------------- tests


def test_saved_runs_trained(saved):
    for run in RUNS:
        for value in case_result(saved, f"save-{run}"):
            assert value["moved"] > 1e-2, (run, value)
    # Resumed without the optimizer state, the params end far from the reference: the
    # bitwise comparisons below are of numbers that depend on every bit of the state.
    for value in case_result(saved, "control"):
        assert value > 1e-3, value


def _check_resumed(value: dict, world: int, how: str) -> None:
    assert value["at_load"] == 0.0 and value["state_diff"] == 0.0, value
    assert value["final"] == 0.0, value
    if how == "checkpoint":
        # distopt's own communication in a load: one all-gather of the params per bucket.
        assert value["calls"] == ({"all_gather": value["buckets"]} if world > 1 else {})
    if how == "plain":
        assert value["calls"] == {}  # a plain load needs no communication


@pytest.mark.parametrize("how", ["checkpoint", "memory"])
@pytest.mark.parametrize("run", list(RUNS))
def test_resume_at_2_is_bitwise(saved, run, how):
    for value in case_result(saved, f"resume-{run}-{how}"):
        _check_resumed(value, 2, how)


@pytest.mark.parametrize("how", WAYS)
@pytest.mark.parametrize("run", list(RUNS))
def test_resume_at_other_sizes_is_bitwise(resumed, run, how):
    world, results = resumed
    values = _result(results, world, f"resume-{run}-{how}")
    assert len(values) == world
    for value in values:
        _check_resumed(value, world, how)
        if run == "muon":
            # The group that names its class keeps the class, not the saved path.
            assert value["classes"] == [None, torch.optim.AdamW], value


@pytest.mark.parametrize("case", list(BAD))
def test_what_cannot_load_fails_on_every_rank_and_changes_nothing(resumed, case):
    world, results = resumed
    for value in _result(results, world, f"bad-{case}"):
        assert value["error"] is not None, value
        for text in BAD[case][3]:
            assert text in value["error"], (text, value["error"])
        assert value["unchanged"], value


def test_manifest_and_index_list_whole_parameter_state(saved, root):
    from distopt.checkpoint import dcp

    shapes = {n: tuple(p.shape) for n, p in AwkwardLM().named_parameters()}
    matrices = ["emb.weight", "l1.weight", "l2.weight", "sometimes.weight"]
    manifest = json.loads((root / "adafactor" / "ckpt-000001" / "distopt.json").read_text())
    assert manifest["param_group_classes"] == ["torch.optim.Adafactor"]
    expected = {n: {"row_var": [[shapes[n][0], 1], "float32"],
                    "col_var": [[1, shapes[n][1]], "float32"]} for n in matrices}
    assert manifest["whole_state"] == expected
    index = dcp.read_metadata(root / "adafactor" / "ckpt-000001").state_dict_metadata
    for name in matrices:
        for key, (shape, _) in expected[name].items():
            entry = index[f"optimizer.state.{name}.{key}"]  # torch's layout
            # Written whole, by its owner alone: one chunk of the full shape.
            assert tuple(entry.size) == tuple(shape)
            assert [tuple(c.sizes) for c in entry.chunks] == [tuple(shape)]
    # Adafactor's 1-D state and Muon's momentum are per-element: in the param's shape.
    assert tuple(index["optimizer.state.l1.bias.variance"].size) == (7,)
    muon = json.loads((root / "muon" / "ckpt-000001" / "distopt.json").read_text())
    assert muon["param_group_classes"] == ["torch.optim.Muon", "torch.optim.adamw.AdamW"]
    assert muon["whole_state"] == {}
    muon_index = dcp.read_metadata(root / "muon" / "ckpt-000001").state_dict_metadata
    assert tuple(muon_index["optimizer.state.l1.weight.momentum_buffer"].size) == (7, 6)


def test_export_holds_one_torch_state_per_class(exported):
    shapes = {n: tuple(p.shape) for n, p in AwkwardLM().named_parameters()}
    ckpt = torch.load(exported["muon"], weights_only=True)
    assert "optimizer" not in ckpt
    assert list(ckpt["optimizers"]) == ["torch.optim.Muon", "torch.optim.adamw.AdamW"]
    muon, adamw = ckpt["optimizers"].values()
    matrices = ["emb.weight", "l1.weight", "l2.weight", "sometimes.weight"]
    rest = ["l1.bias", "l2.bias", "norm.weight", "norm.bias"]
    assert [g["params"] for g in muon["param_groups"]] == [[0, 1, 2, 3]]
    assert [g["params"] for g in adamw["param_groups"]] == [[0, 1, 2, 3]]
    assert all("optimizer" not in g for g in adamw["param_groups"])
    assert {i: s["momentum_buffer"].shape for i, s in muon["state"].items()} == {
        i: shapes[n] for i, n in enumerate(matrices)}
    assert {i: s["exp_avg"].shape for i, s in adamw["state"].items()} == {
        i: shapes[n] for i, n in enumerate(rest)}
    adafactor = torch.load(exported["adafactor"], weights_only=True)["optimizer"]
    names = [n for n, _ in AwkwardLM().named_parameters()]  # the default group: every param
    assert adafactor["state"][names.index("l1.weight")]["row_var"].shape == (7, 1)
    assert adafactor["state"][names.index("l1.weight")]["col_var"].shape == (1, 6)
    assert adafactor["state"][names.index("l1.bias")]["variance"].shape == (7,)


def _plain_continue(ckpt: dict, optimizers: list[torch.optim.Optimizer], model: nn.Module,
                    sched_state: dict) -> None:
    """Train the plain torch run on from SAVE_AT, each optimizer with its share of the
    distopt schedule (one CosineAnnealingLR per optimizer, over its groups)."""
    scheds, first = [], 0
    for opt in optimizers:
        sched = CosineAnnealingLR(opt, T_max=END)
        n = len(opt.param_groups)
        sched.load_state_dict({k: v[first : first + n] if isinstance(v, list) else v
                               for k, v in sched_state.items()})
        scheds.append(sched)
        first += n
    for step in range(SAVE_AT, END):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        for opt, sched in zip(optimizers, scheds, strict=True):
            opt.step()
            sched.step()


def test_export_continues_bitwise_in_plain_torch(exported, root):
    """The exported files train on in torch.optim.Muon + AdamW, and in Adafactor, on one
    process, bitwise as the distopt run did."""
    for run in ("muon", "adafactor"):
        ckpt = torch.load(exported[run], weights_only=True)
        model = _model()
        model.load_state_dict(ckpt["model"])
        if run == "muon":
            muon_group, adamw_group = muon_groups(model, MUON, ADAMW)
            optimizers = [torch.optim.Muon(muon_group["params"], **MUON),
                          torch.optim.AdamW(adamw_group["params"], **ADAMW)]
            for opt, state in zip(optimizers, ckpt["optimizers"].values(), strict=True):
                opt.load_state_dict(state)
        else:
            optimizers = [torch.optim.Adafactor(model.parameters(), **ADAFACTOR)]
            optimizers[0].load_state_dict(ckpt["optimizer"])
        ref = torch.load(root / f"{run}-ref.pt")
        assert max_diff(model, ref["saved"]) == 0.0
        _plain_continue(ckpt, optimizers, model, ckpt["extra"]["sched"])
        assert max_diff(model, ref["final"]) == 0.0, run


def test_basic_optimizer_and_older_manifests_on_one_process(tmp_path):
    """BasicOptimizer (every rank holds all the state, whole-parameter state included) saves
    Adafactor and resumes bitwise; a checkpoint whose manifest predates per-group classes and
    whole-parameter state (an AdamW run) still loads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def basic():
            model = _model()
            opt = distopt.BasicOptimizer(model, torch.optim.Adafactor, **ADAFACTOR)
            return model, opt.models[0], opt, CosineAnnealingLR(opt, T_max=END)

        model, ddp, opt, sched = basic()
        train(ddp, opt, sched, range(SAVE_AT))
        ckpt = distopt.save_checkpoint(tmp_path / "basic", ddp, opt,
                                       extra={"sched": sched.state_dict()})
        manifest = json.loads((ckpt / "distopt.json").read_text())
        assert manifest["whole_state"]["l1.weight"] == {"row_var": [[7, 1], "float32"],
                                                        "col_var": [[1, 6], "float32"]}
        train(ddp, opt, sched, range(SAVE_AT, END))
        final = params_of(model)
        model, ddp, opt, sched = basic()
        sched.load_state_dict(distopt.load_checkpoint(tmp_path / "basic", ddp, opt)["sched"])
        train(ddp, opt, sched, range(SAVE_AT, END))
        assert max_diff(model, final) == 0.0

        model, ddp, opt, sched = build(torch.optim.AdamW)
        train(ddp, opt, sched, range(2))
        ckpt = distopt.save_checkpoint(tmp_path / "old", ddp, opt)
        manifest = json.loads((ckpt / "distopt.json").read_text())
        del manifest["param_group_classes"], manifest["whole_state"]
        (ckpt / "distopt.json").write_text(json.dumps(manifest))
        saved = params_of(model)
        train(ddp, opt, sched, range(2, 4))
        distopt.load_checkpoint(ckpt, ddp, opt)
        assert max_diff(model, saved) == 0.0
        _, other_ddp, other_opt, _ = build(WholeAdamW)
        with pytest.raises(distopt.CheckpointError, match="holds torch.optim.adamw.AdamW state"):
            distopt.load_checkpoint(ckpt, other_ddp, other_opt)
    finally:
        torch.set_num_threads(threads)
