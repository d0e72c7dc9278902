"""One optimizer on every rank: its param groups and options compared before the first step.

[Note: one optimizer on every rank]
The DDP compares the model and its element-wise layout across ranks when it is built ([Note:
one model on every rank] in cross_rank/model.py). The optimizer then decides the rest on each rank
alone: which params go to which group, each group's class and options (lr, betas, weight
decay, ...) and the step's own options (clipping, remainders, state dtype). A rank that decides
otherwise (a param group built from a rank-dependent list, an lr read from another config)
gives other owners of whole tensors, so other buckets, and the first reduction aborts or
hangs; or it keeps the same buckets and steps its shards by other rules, and the model the
ranks gather is trained by two optimizers at once, silently. So the optimizer, once built and
before any collective of its own, compares a description of all of it: one 32-byte digest per
rank over the data-parallel, replicate and tensor-parallel groups (the same all-gather as the
model check), and only when digests differ the descriptions, to name the first group and
option that differ and the ranks. Every rank raises the same ``ValueError``. Option values are
described by value (numbers, strings, tensors' values), callables by name, other objects by
type, so that nothing that differs only in its address across processes counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..parallel.process_groups import ParallelGroups
from .agree import compared_groups, raise_unless_same

Description = tuple[Any, ...]

_FIX = ("build the optimizer with the same param groups, optimizer classes and options on "
        "every rank")


def _value(value: Any) -> Any:
    """``value`` as something that compares equal across processes when it means the same."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), _value(value.tolist()) if value.numel() <= 64
                else tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(_value(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _value(v)) for k, v in value.items()))
    if callable(value):
        return ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    return ("object", type(value).__qualname__)


def describe_optimizer(
    param_groups: Sequence[Mapping[str, Any]],
    classes: Sequence[type],
    model_params: Sequence[Sequence[nn.Parameter]],
    names: Mapping[nn.Parameter, str],
    step_options: Any,
) -> Description:
    """The optimizer as every rank must build it: each group's class, options and params
    (by name), and the step's options."""
    groups = tuple(
        (f"{cls.__module__}.{cls.__qualname__}",
         tuple(sorted((k, _value(v)) for k, v in group.items() if k != "params")),
         tuple(names[p] for p in params))
        for group, cls, params in zip(param_groups, classes, model_params, strict=True)
    )
    step = {f.name: getattr(step_options, f.name) for f in dataclasses.fields(step_options)}
    if "offload_dir" in step:  # each rank's own disk: whether the tier is on must agree
        step["offload_dir"] = step["offload_dir"] is not None
    return (groups, _value(step))


def first_difference(descriptions: list[Description], ranks: list[int], group_name: str
                     ) -> str | None:
    """The first way a rank's optimizer differs from the first rank's, in words."""
    first = descriptions[0]
    for rank, other in zip(ranks[1:], descriptions[1:], strict=True):
        if other == first:
            continue
        where = f"between ranks {ranks[0]} and {rank} of the {group_name} group (ranks {ranks})"
        (groups_a, step_a), (groups_b, step_b) = first, other
        if len(groups_a) != len(groups_b):
            what = f"{len(groups_a)} param groups against {len(groups_b)}"
        else:
            what = next((_group_difference(i, a, b)
                         for i, (a, b) in enumerate(zip(groups_a, groups_b, strict=True))
                         if a != b), None)
            what = what or f"the step's options differ: {dict(step_a)} against {dict(step_b)}"
        return f"the optimizer differs {where}: {what}; {_FIX}"
    return None


def _group_difference(index: int, a: Description, b: Description) -> str:
    (cls_a, options_a, params_a), (cls_b, options_b, params_b) = a, b
    if cls_a != cls_b:
        return (f"param group {index} is stepped by {cls_a.rsplit('.', 1)[-1]} against "
                f"{cls_b.rsplit('.', 1)[-1]}")
    if params_a != params_b:
        only_a = sorted(set(params_a) - set(params_b))
        only_b = sorted(set(params_b) - set(params_a))
        return (f"param group {index} holds other params ({only_a[:3]} against {only_b[:3]})"
                if only_a or only_b else f"param group {index} holds its params in another order")
    mine, theirs = dict(options_a), dict(options_b)
    key = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
    return f"param group {index} has {key}={mine.get(key)!r} against {key}={theirs.get(key)!r}"


def check_same_optimizer(description: Description, parallel: ParallelGroups,
                         device: torch.device) -> None:
    """Raise the same ``ValueError`` on every rank of ``parallel``'s groups unless all hold the
    same ``description``; see [Note: one optimizer on every rank]. Nothing on one process."""
    groups = compared_groups(parallel)
    if not groups:
        return
    digest = hashlib.sha256(repr(description).encode()).digest()
    # Every group compares the whole description: param names and options do not depend on
    # the tensor-parallel coordinate.
    raise_unless_same([(name, group, description) for name, group, _ in groups],
                      lambda _: digest, first_difference, device, None)
