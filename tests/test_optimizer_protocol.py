"""torch.optim's optimizer protocol over distopt's optimizer, against torch DDP on the same ranks.

Each case trains the same small model under torch's DDP with a torch optimizer and under
distopt's DDP (in each sharding mode) with ``distopt.DistributedOptimizer`` over the same
class, written as a torch user writes it, and returns both ends:

* a repository's own optimizer class, MoCo v3's LARS (a trust ratio per tensor from
  ``torch.norm(p)`` and ``torch.norm(grad)``), which distopt owns whole param by param
  ([Note: optimizer kinds] in optim/kinds.py);
* ``opt.step(closure)`` ([Note: step(closure)] in optim/base.py);
* a warm restart through the optimizer's own state dict, ``sd = opt.state_dict()``, the lr
  changed in ``sd["param_groups"]``, ``opt.load_state_dict(sd)``, each rank its own part as
  under FSDP2, and rank 0's part loaded on every rank refused ([Note: torch's way of saving the
  optimizer] in checkpoint/state_dict.py);
* params given as ``(name, param)`` pairs (``model.named_parameters()``), with
  ``param_names`` in the state dict's groups.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt

from dist_harness import case_result, pools_at_two_and_three

MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}
STEPS = 2
LR = 1e-2
WARM_LR = 3e-3  # the lr a warm restart sets in the state dict's param groups

# torch's DDP and distopt's run the same forward and backward kernels on the same rows, so each
# rank's grads are the same bits; only the average over the ranks may round differently (torch
# all-reduces each grad, distopt reduce-scatters the bucket): exact at d = 2, one rounding
# (2**-24 relative) at d = 3. LARS's and SGD's steps scale with the grad, AdamW's step lr * m /
# sqrt(v) by the same relative amount, ~1e-9 a step at lr 1e-2 (the model has no grad made of
# round-off). 1e-6 is 100 times the drift over the few steps here and far below one step's
# update (MOVED), which a missed, doubled or misread step would show.
TRAJECTORY_TOL = 1e-6
MOVED = 1e-4  # every run moves its weights by more than this; a test that compares no step fails


class LARS(torch.optim.Optimizer):
    """MoCo v3's LARS (facebookresearch/moco-v3, optimizer.py), as a repository defines it:
    weight decay and a trust ratio ``trust * |p| / |dp|`` for matrices, momentum for all."""

    def __init__(self, params, lr=0.0, weight_decay=0.0, momentum=0.9, trust_coefficient=0.02):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:  # no weight decay or scaling for biases and norms
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.0,
                                    torch.where(update_norm > 0,
                                                g["trust_coefficient"] * param_norm / update_norm,
                                                one),
                                    one)
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


LARS_OPTIONS = {"lr": 0.5, "weight_decay": 1e-2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows of step ``step``'s batch (4 rows a rank at any world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)
    return x[rank::world], y[rank::world]


def _ddp(kind: str, mode: str, model: nn.Module) -> nn.Module:
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model)
    return distopt.DistributedDataParallel(model, bucket_size=40, **MODES[mode])


def _optimizer(kind: str, ddp: nn.Module, cls: type[torch.optim.Optimizer], params=None,
               **options) -> torch.optim.Optimizer:
    if kind == "torch":
        return cls(ddp.parameters() if params is None else params, **options)
    return distopt.DistributedOptimizer(ddp, cls, params, **options)


def _loss(ddp: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return nn.functional.mse_loss(ddp(x), y)


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(ddp, step).backward()
        opt.step()


def _weights(ddp: nn.Module) -> dict[str, torch.Tensor]:
    """The module's params by name, read where they are readable (with sharded params inside
    ``gathered_params()``)."""
    sharded = isinstance(ddp, distopt.DistributedDataParallel) and ddp.options.shard_params
    with ddp.gathered_params() if sharded else contextlib.nullcontext():
        return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _compared(runs: dict[str, nn.Module], start: dict[str, torch.Tensor]) -> dict[str, float]:
    ours, theirs = _weights(runs["distopt"]), _weights(runs["torch"])
    return {"diff": _difference(ours, theirs), "moved": _difference(theirs, start)}


# ------------------------------------------------------------------ cases


def lars_like_torch(mode: str) -> dict:
    """MoCo v3's LARS under distopt (each param owned whole) and under torch DDP."""
    runs, owned_whole = {}, None
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for kind in ("torch", "distopt"):
        ddp = _ddp(kind, mode, _model())
        opt = _optimizer(kind, ddp, LARS, **LARS_OPTIONS)
        _train(ddp, opt, range(STEPS + 1))
        runs[kind] = ddp
        if kind == "distopt":
            owned_whole = all(b.layout.whole_tensor for b in ddp.buckets)
            state_keys = sorted({k for s in opt.state.values() for k in s})
    return {**_compared(runs, start), "owned_whole": owned_whole, "state_keys": state_keys}


def closure_like_torch(mode: str) -> dict:
    """``loss = opt.step(closure)``, the closure zeroing the grads and running forward and
    backward, as torch's docs write it."""
    runs, losses, returned, results = {}, {}, {}, None
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for kind in ("torch", "distopt"):
        ddp = _ddp(kind, mode, _model())
        opt = _optimizer(kind, ddp, torch.optim.AdamW, lr=LR)
        losses[kind], returned[kind] = [], []
        for step in range(STEPS):
            def closure(step: int = step, opt: torch.optim.Optimizer = opt,
                        ddp: nn.Module = ddp, kind: str = kind) -> torch.Tensor:
                opt.zero_grad()
                loss = _loss(ddp, step)
                loss.backward()
                losses[kind].append(loss)
                return loss

            returned[kind].append(opt.step(closure))
        runs[kind] = ddp
        if kind == "distopt":
            results = opt.last_step_result
    return {
        **_compared(runs, start),
        "losses": [[x.item() for x in losses[k]] for k in ("torch", "distopt")],
        "same_objects": all(a is b for a, b in zip(returned["distopt"], losses["distopt"],
                                                   strict=True)),
        "grad_enabled": all(x.requires_grad for x in returned["distopt"]),
        "last_step_result": results,
    }


def warm_restart_like_torch(mode: str, cls_name: str = "AdamW") -> dict:
    """Train, then ``sd = opt.state_dict()``, ``sd["param_groups"][0]["lr"] = WARM_LR``,
    ``opt.load_state_dict(sd)``, and train on: each rank its own part, as FSDP2's."""
    cls, options = ((torch.optim.AdamW, {"lr": LR}) if cls_name == "AdamW"
                    else (LARS, LARS_OPTIONS))
    runs, lrs, keys = {}, {}, None
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for kind in ("torch", "distopt"):
        ddp = _ddp(kind, mode, _model())
        opt = _optimizer(kind, ddp, cls, **options)
        _train(ddp, opt, range(STEPS))
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = WARM_LR
        opt.load_state_dict(sd)
        _train(ddp, opt, range(STEPS, 2 * STEPS))
        runs[kind], lrs[kind] = ddp, [g["lr"] for g in opt.param_groups]
        if kind == "distopt":
            keys = sorted(sd)
    return {**_compared(runs, start), "lrs": lrs, "keys": keys}


def rank_zeros_part_refused(mode: str) -> dict:
    """torch DDP's way of saving, ``torch.save(opt.state_dict())`` under ``if rank == 0``,
    without consolidating: rank 0's part, loaded on every rank, is refused on every rank before
    anything is loaded; every rank's parts merged, and the consolidated state, load as before."""
    ddp = _ddp("distopt", mode, _model())
    opt = _optimizer("distopt", ddp, torch.optim.AdamW, lr=LR)
    _train(ddp, opt, range(STEPS))
    before = _weights(ddp)
    def state() -> list[torch.Tensor]:
        return [v.clone() for main in opt.main_params for v in opt.state[main].values()]

    state_before = state()
    sent = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    refused = ""
    try:
        opt.load_state_dict(sent[0])
    except distopt.CheckpointError as error:
        refused = str(error)
    unchanged = _difference(_weights(ddp), before) == 0.0 and all(
        torch.equal(a, b) for a, b in zip(state(), state_before, strict=True))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, opt.state_dict())
    merged = distopt.checkpoint.merge_state_dicts(parts)  # every rank's parts: no one's
    opt.load_state_dict(merged)
    opt.consolidate_state_dict(to=0)
    whole = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(whole, src=0)
    opt.load_state_dict(whole[0])  # the whole state loads on every rank, as before
    return {"refused": refused, "unchanged": unchanged,
            "unmarked": "rank_part" not in whole[0] and "rank_part" not in merged,
            "after_whole": _difference(_weights(ddp), before)}


def named_params_like_torch(mode: str) -> dict:
    """``model.named_parameters()`` and param groups of ``(name, param)`` pairs, as torch.optim
    takes them: the same steps, and ``param_names`` in the state dict's groups."""
    runs, names, loaded = {}, {}, None
    start = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for kind in ("torch", "distopt"):
        model = _model()
        ddp = _ddp(kind, mode, model)
        named = list(model.named_parameters())
        groups = [{"params": [(n, p) for n, p in named if p.ndim > 1], "weight_decay": 0.1},
                  {"params": [(n, p) for n, p in named if p.ndim <= 1], "weight_decay": 0.0}]
        opt = _optimizer(kind, ddp, torch.optim.AdamW, groups, lr=LR)
        _train(ddp, opt, range(STEPS))
        sd = opt.state_dict()
        names[kind] = [g["param_names"] for g in sd["param_groups"]]
        runs[kind] = ddp
        # The whole model's named_parameters() as the one group.
        model = _model()
        ddp = _ddp(kind, mode, model)
        whole = _optimizer(kind, ddp, torch.optim.AdamW, model.named_parameters(), lr=LR)
        names[f"{kind}-whole"] = [g["param_names"] for g in whole.param_groups]
        if kind == "distopt":
            opt.load_state_dict(sd)
            loaded = [g["param_names"] for g in opt.param_groups]
    return {**_compared(runs, start), "names": names, "loaded": loaded}


def _cases() -> list:
    cases = [(f"lars-{mode}", lars_like_torch, (mode,)) for mode in MODES]
    cases += [(f"closure-{mode}", closure_like_torch, (mode,)) for mode in MODES]
    cases += [(f"warm-{mode}", warm_restart_like_torch, (mode,)) for mode in MODES]
    cases += [("warm-lars", warm_restart_like_torch, ("optim", "LARS"))]
    cases += [(f"rank-part-{mode}", rank_zeros_part_refused, (mode,)) for mode in MODES]
    cases += [(f"named-{mode}", named_params_like_torch, (mode,)) for mode in MODES]
    return cases


two, three, both = pools_at_two_and_three(_cases)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("mode", list(MODES))
def test_a_repositorys_own_lars_steps_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"lars-{mode}"):
        assert v["owned_whole"]  # each param stepped whole by one rank: its norms are whole
        assert v["state_keys"] == ["mu"]
        assert v["moved"] > MOVED, v
        assert v["diff"] <= TRAJECTORY_TOL, v


@pytest.mark.parametrize("mode", list(MODES))
def test_step_with_a_closure_returns_its_loss_and_steps_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"closure-{mode}"):
        assert v["same_objects"] and v["grad_enabled"]  # the closure's own loss, with grad
        torch_losses, our_losses = v["losses"]
        assert len(our_losses) == STEPS  # the closure ran once a step
        assert our_losses == pytest.approx(torch_losses, rel=TRAJECTORY_TOL)
        assert isinstance(v["last_step_result"], distopt.StepResult)
        assert v["last_step_result"].updated
        assert v["moved"] > MOVED, v
        assert v["diff"] <= TRAJECTORY_TOL, v


@pytest.mark.parametrize("case", [*(f"warm-{mode}" for mode in MODES), "warm-lars"])
def test_a_warm_restart_through_the_state_dict_continues_as_under_torch_ddp(both, case):
    for v in case_result(both, case):
        assert v["lrs"]["distopt"] == v["lrs"]["torch"] == [WARM_LR]
        assert "rank_part" in v["keys"]  # each rank's own part, marked as its own
        assert v["moved"] > MOVED, v
        assert v["diff"] <= TRAJECTORY_TOL, v


@pytest.mark.parametrize("mode", list(MODES))
def test_rank_zeros_part_loaded_everywhere_is_refused_on_every_rank(both, mode):
    for rank, v in enumerate(case_result(both, f"rank-part-{mode}")):
        for words in ("rank 0 of", "consolidate_state_dict(to=0)", "one file per rank",
                      "distopt.save_checkpoint"):
            assert words in v["refused"], (rank, v["refused"])
        assert v["unchanged"]  # refused before anything was loaded
        assert v["unmarked"] and v["after_whole"] == 0.0


@pytest.mark.parametrize("mode", list(MODES))
def test_named_params_step_as_under_torch_ddp_with_torchs_param_names(both, mode):
    for v in case_result(both, f"named-{mode}"):
        names = v["names"]
        assert names["distopt"] == names["torch"] == [
            ["0.weight", "2.weight", "4.weight"], ["0.bias", "2.bias", "4.bias"]]
        assert names["distopt-whole"] == names["torch-whole"]
        assert len(names["torch-whole"][0]) == 6
        assert v["loaded"] == names["torch"]
        assert v["moved"] > MOVED, v
        assert v["diff"] <= TRAJECTORY_TOL, v


# ------------------------------------------------------------------ on one process


def _one_process() -> tuple[nn.Module, distopt.DistributedDataParallel]:
    model = _model()
    return model, distopt.DistributedDataParallel.for_this_process(model)


@pytest.mark.parametrize("cls,words", [
    (torch.optim.LBFGS, ["LBFGS cannot be stepped", "line search", "closure"]),
    (torch.optim.SparseAdam, ["SparseAdam cannot be stepped", "sparse grads"]),
])
def test_lbfgs_and_sparse_adam_stay_refused_by_name(cls, words):
    _, ddp = _one_process()
    with pytest.raises(TypeError) as refused:
        distopt.DistributedOptimizer(ddp, cls, lr=0.1)
    for word in words:
        assert word in str(refused.value)


def test_an_undeclared_class_is_owned_whole_and_an_elementwise_declaration_splits_it():
    class Lion(torch.optim.SGD):  # element-wise already, through SGD
        pass

    class MyElementwise(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad.sign(), alpha=-group["lr"])

    from distopt.optim.kinds import numel_cost, whole_tensor_cost

    assert whole_tensor_cost(LARS) is numel_cost
    assert whole_tensor_cost(Lion) is None
    assert whole_tensor_cost(MyElementwise) is numel_cost
    assert distopt.register_elementwise_optimizer(MyElementwise) is MyElementwise
    assert whole_tensor_cost(MyElementwise) is None
    with pytest.raises(TypeError, match="LBFGS cannot be stepped"):
        distopt.register_elementwise_optimizer(torch.optim.LBFGS)


@pytest.mark.parametrize("params,error,words", [
    (lambda m: [("0.weight", m[0].weight), m[0].bias], ValueError, "names some of its params"),
    (lambda m: [{"params": list(m[0].named_parameters())}, {"params": [m[2].weight]}],
     ValueError, "some param groups name their params"),
    (lambda m: [("0.weight", m[0].weight, 1)], TypeError, "a (name, param) pair"),
    (lambda m: ["0.weight"], TypeError, "param group 0 holds a str"),
])
def test_bad_named_params_are_refused_naming_the_fix(params, error, words):
    model, ddp = _one_process()
    with pytest.raises(error) as refused:
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, params(model), lr=0.1)
    assert words in str(refused.value)


def test_the_state_dict_of_one_process_is_whole_and_unmarked():
    model, ddp = _one_process()
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, model.named_parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert "rank_part" not in sd and sd["param_groups"][0]["param_names"][0] == "0.weight"
    sd["param_groups"][0]["lr"] = 0.05
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.05
