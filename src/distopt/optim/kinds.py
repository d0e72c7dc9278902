"""Which torch optimizers distopt can shard, and how: element by element, or whole tensors.

[Note: optimizer kinds]
distopt steps a rank's part of the model with an ordinary ``torch.optim`` optimizer, so what the
part may be depends on what the optimizer reads when it updates an element:

* Element-wise optimizers (``ELEMENTWISE_OPTIMIZERS``: Adam, AdamW, SGD, ...) read only that
  element's grad and state, so they give the same result on any split of a parameter: each
  rank owns an equal slice of every bucket, cut anywhere ([Note: layout rule] in
  layout/elementwise.py).
* Whole-tensor optimizers read the whole parameter: Muon orthogonalises each 2-D update with
  Newton-Schulz iterations, Adafactor keeps row and column statistics and scales by the
  parameter's RMS. Each of their params is owned whole by one rank, the buckets laid out so
  that no param crosses a shard boundary ([Note: whole-tensor layout] in layout/whole.py); the
  owner steps it alone, and the ordinary reduce-scatter and all-gather carry it: no collective
  is added, and the bytes sent grow only by the padding of those buckets. Which rank owns
  which param balances a cost per param: for Muon the multiply-adds of Newton-Schulz, for
  Adafactor (whose work is linear) the elements. A user's own class joins with
  ``register_whole_tensor_optimizer``. On a hierarchical mesh
  ([Note: hierarchical data parallelism] in parallel/groups.py) the owners are ranks of the shard
  group, and each replica's owner steps the param, as each replica keeps its own state.
* Anything else (LBFGS's line search over the whole model, SparseAdam's sparse grads) is
  refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..layout.whole import newton_schulz_cost

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
    torch.optim.Adadelta,
)
"""Optimizers whose update of an element depends only on that element's grad and state, so
they give the same result on any split of a parameter."""

WholeTensorCost = Callable[[Sequence[int]], float]
"""The optimizer's work on one parameter of the given shape, in any unit common to the class."""


def newton_schulz_shape_cost(shape: Sequence[int]) -> float:
    """Muon's work on a matrix: its Newton-Schulz products, ``max * min**2`` multiply-adds."""
    if len(shape) != 2:
        raise ValueError(f"Newton-Schulz runs on 2-D matrices, got shape {tuple(shape)}")
    return float(newton_schulz_cost(shape[0], shape[1]))


def numel_cost(shape: Sequence[int]) -> float:
    """The work of an optimizer that touches each element a fixed number of times."""
    return float(math.prod(shape))


_WHOLE_TENSOR: dict[type[torch.optim.Optimizer], WholeTensorCost] = {
    torch.optim.Muon: newton_schulz_shape_cost,
    torch.optim.Adafactor: numel_cost,
}

Cls = TypeVar("Cls", bound=type[torch.optim.Optimizer])


def register_whole_tensor_optimizer(
    optimizer_cls: Cls, cost: WholeTensorCost | None = None
) -> Cls:
    """Declare that ``optimizer_cls`` (and its subclasses) must see each parameter whole.

    distopt then has each param of its groups owned whole by one data-parallel rank, the owners
    chosen to balance ``cost(shape)`` summed per rank (default: the number of elements). Returns
    the class, so that it also works as a decorator. See [Note: optimizer kinds].
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"register_whole_tensor_optimizer takes a torch.optim.Optimizer subclass, got "
            f"{optimizer_cls!r}"
        )
    _WHOLE_TENSOR[optimizer_cls] = numel_cost if cost is None else cost
    return optimizer_cls


def whole_tensor_cost(optimizer_cls: type[torch.optim.Optimizer]) -> WholeTensorCost | None:
    """The cost function of a whole-tensor class, or None for an element-wise one. The nearest
    declared class in its MRO decides, so a subclass of AdamW declared whole-tensor is one."""
    for klass in optimizer_cls.__mro__:
        if klass in _WHOLE_TENSOR:
            return _WHOLE_TENSOR[klass]
        if klass in ELEMENTWISE_OPTIMIZERS:
            return None
    return None


def needs_matrices(optimizer_cls: type[torch.optim.Optimizer]) -> bool:
    """Whether the class steps 2-D matrices only (Muon)."""
    return issubclass(optimizer_cls, torch.optim.Muon)


def check_optimizer_cls(optimizer_cls: Any, where: str = "optimizer_cls") -> None:
    """Raise unless ``optimizer_cls`` is an optimizer class distopt can shard."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"{where} must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(the class, not an instance), got {optimizer_cls!r}"
        )
    if whole_tensor_cost(optimizer_cls) is None and not issubclass(
        optimizer_cls, ELEMENTWISE_OPTIMIZERS
    ):
        elementwise = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        whole = ", ".join(sorted(c.__name__ for c in _WHOLE_TENSOR))
        raise TypeError(
            f"{where} {optimizer_cls.__name__} is neither element-wise nor declared "
            "whole-tensor, so "
            f"distopt cannot shard it. Use an element-wise optimizer ({elementwise}) or a "
            f"whole-tensor one ({whole}); if each of its updates reads only whole parameters, "
            "declare it with distopt.register_whole_tensor_optimizer(cls) (each param is then "
            "owned whole by one rank)"
        )
