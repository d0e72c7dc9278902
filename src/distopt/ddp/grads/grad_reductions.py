"""How a reduction of ``p.grad`` that the agreed statistics do not hold is answered from the
shards: each rank reduces the grad with the reduction's neutral element outside its piece, and
the ranks' results combine by a sum, a max or a min (``GradReads.reduce``). Sums of disjoint
elements and maxima of disjoint ones are exact in any order, so a sum, a mean, an ``amax`` or
``amin`` and a norm of any order, whole or along some dimensions (Gradient Centralization's
row means), answer what torch's would on the whole grad. Why: [Note: p.grad under distopt] in
ddp/grads/grad_marker.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class ShardedReduction:
    """What each rank computes (``partial``, on the grad filled with ``fill`` outside its
    piece), how the ranks' results combine (``combine``) and the last touch (``finish``)."""

    partial: Callable[[torch.Tensor], torch.Tensor]
    fill: float
    combine: str
    finish: Callable[[torch.Tensor], torch.Tensor]


REDUCTIONS = frozenset({
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
    aten.linalg_vector_norm.default,
})


def _dims(shape: torch.Size, dim: Any) -> tuple[int, ...]:
    """The dimensions reduced: all of them for None or an empty list, as torch reads them."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(len(shape)))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({d % max(len(shape), 1) for d in dims}))


def _over(op: str, dims: tuple[int, ...], keepdim: bool) -> Callable[[torch.Tensor], Any]:
    def reduce(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            return getattr(x, op)()
        return getattr(x, op)(dim=dims, keepdim=keepdim)

    return reduce


def sharded_reduction(func: Any, shape: torch.Size, dtype: torch.dtype, args: tuple,
                      kwargs: dict) -> ShardedReduction:
    """``func(p.grad, *args, **kwargs)`` as a reduction over the shards."""
    named = dict(zip([a.name for a in func._schema.arguments[1:]], args, strict=False))
    named.update(kwargs)
    keepdim = bool(named.get("keepdim", False))
    dims = _dims(shape, named.get("dim"))
    out_dtype = named.get("dtype") or dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(out_dtype)

    if func in (aten.sum.default, aten.sum.dim_IntList):
        return ShardedReduction(_over("sum", dims, keepdim), 0.0, "sum", cast)
    if func in (aten.mean.default, aten.mean.dim):
        count = math.prod(shape[d] for d in dims)
        return ShardedReduction(_over("sum", dims, keepdim), 0.0, "sum",
                                lambda t: cast(t / count))
    if func in (aten.amax.default, aten.max.default):
        return ShardedReduction(_over("amax", dims, keepdim), -math.inf, "max", cast)
    if func in (aten.amin.default, aten.min.default):
        return ShardedReduction(_over("amin", dims, keepdim), math.inf, "min", cast)
    return vector_norm(float(named.get("ord", 2)), dims, keepdim, out_dtype)


def vector_norm(ord: float, dims: tuple[int, ...], keepdim: bool,
                dtype: torch.dtype) -> ShardedReduction:
    """``torch.linalg.vector_norm`` of order ``ord`` over ``dims``."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    def of(op: str) -> Callable[[torch.Tensor], Any]:
        return lambda x: _over(op, dims, keepdim)(x.abs())

    if ord == math.inf:
        return ShardedReduction(of("amax"), 0.0, "max", cast)
    if ord == -math.inf:
        return ShardedReduction(of("amin"), math.inf, "min", cast)
    if ord == 0:
        return ShardedReduction(lambda x: _over("sum", dims, keepdim)((x != 0).double()), 0.0,
                                "sum", cast)
    return ShardedReduction(lambda x: _over("sum", dims, keepdim)(x.abs().pow(ord)), 0.0,
                            "sum", lambda t: cast(t.pow(1.0 / ord)))
