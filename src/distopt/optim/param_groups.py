"""Param groups and the inner torch optimizers: one per optimizer class.

A group is a torch-style dict; under ``CLASS_KEY`` it may name its own optimizer class, and
``group_class`` is the one place that reads it (the optimizer, ownership plans and checkpoints
all ask it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..parallel.dtensor import is_dtensor, local_tensor
from .kinds import check_optimizer_cls, needs_matrices, whole_tensor_cost

if TYPE_CHECKING:
    from ..ddp.wrapper import DistributedDataParallel

OptimizerClass = type[torch.optim.Optimizer]

CLASS_KEY = "optimizer"
"""The key under which a param group names its optimizer class."""

NAMES_KEY = "param_names"
"""The key under which a param group lists its params' names when they were given as
``(name, param)`` pairs, as torch.optim's groups do: one per model param of the group (the
inner group's ``"params"`` are this rank's pieces of them)."""


def group_class(group: dict[str, Any], default: OptimizerClass) -> OptimizerClass:
    """The optimizer class that steps ``group``: the one it names, or ``default``."""
    return group.get(CLASS_KEY, default)


def whole_tensor_costs(
    param_groups: Sequence[dict[str, Any]],
    group_classes: Sequence[Any],
    names: dict[nn.Parameter, str],
) -> dict[nn.Parameter, float]:
    """The params of whole-tensor optimizers' groups and the cost their owners balance, after
    checking that each class can be sharded and each param suits its class (on every rank, as
    nothing here communicates)."""
    costs: dict[nn.Parameter, float] = {}
    for index, (group, cls) in enumerate(zip(param_groups, group_classes, strict=True)):
        check_optimizer_cls(cls, where=f'param group {index}\'s "{CLASS_KEY}"')
        cost = whole_tensor_cost(cls)
        if cost is None:
            continue
        for p in group["params"]:
            if is_dtensor(p) and any(pl.is_shard() for pl in p.placements):
                raise ValueError(
                    f"parameter '{names[p]}' is sharded over the tensor-parallel mesh "
                    f"({p.placements}), but {cls.__name__} needs each matrix whole: put it in a "
                    'group with "optimizer": torch.optim.AdamW, or replicate it over TP'
                )
            shape = tuple(local_tensor(p).shape)
            if needs_matrices(cls) and len(shape) != 2:
                raise ValueError(
                    f"parameter '{names[p]}' of shape {shape} is in a {cls.__name__} group, but "
                    f"{cls.__name__} steps 2-D matrices only: put it in a group of its own with "
                    '"optimizer": torch.optim.AdamW (the usual home of embeddings, norms and '
                    "biases)"
                )
            costs[p] = cost(shape)
    return costs


def ignored_params(models: list[DistributedDataParallel]) -> dict[nn.Parameter, str]:
    """The trainable params of the models' torch DDP ignore lists, by their module names;
    see [Note: ignored params stepped locally] in optim/local_params.py."""
    return {p: n for m in models for n, p in m.module.named_parameters()
            if n in m.ignored_names and p.requires_grad and p.numel() > 0}


def normalize_param_groups(
    params: Iterable[Any] | None, models: list[DistributedDataParallel]
) -> tuple[list[dict[str, Any]], list[list[nn.Parameter]]]:
    """Torch-style param groups over the DDPs' params, checked to name each trainable model
    param at most once, and the params of torch DDP's ignore list each group holds (taken out
    of it: [Note: ignored params stepped locally] in optim/local_params.py).

    As torch.optim, a group's params may be ``(name, param)`` pairs (``named_parameters()``):
    the group then lists the params under ``"params"`` and their names, as given, under
    ``"param_names"``, and every group must be named or none."""
    known = {p: m for m in models for p in m.params}
    ignored = ignored_params(models)
    if params is None:
        return [{"params": [p for m in models for p in m.params]}], [list(ignored)]
    groups = list(params)
    if not groups:
        raise ValueError("params is an empty list; pass None to optimize every trainable param")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen: set[nn.Parameter] = set()
    result: list[dict[str, Any]] = []
    local: list[list[nn.Parameter]] = []
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("each param group must be a dict with a 'params' entry")
        plist = group["params"]
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        plist, names = _split_names(plist, index)
        if names is not None:
            group = {**group, NAMES_KEY: names}
        if NAMES_KEY in group:
            if len(group[NAMES_KEY]) != len(plist):
                raise ValueError(
                    f"param group {index} has {len(group[NAMES_KEY])} param_names for "
                    f"{len(plist)} params: give one name per param, or (name, param) pairs")
            # Nothing to step in an empty param, as in torch.optim; its name goes with it.
            group = {**group, NAMES_KEY: [n for n, p in zip(group[NAMES_KEY], plist, strict=True)
                                          if p.numel() > 0]}
        plist = [p for p in plist if p.numel() > 0]
        local.append([p for p in plist if p in ignored])
        if local[-1]:  # stepped beside the main params, each rank its own copy
            if NAMES_KEY in group:
                group = {**group, NAMES_KEY: [n for n, p in zip(group[NAMES_KEY], plist,
                                                                strict=True) if p not in ignored]}
            plist = [p for p in plist if p not in ignored]
        for p in plist:
            if p not in known:
                raise ValueError(
                    f"a param group holds a tensor of shape {tuple(p.shape)} that is not a "
                    "trainable parameter of the wrapped model(s); frozen params "
                    "(requires_grad=False) cannot be optimized, and groups must name the "
                    "module's own parameters"
                )
            if p in seen:
                raise ValueError(
                    f"parameter '{known[p].param_names[p]}' appears in more than one param group"
                )
            seen.add(p)
        result.append({**group, "params": plist})
    if len({NAMES_KEY in group for group in result}) > 1:
        raise ValueError(
            "some param groups name their params ((name, param) pairs, from "
            "named_parameters()) and some do not: torch.optim takes all named or none; name "
            "every group's params, or none"
        )
    _check_once([p for group in local for p in group], ignored)
    return result, local


def _split_names(plist: list[Any], index: int) -> tuple[list[Any], list[str] | None]:
    """A group's params and, where they are ``(name, param)`` pairs, their names."""
    pairs = [isinstance(p, tuple) for p in plist]
    if not any(pairs):
        for p in plist:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param group {index} holds a {type(p).__name__}: params are tensors (the "
                    "module's parameters) or (name, param) pairs, as named_parameters() gives"
                )
        return plist, None
    if not all(pairs):
        raise ValueError(
            f"param group {index} names some of its params ((name, param) pairs) and not "
            "others: torch.optim takes all named or none"
        )
    for p in plist:
        if len(p) != 2 or not isinstance(p[0], str) or not isinstance(p[1], torch.Tensor):
            raise TypeError(
                f"param group {index} holds {p!r:.80}: a named param is a (name, param) pair "
                "of a str and a tensor, as named_parameters() gives"
            )
    return [p for _, p in plist], [n for n, _ in plist]

# [Note: one optimizer, several classes]
# The usual recipe for Muon trains the hidden matrices with Muon and the embeddings, norms and
# biases with AdamW. A param group may therefore name its own class under "optimizer"; groups
# without one use optimizer_cls. distopt builds one inner torch optimizer per class over that
# class's groups (in the user's order within it), and shares among them: the list
# ``param_groups`` (the very dicts they step with, in the user's order, so torch's LR
# schedulers set every group's lr), one ``state`` (their params are disjoint), and everything
# of the step around them: one grad sync, one loss-scaler verdict and one global clip norm over
# all grads, one param gather, one StepResult. optimizer_kwargs go to optimizer_cls only; a
# group of another class gives its options in the group, its class's defaults filling the
# rest. The groups of whole-tensor classes ([Note: optimizer kinds] in optim/kinds.py)
# have their params owned whole (the DDP lays its buffers out for them; see [Note: layout
# planned once] in layout/model_layout.py) and their main params take each param's shape.


def build_inner_optimizers(
    groups: Sequence[dict[str, Any]],
    classes: Sequence[OptimizerClass],
    optimizer_cls: OptimizerClass,
    optimizer_kwargs: dict[str, Any],
    device: torch.device,
) -> tuple[list[torch.optim.Optimizer], torch.optim.Optimizer]:
    """One inner torch optimizer per class over that class's ``groups`` (dicts whose params are
    main params), and the one whose class and defaults stand for the whole; see
    [Note: one optimizer, several classes]. torch.optim keeps each group's dict as given, so
    the inner optimizers step with the very dicts of ``groups``."""
    groups_of: dict[OptimizerClass, list[dict[str, Any]]] = {}
    for group, cls in zip(groups, classes, strict=True):
        groups_of.setdefault(cls, []).append(group)
    optimizers = []
    for cls, class_groups in groups_of.items():
        # optimizer_kwargs belong to optimizer_cls; groups of other classes give their
        # options in the group and take their class's defaults for the rest.
        given = optimizer_kwargs if cls is optimizer_cls else {}
        kwargs = {**given, **default_kernel_kwargs(cls, device, given)}
        optimizers.append(cls(list(class_groups), **kwargs))
    # optimizer_cls's inner optimizer (the first group's class's when no group uses it).
    main = next((o for o in optimizers if type(o) is optimizer_cls), optimizers[0])
    return optimizers, main


def default_kernel_kwargs(
    optimizer_cls: type[torch.optim.Optimizer], device: torch.device, user_kwargs: dict[str, Any]
) -> dict[str, bool]:
    """The ``foreach``/``fused`` keyword distopt adds to the inner optimizer's arguments.

    The pieces of a buffer are many small fp32 tensors, so the per-tensor loop torch falls back
    to would cost a kernel launch per piece and per operation: on CUDA the fused kernel (one
    launch per step) where the class has one, else the foreach kernels. A choice the user made
    is left alone (``foreach=`` given, or ``fused=True``); ``fused=False`` or ``None`` alone
    still gets ``foreach``. Decides from the device's type only: nothing here touches the
    device.
    """
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    if "foreach" in user_kwargs or user_kwargs.get("fused"):
        return {}
    if device.type == "cuda" and "fused" in accepted and "fused" not in user_kwargs:
        return {"fused": True}
    if "foreach" in accepted:
        return {"foreach": True}
    return {}


def _check_once(local: list[nn.Parameter], ignored: dict[nn.Parameter, str]) -> None:
    """An ignored param named in two groups is refused as any other."""
    seen: set[nn.Parameter] = set()
    for p in local:
        if p in seen:
            raise ValueError(f"parameter '{ignored[p]}' appears in more than one param group")
        seen.add(p)
