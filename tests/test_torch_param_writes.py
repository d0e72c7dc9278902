"""Element-wise writes in place into a param between steps, as torch scripts write them, run
under torch's own DDP and under distopt's in each sharding mode on the same ranks, and
compared: open_clip's ``model.logit_scale.clamp_(0, math.log(100))`` after every step (here a
bound below the value, so that the clamp acts), ``p.mul_(0.5)``, ``p.copy_(t)``, ``p += t``
and an operand that broadcasts to the param. With ``shard_params=True`` each rank writes its
shard ([Note: writes between uses] in ddp/buffers/param_placeholder.py), and with bf16 params the
fp32 masters (or the remainders) follow the write at the next step; what needs the whole value
stays refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt

import test_torch_ddp_conformance as conformance
from dist_harness import case_result, pools_at_two_and_three

MODES = list(conformance.MODES)
STEPS = 3
BOUND = 2.6  # below the initial logit scale, log(1 / 0.07) = 2.66: the clamp acts


class _Clip(nn.Module):
    """Two towers and open_clip's learned temperature, a 0-dim param of the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 8), nn.Linear(6, 8)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image, text = torch.tanh(self.image(x)), torch.tanh(self.text(x.flip(1)))
        return self.logit_scale.exp() * (image * text).sum(1, keepdim=True)


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return _Clip().to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 1, generator=g)
    return x[rank::world], y[rank::world]


def _target(shape: torch.Size, step: int) -> torch.Tensor:
    """The same tensor on every rank, seeded by the step."""
    return 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(100 + step))


def _write(model: _Clip, step: int) -> None:
    """What the loop writes into the params after each step, on every rank."""
    with torch.no_grad():
        model.logit_scale.clamp_(0, BOUND)
        model.image.weight.mul_(0.5)
        model.text.bias.copy_(_target(model.text.bias.shape, step))
        model.image.bias += _target(model.image.bias.shape, step)
        model.text.weight.add_(_target(model.text.weight.shape[1:], step), alpha=0.5)


def writes_like_torch(mode: str) -> dict:
    """Three AdamW steps with the writes after each, under torch's DDP and distopt's: the
    largest difference of the state dicts, and the logit scale distopt ends with."""
    states = {}
    for kind in ("torch", "distopt"):
        model = _model()
        ddp, opt = conformance._wrapped(kind, mode, model=model)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            _write(model, step)
        states[kind] = conformance._state(ddp)
    return {"diff": conformance._largest_difference(states["torch"], states["distopt"]),
            "scale": states["distopt"]["module.logit_scale"].item()}


def masters_follow(remainders: bool) -> dict:
    """bf16 params under ``shard_params`` (fp32 masters, or with ``store_param_remainders``
    the remainders): after ``p.copy_(t)`` between steps the masters are ``t`` as the params
    hold it, and the step goes on from there."""
    model = _model(torch.bfloat16)
    ddp = distopt.DistributedDataParallel(model, shard_params=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2,
                                       store_param_remainders=remainders)
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
    opt.step()
    target = _target(model.image.weight.shape, 0)
    with torch.no_grad():
        model.image.weight.copy_(target)
    opt.adopt_param_writes()
    wanted = target.bfloat16().float().reshape(-1)
    with opt.main_params_materialized():
        pieces = [(piece, main.detach().reshape(-1).clone()) for param, piece, main
                  in opt.pieces() if param is model.image.weight]
    return {"pieces": len(pieces),
            "masters": all(torch.equal(main, wanted[piece.param_range.start
                                                     : piece.param_range.end])
                           for piece, main in pieces)}


def refusals() -> dict[str, str]:
    """What needs the whole value, or torch refuses too, between uses: refused by name."""
    model = _model()
    ddp = distopt.DistributedDataParallel(model, shard_params=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    weight = model.image.weight
    out = {}
    for name, use in (("grad-enabled", lambda: weight.mul_(0.5)),
                      ("other-param", lambda: weight.add_(model.text.weight)),
                      ("other-shape", lambda: weight.add_(torch.ones(3))),
                      ("out-of-place", lambda: weight.clamp(0, 1))):
        no_grad = torch.no_grad() if name != "grad-enabled" else torch.enable_grad()
        try:
            with no_grad:
                use()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
    return out


def _cases() -> list:
    return [*[(f"writes-{mode}", writes_like_torch, (mode,)) for mode in MODES],
            ("masters", masters_follow, (False,)),
            ("remainders", masters_follow, (True,)),
            ("refused", refusals, ())]


two, three, both = pools_at_two_and_three(_cases)


@pytest.mark.parametrize("mode", MODES)
def test_writes_between_steps_train_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"writes-{mode}"):
        # fp32 AdamW, the grads summed in another order: the conformance suite's bound.
        assert v["diff"] <= conformance.TRAJECTORY_TOL, v
        assert v["scale"] <= BOUND  # the clamp acted


@pytest.mark.parametrize("case", ["masters", "remainders"])
def test_fp32_masters_follow_a_write_between_steps(both, case):
    results = case_result(both, case)
    assert sum(v["pieces"] for v in results) >= 1  # some rank holds a piece of the param
    for v in results:
        assert v["masters"], v


def test_whole_value_writes_between_uses_refused_by_name(two):
    for v in case_result(two, "refused"):
        assert "in-place operation" in v["grad-enabled"] and "image.weight" in v["grad-enabled"]
        assert "parameter 'text.weight'" in v["other-param"], v
        assert "does not broadcast" in v["other-shape"], v
        assert "parameter 'image.weight'" in v["out-of-place"], v
        assert "clamp" in v["out-of-place"] and "gathered_params()" in v["out-of-place"]
