"""What torch scripts write into ``p.grad`` between backward and step, run under torch's own DDP
and under distopt's in each sharding mode on the same ranks, and compared: the params after two
steps, and what ``p.grad`` reads. See [Note: p.grad under distopt] in ddp/grads/grad_marker.py.

DINO's ``cancel_gradients_last_layer`` (``p.grad = None``: the param is not stepped), a grad
assigned (``p.grad = t``), ``zero_grad(set_to_none=False)`` (``p.grad`` reads zeros), the
element-wise writes of gradient noise (``add_``), of a guard against non-finite grads
(``torch.nan_to_num(..., out=p.grad)``), ``copy_``, ``zero_`` and signSGD's ``sign_``, Gradient
Centralization (``p.grad.add_(-p.grad.mean(dim=1, keepdim=True))``), and the reductions a
script logs (sum, mean, amax, amin, norms of other orders), each on every rank.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import test_torch_ddp_conformance as conformance
from dist_harness import case_result, pools_at_two_and_three

MODES = list(conformance.MODES)
STEPS = 2


def _noise(p: nn.Parameter, step: int, index: int) -> torch.Tensor:
    """A tensor of ``p``'s shape, the same on every rank (seeded by step and param)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return 0.01 * torch.randn(p.shape, generator=g)


def _spikes(p: nn.Parameter) -> torch.Tensor:
    """Zeros but a nan, an inf and a -inf (where the param has three elements)."""
    spikes = torch.zeros(p.numel())
    spikes[: min(3, p.numel())] = torch.tensor([math.nan, math.inf, -math.inf])[: p.numel()]
    return spikes.view(p.shape)


def _write(kind: str, ddp: nn.Module, step: int) -> None:
    """The write ``kind`` into every ``p.grad``, as a torch script writes it."""
    for index, p in enumerate(ddp.parameters()):
        if kind == "noise":
            p.grad.add_(_noise(p, step, index))
        elif kind == "nan_to_num":
            p.grad.add_(_spikes(p))
            torch.nan_to_num(p.grad, nan=0.0, posinf=1e5, neginf=-1e5, out=p.grad)
        elif kind == "copy":
            p.grad.copy_(_noise(p, step, index))
        elif kind == "zero" and index == 0:
            p.grad.zero_()
        elif kind == "sign":
            p.grad.sign_()
        elif kind == "centralize" and p.dim() > 1:
            p.grad.add_(-p.grad.mean(dim=1, keepdim=True))
        elif kind == "assign":
            p.grad = _noise(p, step, index)
        elif kind == "none" and index == len(list(ddp.parameters())) - 1:
            p.grad = None  # DINO's cancel_gradients_last_layer: the last layer's bias


def _reads(ddp: nn.Module) -> dict[str, tuple[float, ...] | None]:
    """What a script reads off each ``p.grad``: None, or its norms (2, inf) and reductions."""
    out = {}
    for name, p in ddp.named_parameters():
        g = p.grad
        out[name] = None if g is None else tuple(float(v) for v in (
            g.norm(), torch.linalg.vector_norm(g, math.inf), g.sum(), g.mean(), g.amax(),
            g.amin(), g.norm(1), torch.linalg.vector_norm(g, 3), torch.linalg.vector_norm(g, 0),
            torch.linalg.vector_norm(g, -math.inf),
            g.mean(dim=0).sum() if g.dim() > 1 else g.max()))
    return out


def _writes_run(kind_of_ddp: str, mode: str, kind: str, amp: bool) -> tuple[list, dict]:
    """Two AdamW steps of ``kind_of_ddp``'s DDP with the write ``kind`` between backward and
    step: what ``p.grad`` reads after each write, and the state dict at the end."""
    ddp, opt = conformance._wrapped(kind_of_ddp, mode)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    reads = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = conformance._batch(step)
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.unscale_(opt)
        _write(kind, ddp, step)
        if kind != "assign":  # an assigned grad is a plain tensor: nothing of distopt's
            reads.append(_reads(ddp))
        scaler.step(opt)
        scaler.update()
    return reads, conformance._state(ddp)


@functools.cache
def _torch_writes_run(kind: str, amp: bool) -> tuple[list, dict]:
    """``_writes_run`` under torch's DDP, which takes no sharding mode: the reference of the
    three modes' cases, trained once per worker (every rank runs the same cases, so every rank
    skips the same collectives). Its result is only read."""
    return _writes_run("torch", "optim", kind, amp)


def writes_like_torch(mode: str, kind: str, amp: bool = False) -> dict:
    """Two AdamW steps (weight decay on) with the write ``kind`` between backward and step,
    under torch's DDP and distopt's: what ``p.grad`` reads after it, and the state dicts.
    ``amp``: torch's GradScaler recipe, the write after ``unscale_`` (on grads distopt holds
    scaled by 2**16, which the write's values are divided by)."""
    torch_reads, torch_state = _torch_writes_run(kind, amp)
    reads, state = _writes_run("distopt", mode, kind, amp)
    initial = conformance._model().state_dict()["3.bias"]  # the seeded model both wrap
    return {"torch": {"reads": torch_reads}, "distopt": {"reads": reads},
            "state": conformance._largest_difference(torch_state, state),
            "last-moved": (state["module.3.bias"] - initial).abs().max().item()}


def _zeros_run(kind: str, mode: str) -> dict:
    """Two steps of ``kind``'s DDP with ``opt.zero_grad(set_to_none=False)`` at each start: the
    reads of ``p.grad`` there, and the state dict at the end."""
    ddp, opt = conformance._wrapped(kind, mode)
    reads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        reads.append({n: None if p.grad is None else (
            p.grad.abs().sum().item(), p.grad.norm().item(), tuple(p.grad.shape),
            torch.nn.utils.clip_grad_norm_([p], 1.0).item())
            for n, p in ddp.named_parameters()})
        x, y = conformance._batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return {"reads": reads, "state": conformance._state(ddp)}


@functools.cache
def _torch_zeros_run() -> dict:
    """``_zeros_run`` under torch's DDP, once per worker for the three modes (as
    ``_torch_writes_run``); only read."""
    return _zeros_run("torch", "optim")


def zeros_like_torch(mode: str) -> dict:
    """``opt.zero_grad(set_to_none=False)`` at each step's start: ``p.grad`` is None before the
    first backward, zeros after a step (torch's reads of them), and the steps train alike."""
    theirs, ours = _torch_zeros_run(), _zeros_run("distopt", mode)
    return {"torch": {"reads": theirs["reads"]}, "distopt": {"reads": ours["reads"]},
            "state": conformance._largest_difference(theirs["state"], ours["state"])}


def refusals(mode: str) -> dict[str, str]:
    """What is still refused, on every rank alike, by name; the loop goes on."""
    ddp, opt = conformance._wrapped("distopt", mode)
    opt.zero_grad()
    x, y = conformance._batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    grad = ddp.module[0].weight.grad
    out = {}
    for name, use in (("abs", lambda: grad.abs()),
                      ("other-shape", lambda: grad.add_(torch.ones(7))),
                      ("into-plain", lambda: torch.zeros(grad.shape).add_(grad)),
                      ("cumsum", lambda: grad.cumsum(0))):
        try:
            use()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
    opt.step()
    return out


WRITES = ["none", "assign", "noise", "nan_to_num", "copy", "zero", "sign", "centralize"]
AMP_WRITES = ["noise", "assign"]


def _cases() -> list:
    cases = [(f"{kind}-{mode}", writes_like_torch, (mode, kind))
             for kind in WRITES for mode in MODES]
    cases += [(f"{kind}-amp-{mode}", writes_like_torch, (mode, kind, True))
              for kind in AMP_WRITES for mode in MODES]
    cases += [(f"zeros-{mode}", zeros_like_torch, (mode,)) for mode in MODES]
    cases += [(f"refused-{mode}", refusals, (mode,)) for mode in MODES]
    return cases


two, three, both = pools_at_two_and_three(_cases)


# The reads after a write: the norms of types 2 and inf come from the agreed statistics
# (conformance.NORM_RTOL: a few fp32 roundings of the squares summed in another order); the
# other reductions from fp64 partial results over each rank's piece, combined in fp64, against
# torch's fp32 reduction of the whole grad: within a few fp32 roundings of the largest term
# summed (a sum of n terms of either sign rounds to n * 2**-24 of the largest, here n <= 48).
# Values near zero (a sum or mean of grads of either sign, a centralized grad's row means and
# its smallest magnitude, each a difference of near-equal terms) are compared to the scale of
# the terms, the grad's largest magnitude times its size.
READ_RTOL = 2.0**-16


def _same_reads(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, torch_reads) in enumerate(zip(ours, theirs, strict=True)):
        rtol = READ_RTOL if step == 0 else conformance.LATER_RTOL
        assert mine.keys() == torch_reads.keys()
        for name, read in torch_reads.items():
            assert (mine[name] is None) == (read is None), (step, name)
            if read is None:
                continue
            scale = read[1] * 64  # the largest magnitude times more than the size
            for k, (a, b) in enumerate(zip(mine[name], read, strict=True)):
                assert conformance._close(a, b, rtol) or (
                    k in (2, 3, 9, 10) and abs(a - b) <= rtol * scale), (step, name, k, a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", WRITES + [f"{k}-amp" for k in AMP_WRITES])
def test_writes_into_p_grad_train_as_under_torch_ddp(both, kind, mode):
    for v in case_result(both, f"{kind}-{mode}"):
        assert v["state"] <= conformance.TRAJECTORY_TOL, v["state"]
        if not kind.startswith("assign"):
            _same_reads(v["distopt"]["reads"], v["torch"]["reads"])
        if kind == "none":  # torch.optim skipped it: no update, no weight decay
            assert v["last-moved"] == 0.0, v
            assert v["torch"]["reads"][0]["module.3.bias"] is None
        else:
            assert v["last-moved"] > 1e-3, v  # a step moves it by ~lr = 1e-2


def test_the_writes_change_the_grads(two):
    """Each write changes what torch steps: its params end apart from those of a plain loop."""
    plain = case_result(two, "none-optim")[0]["torch"]["reads"][0]["module.0.weight"]
    for kind in ("noise", "copy", "zero", "sign", "centralize"):
        read = case_result(two, f"{kind}-optim")[0]["torch"]["reads"][0]["module.0.weight"]
        assert not conformance._close(read[0], plain[0], 1e-3), kind
    spiked = case_result(two, "nan_to_num-optim")[0]["torch"]["reads"][0]["module.0.weight"]
    assert spiked[1] == 1e5  # the inf was replaced by posinf


@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_without_none_reads_zeros_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"zeros-{mode}"):
        theirs, ours = v["torch"]["reads"], v["distopt"]["reads"]
        assert all(r is None for r in theirs[0].values())  # before any backward
        assert all(r == (0.0, 0.0, r[2], 0.0) for r in theirs[1].values()), theirs[1]
        assert ours == theirs
        assert v["state"] <= conformance.TRAJECTORY_TOL, v["state"]


@pytest.mark.parametrize("mode", MODES)
def test_what_needs_the_whole_grad_is_refused_by_name(both, mode):
    results = case_result(both, f"refused-{mode}")
    assert all(r == results[0] for r in results)  # on every rank alike
    refused = results[0]
    prefix = "p.grad of parameter '0.weight' cannot be used by aten."
    for name, message in refused.items():
        assert message.startswith(prefix), (name, message)
        assert "clip_grad_norm_" in message, message
    assert "p.grad.norm(1)" in refused["abs"]
    assert "does not broadcast to the parameter's shape (8, 6)" in refused["other-shape"]


def test_set_to_none_reads_none_where_torch_does(two):
    for v in case_result(two, "none-grads"):
        for reads in (v["torch"]["reads"], v["distopt"]["reads"]):
            assert reads[0]["module.3.bias"] is None
            assert reads[0]["module.3.weight"] is not None
