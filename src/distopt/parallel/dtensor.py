"""Access to DTensor params: their local shards and the local part of their grads.

distopt keeps a DTensor param's local shard in its contiguous buffers and treats it as the
parameter; these helpers are the only places that reach into a DTensor for it (see
[Note: DTensor params] in parallel/tensor_parallel.py). Any other tensor passes through
unchanged, so callers need not ask which kind they hold.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def _dtensor_cls() -> type | None:
    # A DTensor exists only once torch.distributed.tensor has been imported; until then no
    # tensor can be one, and importing it to ask would cost every process seconds of start-up.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else getattr(module, "DTensor", None)


def is_dtensor(tensor: Any) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(tensor, cls)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view, no copy); any other tensor as it is."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def alias_local(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (already holding the values) the storage of ``param``'s local shard."""
    if not is_dtensor(param):
        param.data = view
        return
    # ``param.data = DTensor.from_local(view, ...)`` leaves the DTensor's local tensor where it
    # was (no aliasing), so swap the local tensor itself, as FSDP2 does for its sharded params.
    with torch.no_grad():
        param._local_tensor = view
    if param.to_local().data_ptr() != view.data_ptr():
        raise RuntimeError(
            "this torch version does not let distopt alias a DTensor's local shard; "
            "report it with the torch version"
        )


def local_grad(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """The local part of a param's grad, laid out like the param's local shard."""
    if not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        # A Replicate param fed sequence-sharded activations (SequenceParallel's LayerNorm)
        # gets a Partial grad: sum it over the TP group now (the same collective in the same
        # backward order on every TP rank), since the DP buffer holds plain local values.
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor
