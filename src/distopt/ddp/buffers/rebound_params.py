"""Params whose ``.data`` was rebound to other storage: their values taken back into the buffers.

[Note: params rebound]
A param of a distopt model is a view of its buffer ([Note: layout rule] in
layout/elementwise.py): the optimizer steps the buffer (or the fp32 masters beside it) and the
param sees the result. torch code may rebind a param to other storage instead of writing into
it: ``torch.nn.utils.vector_to_parameters(vec, model.parameters())`` sets each ``param.data``
to a slice of ``vec``. torch DDP is fine with that (its reducer reads ``param.grad`` and the
optimizer steps the param, wherever it lives), but under distopt the param would stop seeing
the steps: training silently froze. So before each step (and each state dict of the
optimizer) the DDP compares every param's ``data_ptr()`` with its view's, one list of integers
built and compared in C (0.2 to 0.7 us a param on the 2-core CPU machine); a param found
elsewhere has its values copied into its view and is pointed back at it. Until then the param's
own storage holds the values written, so the forwards and backwards in between compute what
torch's would. Each forward glances at the first param alone (one ``data_ptr()``), which is
enough to see what rebinds every param (``vector_to_parameters`` over the model, a
conversion of the whole model), and takes them up there. The copy is a write into the buffer,
which bumps the buffer's version counter: with bf16 or fp16 params the fp32 masters follow it
in the same step ([Note: writes into the params] in optim/main_params.py), and fp32 params are
their own masters.

A param rebound to a tensor of another shape, dtype or device (``model.to(torch.bfloat16)``,
``model.cuda()`` after wrapping, which rebind every param) is not taken up: the buffers hold
the params as they were wrapped, so it is refused on every rank (every rank runs the same
code), at the next forward before its first collective (or, for a param rebound alone, at the
step, before any param moves), naming the param and the way that works: convert the model
before wrapping it.

With sharded params the params are placeholders between uses, and a rebinding then reads one
(``vec.view_as(param)``), which is refused, naming the param and ``gathered_params()``
([Note: reads between uses] in ddp/buffers/param_placeholder.py). Inside ``with
ddp.gathered_params():`` a rebound param's values go into the gathered buffer, and from there
into this rank's shard, when the block ends (``ShardedParams.keep_writes``), as a write into
the gathered params does. DTensor params are left to their own storage rules (not checked).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...parallel.dtensor import is_dtensor, local_tensor

_data_ptr = torch._C.TensorBase.data_ptr  # unbound: no method lookup a param


class ReboundParams:
    """The full-params views of a DDP's params, and the take-up of params rebound away from
    them; see [Note: params rebound]."""

    def __init__(self, params: list[nn.Parameter], views: list[torch.Tensor],
                 names: dict[nn.Parameter, str]) -> None:
        kept = [(p, v) for p, v in zip(params, views, strict=True) if not is_dtensor(p)]
        self._params = [p for p, _ in kept]
        self._views = [v for _, v in kept]
        self._pointers = [v.data_ptr() for v in self._views]
        self._names = names

    def glance(self) -> None:
        """``take_up`` if the first param was rebound: what rebinds every param
        (``model.to(dtype)``, ``vector_to_parameters`` over all of them) is seen here, at the
        cost of one ``data_ptr()``."""
        if self._params and _data_ptr(self._params[0]) != self._pointers[0]:
            self.take_up()

    def take_up(self) -> None:
        """Copy the values of every param rebound since into its view, and point it back."""
        if list(map(_data_ptr, self._params)) == self._pointers:  # the C loop: no frame a param
            return
        for param, view, pointer in zip(self._params, self._views, self._pointers,
                                        strict=True):
            if param.data_ptr() == pointer:
                continue
            take_up(param, view, self._names[param])


def take_up(param: nn.Parameter, view: torch.Tensor, name: str) -> None:
    """Copy ``param``'s values into ``view``, the storage distopt holds it in, and point it
    back at it; refused where its storage now has another shape, dtype or device."""
    now = param.data
    if (now.shape, now.dtype, now.device) != (view.shape, view.dtype, view.device):
        raise RuntimeError(
            f"parameter '{name}' was given other storage after the module was wrapped, of "
            f"shape {tuple(now.shape)}, {now.dtype} on {now.device}, where distopt's buffers "
            f"hold it as {tuple(view.shape)}, {view.dtype} on {view.device} (model.to(dtype), "
            f"model.cuda() or param.data = ... after wrapping): convert or move the model "
            f"before distopt.DistributedDataParallel(...), or wrap it again"
        )
    with torch.no_grad():
        view.copy_(now)
    param.data = view


def rebound_params_of(buffers: list[Any], names: dict[nn.Parameter, str]
                      ) -> ReboundParams | None:
    """The take-up of rebound params over ``buffers`` (ddp/buffers/buffer.py's, not imported here:
    buffer.py imports param_storage.py, which imports this); None with sharded params,
    whose rebinding is taken up by ``gathered_params()`` ([Note: params rebound])."""
    if any(buffer.param_data is None for buffer in buffers):
        return None
    params, views = [], []
    for buffer in buffers:
        for param, slot in zip(buffer.params, buffer.layout.params, strict=True):
            rng = slot.buffer_range
            params.append(param)
            views.append(buffer.param_data[rng.start : rng.end].view(local_tensor(param).shape))
    return ReboundParams(params, views, names)
