"""What every load checks before it changes anything, and how the ranks agree on the verdict.

[Note: which ranks agree]
A load checks everything first, then agrees: when any rank found a problem, every rank raises
the same CheckpointError. Problems that only one rank can see (its slice of a file, its piece
of a dict) would otherwise leave the other ranks waiting in the load's next collective. The
ranks that agree are exactly those the load is collective over anyway:

* ``load_checkpoint``: the checkpoint group (the DP group, or every rank with TP), over which
  DCP reads;
* ``opt.load_state_dict``: the DP group when the state is sharded (its ranks then gather the
  params), nobody when every rank holds all of it (nothing to gather);
* ``load_plain_checkpoint``: nobody, since it needs no communication.

So agreeing never turns a load that needs no communication into a collective one, and no rank
is left in a collective that another rank skipped.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..comm import collectives as comm
from ..optim.base import BufferOptimizer
from .files import CheckpointError
from .format import Optimizer, check_whole_state_fits, group_class_paths, hyper_params, whole_names

Models = Any  # a DistributedDataParallel, its module, or a list of them (model chunks)


def check_pair(ddp: Models, opt: Any) -> None:
    """``ddp`` must be the model(s) ``opt`` was built over (the DDPs or their modules)."""
    if not isinstance(opt, BufferOptimizer):
        raise TypeError(
            "opt must be a distopt.DistributedOptimizer or distopt.BasicOptimizer, got "
            f"{type(opt).__name__}; plain torch optimizers save with torch.save"
        )
    if opt.model_parallel_group is not None:
        raise ValueError(
            "checkpoints of an optimizer with a model_parallel_group are not supported: every "
            "model-parallel part would write the same names into one checkpoint. Save each "
            "part's opt.state_dict() and model state with torch.save, one file per rank"
        )
    given = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    if len(given) != len(opt.models) or any(
        g is not m and g is not m.module for g, m in zip(given, opt.models, strict=False)
    ):
        raise ValueError(
            "ddp is not the model the optimizer was built over: pass the same "
            "distopt.DistributedDataParallel (or the list of model chunks) given to the optimizer"
        )


def check_optimizer_class(opt: Optimizer, saved: list[str], source: str, *,
                          otherwise: str | None = None) -> None:
    """The state in ``source`` must be of the classes the optimizer steps its groups with:
    ``saved`` holds the class path of each saved param group (a group count that differs is
    left to check_groups)."""
    current = group_class_paths(opt)
    fix = "build the optimizer with the saved class" + (f", or {otherwise}" if otherwise else "")
    if len(set(saved)) == 1 and len(set(current)) == 1:
        if saved[0] != current[0]:
            raise CheckpointError(
                f"{source} holds {saved[0]} state, this optimizer wraps {current[0]}: {fix}"
            )
        return
    for index, (old, new) in enumerate(zip(saved, current, strict=False)):
        if old != new:
            raise CheckpointError(
                f"param group {index} of {source} holds {old} state, this optimizer steps the "
                f'group with {new}: {fix} (the group\'s "optimizer" key)'
            )


def check_whole_state(opt: Optimizer, whole_state: dict[str, dict[str, Any]]) -> None:
    """Whole-parameter state (``{name: {key: [shape, dtype]}}``) loads only into params owned
    whole; see [Note: whole-tensor state] in format.py. The same verdict on every rank."""
    whole = whole_names(opt)
    for name, entries in whole_state.items():
        for key, (shape, _) in entries.items():
            check_whole_state_fits(name, key, tuple(shape), name in whole)


def check_same_model(saved: dict[str, list[int] | None], current: dict[str, list[int] | None],
                     what: str, source: str) -> None:
    """``source`` must hold the entries ``what`` of this model (name -> shape, None for an
    object), no more, no fewer, each of the same shape."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    reshaped = [k for k in current
                if k in saved and list(current[k] or []) != list(saved[k] or [])]
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        parts.append(f"not in this model: {', '.join(unexpected[:5])}")
    for k in reshaped[:5]:
        parts.append(f"'{k}' has shape {tuple(saved[k] or ())} in the checkpoint, "
                     f"{tuple(current[k] or ())} here")
    raise CheckpointError(
        f"{source} is of another model ({what}: {'; '.join(parts)}): load a checkpoint of this "
        "model, or build the model that was saved"
    )


def check_groups(opt: Optimizer, saved: list[list[str]], source: str,
                 current: list[list[str]] | None = None) -> None:
    """The saved param groups must hold the same parameters as this optimizer's (``current``:
    a pipeline's whole model's groups)."""
    if current is None:
        current = [group["params"] for group in hyper_params(opt)]
    if len(saved) != len(current):
        raise CheckpointError(
            f"{source} has {len(saved)} param groups, this optimizer {len(current)}: build the "
            "optimizer with the same param groups as the run that saved it"
        )
    for index, (old, new) in enumerate(zip(saved, current, strict=True)):
        if sorted(old) != sorted(new):
            missing = sorted(set(new) - set(old))[:3]
            extra = sorted(set(old) - set(new))[:3]
            raise CheckpointError(
                f"param group {index} of {source} holds other parameters than this optimizer's "
                f"(only here: {missing}, only saved: {extra}): build the optimizer with the same "
                "param groups as the run that saved it"
            )


def check_scaler(opt: Optimizer, saved_type: str | None, source: str) -> None:
    current = None if opt.loss_scaler is None else type(opt.loss_scaler).__name__
    if saved_type != current:
        raise CheckpointError(
            f"{source} was saved with loss scaler {saved_type}, this optimizer has {current}: "
            "pass the same kind of loss_scaler to the optimizer (None for bf16 and fp32)"
        )


def agree(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise the same CheckpointError on every rank of ``group`` when any rank found a problem;
    see [Note: which ranks agree]."""
    errors = comm.all_gather_object(error, group)
    for rank, message in enumerate(errors):
        if message is not None:
            where = f" (found on rank {rank})" if len(errors) > 1 else ""
            raise CheckpointError(message + where)
