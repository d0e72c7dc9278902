"""``torch.amp.GradScaler`` stepping a distopt optimizer, through torch's own protocol.

[Note: torch's GradScaler]
An optimizer class with ``_step_supports_amp_scaling = True`` (torch's fused optimizers are
such) is stepped by ``scaler.step(opt)`` as ``opt.step(grad_scaler=scaler)``: the scaler then
neither unscales nor checks the grads itself, and leaves both to the optimizer. distopt's step
does with it what it does with its own ``DynamicLossScaler``: after the reduce-scatter it
unscales this rank's fp32 main grads once, by ``1 / scaler.get_scale()`` (the reciprocal torch
takes: in float64, rounded to float32), agrees on the inf/nan verdict over every rank that holds
a part of the grads, skips the step on all of them if any rank found one, and records that one
verdict as the scaler's ``found_inf`` for this optimizer. ``scaler.update()`` then backs off or
grows the scale by torch's own rule, alike on every rank. GradScaler's own check could not do
this: each rank would see only the grads of its own shard, so the rank whose shard held the inf
would halve its scale and skip, and the others would step.

``scaler.unscale_(opt)`` before the step is torch's recipe for clipping between unscale and
step: ``scaler.unscale_(opt)``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``,
``scaler.step(opt)``. GradScaler's own unscale finds no grads (a main param has a ``.grad`` only
while a step runs, optim/main_params.py), so distopt wraps ``GradScaler.unscale_`` (once, when
a distopt optimizer is built; a wrapper that calls torch's and then, for a distopt optimizer
only, tells it): the optimizer's models then answer ``p.grad`` reads with the grads times the
same reciprocal scale, and a clamp bounds the scaled grads by the bound times the scale
([Note: p.grad under distopt] in ddp/grads/grad_marker.py). The reduced grads stay scaled in the
buffers, and the step unscales them as above, after any ``clip_grad_norm_`` scaled them:
multiplications commute, and with torch's default factors a GradScaler's scale is a power of
two, so unscaling first or last gives the same bits (other factors: the same to one rounding),
and fp16 grad buffers never hold unscaled grads that would underflow. The step ends the
unscaled reads. With ``clip_grad=`` the step clips the unscaled grads itself.

GradScaler passes itself with a FutureWarning that it will one day set ``grad_scale`` and
``found_inf`` attributes instead; the call is the contract of this torch, so distopt silences
that one warning. A torch that sets the attributes would leave each rank's scale to that rank's
own verdict: distopt refuses such a step rather than take it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

AFTER_STEP = (
    "after optimizer.step(): the step unscales and clips the reduced grads in distopt's buffers "
    "in place, so they are no longer the grads torch's p.grad would hold; read p.grad between "
    "the step's last backward and the step, as torch's clip_grad_norm_ does (with clip_grad= "
    "the global norm is opt.step().grad_norm)"
)

warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)

USE_DISTOPT_SCALER = (
    "or pass loss_scaler=distopt.DynamicLossScaler(hysteresis=1) to the optimizer, which "
    "follows torch.amp.GradScaler's rules"
)


class TorchGradScaler:
    """One step's view of a ``torch.amp.GradScaler``: its scale, and where the agreed verdict
    goes (the ``scale`` and ``update`` the step pipeline reads of a distopt loss scaler)."""

    def __init__(self, grad_scaler: torch.amp.GradScaler, optimizer: Any,
                 device: torch.device) -> None:
        self._state = grad_scaler._per_optimizer_states[id(optimizer)]
        if self._state["stage"] is OptState.UNSCALED and self._state["found_inf_per_device"]:
            raise RuntimeError(
                "torch.amp.GradScaler.unscale_ unscaled grads of a distopt optimizer outside "
                "its step (its main params had a .grad set by hand): distopt unscales the "
                f"reduced grads inside step(); leave the main params' .grad alone, "
                f"{USE_DISTOPT_SCALER}"
            )
        self.scale = grad_scaler.get_scale()
        self._device = device  # scaler.update() moves the flag to its scale's device

    def update(self, found_inf: bool) -> None:
        """Record the verdict every rank agreed on as the scaler's, for ``scaler.update()``."""
        flag = torch.full((), float(found_inf), dtype=torch.float32, device=self._device)
        self._state["found_inf_per_device"] = {self._device: flag}


def refuse_attribute_protocol() -> None:
    """Raise for a GradScaler that handed the step ``grad_scale``/``found_inf`` attributes
    instead of itself (a torch whose GradScaler no longer passes itself): the scale would then
    follow this rank's verdict alone."""
    raise RuntimeError(
        "this torch.amp.GradScaler stepped the distopt optimizer without passing itself "
        "(grad_scale/found_inf attributes), so its scale would follow each rank's own inf "
        f"check: pin the torch version distopt supports, {USE_DISTOPT_SCALER}"
    )


def hand_unscale_to(optimizer_class: type) -> None:
    """Have ``torch.amp.GradScaler.unscale_(opt)`` tell an ``optimizer_class`` (its
    ``_unscaled_by(scaler)``) once torch's own unscale is done (idempotent); see
    [Note: torch's GradScaler]."""
    original = torch.amp.GradScaler.unscale_
    if getattr(original, "_distopt_hands_unscale", False):
        return

    @functools.wraps(original)
    def unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        original(self, optimizer)
        if self.is_enabled() and isinstance(optimizer, optimizer_class):
            optimizer._unscaled_by(self)  # type: ignore[attr-defined]

    unscale_._distopt_hands_unscale = True  # type: ignore[attr-defined]
    torch.amp.GradScaler.unscale_ = unscale_  # type: ignore[method-assign]
