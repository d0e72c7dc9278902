"""Which params hold their ``p.grad`` marker now, and what the user's loop did to ``p.grad`` by
the step: left it, set it to None, or assigned a tensor. See [Note: p.grad under distopt] in
ddp/grads/grad_marker.py.
"""

from __future__ import annotations

import torch
from torch import nn

from .grad_marker import GradInBuffer
from .grad_reads import GradReads


class GradMarkers:
    """Each param's marker, and which params hold theirs now (those with a grad in the buffers
    since the last zero)."""

    def __init__(self, params: list[nn.Parameter], names: dict[nn.Parameter, str],
                 reads: GradReads) -> None:
        self._markers = {p: GradInBuffer(p, names[p], reads) for p in params}
        self._names = names
        self._marked: set[nn.Parameter] = set()

    def mark(self, param: nn.Parameter) -> None:
        """``param``'s grad is in the buffers now."""
        marker = self._markers[param]
        marker.slot.zeroed = False
        param.grad = marker
        self._marked.add(param)

    def drop(self, param: nn.Parameter) -> None:
        param.grad = None
        self._marked.discard(param)

    def clear(self, *, set_to_none: bool = True) -> None:
        """A new step, or the wrapper lets go: no param keeps a marker; or, not
        ``set_to_none`` (``zero_grad(set_to_none=False)``), each param that had one keeps it,
        zeroed: it answers zeros, as torch's zeroed grad does, until the next backward."""
        for param in self._marked:
            if set_to_none:
                param.grad = None
            else:
                self._markers[param].slot.zeroed = True
                param.grad = self._markers[param]
        if set_to_none:
            self._marked.clear()

    def replaced(self) -> tuple[list[nn.Parameter], list[tuple[nn.Parameter, torch.Tensor]]]:
        """At the step: the params whose marker the user's loop set to None (left out of the
        step, as torch.optim skips a grad of None), and those it assigned a tensor, with it."""
        dropped, assigned = [], []
        for param, marker in self._markers.items():  # in one order on every rank
            grad = param.grad
            if param not in self._marked or getattr(grad, "slot", None) is marker.slot:
                continue
            if grad is None:
                dropped.append(param)
                continue
            if isinstance(grad, GradInBuffer) or grad.shape != param.shape:
                what = ("the grad of another parameter" if isinstance(grad, GradInBuffer)
                        else f"a tensor of shape {tuple(grad.shape)}")
                raise RuntimeError(
                    f"p.grad of parameter '{self._names[param]}' was assigned {what}: assign "
                    f"a tensor of the parameter's shape {tuple(param.shape)} (or None, to "
                    "leave it out of the step)"
                )
            assigned.append((param, grad))
        return dropped, assigned

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
