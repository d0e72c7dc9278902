"""torch DDP's ignore list stepped by the one optimizer, as torch users write it: the same ignore
list under torch's DDP with one AdamW over ``ddp.parameters()`` and under distopt's with one
``DistributedOptimizer``, in each sharding mode on the same ranks, and compared. Each rank's
copy of an ignored param is stepped with its own local grad, the options a scheduler sets
included; its state travels in each rank's ``opt.state_dict()`` and is refused by name by the
forms that load on other ranks. See [Note: ignored params stepped locally] in
optim/local_params.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt

import test_torch_ddp_conformance as conformance
from dist_harness import case_result, pools_at_two_and_three

MODES = list(conformance.MODES)
STEPS = 3
IGNORED = ["3.weight"]  # the head's weight: each rank keeps its own


def _model() -> nn.Module:
    model = conformance._model()
    with torch.no_grad():  # each rank's own head, which no one averages
        model[3].weight.add_(0.01 * dist.get_rank())
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, IGNORED)
    return model


def one_optimizer_like_torch(mode: str) -> dict:
    """Three AdamW steps (a StepLR halving the lr each step) under torch's DDP and distopt's:
    the largest difference of the state dicts, whether the ignored weight differs across
    ranks, and the ignored params' state brought back by ``opt.load_state_dict``."""
    states = {}
    for kind in ("torch", "distopt"):
        ddp, opt = conformance._wrapped(kind, mode, model=_model())
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        conformance._train(ddp, opt, range(STEPS))
        for _ in range(STEPS):
            scheduler.step()
        states[kind] = conformance._state(ddp)
    heads = [None] * dist.get_world_size()
    dist.all_gather_object(heads, states["distopt"]["module.3.weight"])
    saved = copy.deepcopy(opt.state_dict())
    conformance._train(ddp, opt, range(STEPS, STEPS + 1))  # the state moves on
    opt.load_state_dict(saved)
    back = opt.local_params.state_dict()
    refusal = ""
    try:
        opt.sharded_state_dict()
    except ValueError as error:
        refusal = str(error)
    return {"diff": conformance._largest_difference(states["torch"], states["distopt"]),
            "local": not torch.equal(heads[0], heads[1]),
            "saved": sorted(saved.get("local_state", {}).get("3.weight", {})),
            "back": all(torch.equal(back["3.weight"][k], v)
                        for k, v in saved["local_state"]["3.weight"].items()),
            "refusal": refusal}


def value_clipped_like_torch(mode: str) -> float:
    """torch's ``clip_grad_value_(ddp.parameters(), v)`` before each step against distopt's
    ``clip_grad_value=v``, which clamps each rank's ignored grads too: the largest difference
    of the state dicts after three steps (a bound that clamps some grads)."""
    bound = 0.05
    states = {}
    for kind in ("torch", "distopt"):
        model = _model()
        if kind == "torch":
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        else:
            ddp = distopt.DistributedDataParallel(model, **conformance.MODES[mode])
            opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2,
                                               clip_grad_value=bound)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = conformance._batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            if kind == "torch":
                nn.utils.clip_grad_value_(ddp.parameters(), bound)
            opt.step()
        states[kind] = conformance._state(ddp)
    return conformance._largest_difference(states["torch"], states["distopt"])


def _cases() -> list:
    return [*[(f"ignore-{mode}", one_optimizer_like_torch, (mode,)) for mode in MODES],
            *[(f"clip-value-{mode}", value_clipped_like_torch, (mode,)) for mode in MODES]]


two, three, both = pools_at_two_and_three(_cases)


@pytest.mark.parametrize("mode", MODES)
def test_one_optimizer_steps_the_ignore_list_as_torch_ddp(both, mode):
    for v in case_result(both, f"ignore-{mode}"):
        # fp32 AdamW, the grads summed in another order: the conformance suite's bound.
        assert v["diff"] <= conformance.TRAJECTORY_TOL, v
        assert v["local"], v  # each rank's own copy, as under torch
        assert v["saved"] == ["exp_avg", "exp_avg_sq", "step"], v
        assert v["back"], v
        assert "'3.weight'" in v["refusal"] and "opt.state_dict()" in v["refusal"], v


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_value_clamps_the_ignored_grads_as_torch(both, mode):
    for diff in case_result(both, f"clip-value-{mode}"):
        assert diff <= conformance.TRAJECTORY_TOL, diff
