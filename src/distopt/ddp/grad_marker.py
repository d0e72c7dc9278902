"""What ``p.grad`` holds for a param of a distopt model: a marker that refuses to be read.

[Note: p.grad under distopt]
The DDP moves each grad out of ``p.grad`` into its bucket as soon as autograd has accumulated it
(ddp/wrapper.py), and after the reduce-scatter a rank holds the reduced grad of its own shard only
(with sharded grads, nothing else): no rank ever holds the full reduced grad that torch's DDP leaves
in ``p.grad``. A ``p.grad`` of None would let torch's utilities work on nothing, in silence:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` would return 0 and clip nothing. So once
its grad is moved, a param's ``.grad`` is a ``GradInBuffer``: a tensor of the param's shape, dtype
and device without storage, whose every operation raises one error that names the param and the
optimizer's options that do what ``p.grad`` is read for (``clip_grad=``, whose global norm is
``StepResult.grad_norm``; ``clip_grad_value=``; ``log_grad_norms=``, each param's norm in
``StepResult.grad_norms``). Every rank runs the
same user code, so every rank raises at the same call, and none is left waiting in a collective. A
tensor hook that runs before autograd's accumulation removes the marker, so autograd writes the next
grad as into an empty ``.grad``.

The marker keeps torch's meaning of ``p.grad``: present means "this param has a grad since the
last zero". ``opt.zero_grad()`` and ``ddp.zero_grad()`` remove the markers with the step's
grads. A ``zero_grad()`` of the wrapped module itself clears the markers alone (``p.grad =
None``, or ``zero_()`` with ``set_to_none=False``, which the marker records): the next backward
finds them cleared and starts a new step's grads, as ``opt.zero_grad()`` would have. Markers
cleared for some params and not for others are an error, since distopt zeroes a step's grads
as a whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ALLOWED = {torch.ops.aten.detach_.default}  # nn.Module.zero_grad(set_to_none=False) calls it


class GradInBuffer(torch.Tensor):
    """``p.grad`` of a param whose grad distopt holds in its buffers; see
    [Note: p.grad under distopt]."""

    param_name: str
    zeroed: bool

    @staticmethod
    def __new__(cls, param: nn.Parameter, name: str) -> GradInBuffer:
        marker = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        marker.param_name = name
        marker.zeroed = False
        return marker

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        marker = next(a for a in args if isinstance(a, GradInBuffer))
        if func is torch.ops.aten.zero_.default:
            marker.zeroed = True  # the grads were zeroed: the next backward starts a new step
            return marker
        if func in _ALLOWED:
            return marker
        raise RuntimeError(
            f"p.grad of parameter '{marker.param_name}' is not readable under distopt (it "
            f"was used by {func}): distopt moves each gradient into its data-parallel "
            "buffers as soon as autograd computes it, and after the reduction each rank holds "
            "the reduced gradient of its own shard only, so no rank has what torch's DDP leaves "
            "in p.grad. "
            "Pass the optimizer (distopt.DistributedOptimizer or BasicOptimizer) what you "
            "read p.grad for: clip_grad=max_norm for torch.nn.utils.clip_grad_norm_ (the "
            "global norm is opt.step().grad_norm, get_total_norm's), clip_grad_value=v for "
            "clip_grad_value_, log_grad_norms=True for each param's grad norm "
            "(opt.step().grad_norms, by name). With torch.amp.GradScaler, scaler.step(opt) "
            "unscales before clipping. See docs/mixed-precision.md"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"GradInBuffer(param='{self.param_name}', shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")

    def __deepcopy__(self, memo: Any) -> None:
        return None  # a copy of the model has no grads in distopt's buffers


class GradMarkers:
    """Each param's marker, and which params hold theirs now (those with a grad in the buffers
    since the last zero)."""

    def __init__(self, params: list[nn.Parameter], names: dict[nn.Parameter, str]) -> None:
        self._markers = {p: GradInBuffer(p, names[p]) for p in params}
        self._names = names
        self._marked: set[nn.Parameter] = set()

    def mark(self, param: nn.Parameter) -> None:
        """``param``'s grad is in the buffers now."""
        marker = self._markers[param]
        marker.zeroed = False
        param.grad = marker
        self._marked.add(param)

    def drop(self, param: nn.Parameter) -> None:
        param.grad = None
        self._marked.discard(param)

    def clear(self) -> None:
        """A new step, or the wrapper lets go: no param keeps a marker."""
        for param in self._marked:
            param.grad = None
        self._marked.clear()

    def all_cleared(self) -> bool:
        """Whether something outside distopt cleared every marker (``model.zero_grad()``); an
        error if it cleared some and not others."""
        cleared = [p for p in self._marked
                   if p.grad is not self._markers[p] or self._markers[p].zeroed]
        if not cleared:
            return False
        if len(cleared) == len(self._marked):
            return True
        raise RuntimeError(
            f"the gradient of parameter '{self._names[cleared[0]]}' was cleared (p.grad "
            f"set to None or zeroed) but those of {len(self._marked) - len(cleared)} other "
            "parameters were not: distopt zeroes a step's gradients as a whole; call "
            "optimizer.zero_grad() (or zero_grad() of the whole model) before the step's first "
            "backward"
        )
