"""The optimizer's state as a dict that does not depend on the data-parallel size.

[Note: DP-size independent state]
A rank owns at most one contiguous piece of each flattened parameter (see [Note: layout rule]),
and where that piece lies depends on the DP size and the bucket size. So the state is keyed by
parameter name, never by piece, and every per-element tensor is a ``FlatShard``: the elements
``[offset, offset + local.numel())`` of the flattened parameter, which has ``numel`` elements.
A loader slices what its own piece needs out of any shard (or full tensor) that covers it, so a
dict written at one DP size loads at another. Per-parameter scalars (Adam's ``step``) are the
same for every piece of a parameter and are kept once per parameter.

``opt.state_dict()`` returns::

    {"format": "distopt.optimizer/1",
     "optimizer": "torch.optim.adamw.AdamW",           # class of the inner torch optimizer
     "param_groups": [{"lr": 0.01, ..., "params": ["emb.weight", ...]}, ...],
     "main_params": {name: FlatShard},                  # fp32 master values this rank owns
     "state": {name: {"exp_avg": FlatShard, "exp_avg_sq": FlatShard, "step": tensor(10.)}},
     "loss_scaler": {"type": "DynamicLossScaler", "state": {"scale": 65536.0, ...}} or None}

Names are the DDP's parameter names, prefixed by ``chunk{i}.`` when the optimizer spans several
model chunks. As with ``torch.optim``, the tensors are the live ones, not copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Number
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .checkpoint_files import CheckpointError
from .layout import ShardPiece

if TYPE_CHECKING:
    from .optimizer import _BufferOptimizer

FORMAT = "distopt.optimizer/1"


@dataclass(slots=True)
class FlatShard:
    """Elements ``[offset, offset + local.numel())`` of a flattened tensor of ``numel`` elements."""

    local: torch.Tensor  # 1-D
    offset: int
    numel: int

    def __post_init__(self) -> None:
        if self.local.dim() != 1:
            raise ValueError(f"FlatShard.local must be 1-D, got shape {tuple(self.local.shape)}")
        if not 0 <= self.offset <= self.offset + self.local.numel() <= self.numel:
            raise ValueError(
                f"FlatShard [{self.offset}, {self.offset + self.local.numel()}) lies outside "
                f"[0, {self.numel})"
            )

    @property
    def end(self) -> int:
        return self.offset + self.local.numel()


@dataclass(frozen=True, slots=True)
class OwnedPiece:
    """One piece this rank updates: its parameter's name, the model param, the fp32 main param."""

    name: str
    param: nn.Parameter
    main: nn.Parameter
    piece: ShardPiece

    @property
    def start(self) -> int:
        return self.piece.param_range.start

    @property
    def end(self) -> int:
        return self.piece.param_range.end


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_prefixes(opt: _BufferOptimizer) -> list[str]:
    """Name prefix of each model chunk: none for one model, ``chunk{i}.`` for several."""
    return [""] if len(opt.models) == 1 else [f"chunk{i}." for i in range(len(opt.models))]


def param_names(opt: _BufferOptimizer) -> dict[nn.Parameter, str]:
    names = {}
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        for p in model.params:
            names[p] = prefix + model.param_names[p]
    return names


def owned_pieces(opt: _BufferOptimizer) -> list[OwnedPiece]:
    """This rank's pieces in param-group order (at most one per parameter; see the layout rule)."""
    names = param_names(opt)
    owned = []
    for main in opt.main_params:
        param, piece = opt.piece_info(main)
        owned.append(OwnedPiece(name=names[param], param=param, main=main, piece=piece))
    return owned


def group_of(opt: _BufferOptimizer) -> dist.ProcessGroup | None:
    """The group a load must agree over: the DP group when state is sharded, else nobody."""
    return opt.models[0].process_group if opt._sharded else None


def agree(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise the same CheckpointError on every rank when any rank found a problem.

    Problems that only one rank can see (its slice of a file, its piece of a dict) would
    otherwise leave the other ranks waiting in the next collective.
    """
    errors = [error]
    if comm.group_size(group) > 1:
        errors = [None] * comm.group_size(group)
        dist.all_gather_object(errors, error, group=group)
    for rank, message in enumerate(errors):
        if message is not None:
            where = f" (found on rank {rank})" if len(errors) > 1 else ""
            raise CheckpointError(message + where)


# ---------------------------------------------------------------------- state_dict


def state_entry(value: Any, owned: OwnedPiece, key: str) -> Any:
    """One state value as stored: per-element tensors as FlatShards, scalars as they are."""
    if isinstance(value, torch.Tensor):
        if value.shape == owned.main.shape and value.dim() == 1:
            return FlatShard(value.detach(), owned.start, owned.param.numel())
        if value.dim() == 0:
            return value
    elif isinstance(value, Number):
        return value
    raise TypeError(
        f"optimizer state '{key}' of parameter '{owned.name}' is a {type(value).__name__} of "
        f"shape {tuple(getattr(value, 'shape', ()))}; distopt checkpoints hold per-element "
        "tensors and scalars only (element-wise optimizers keep nothing else)"
    )


def hyper_params(opt: _BufferOptimizer) -> list[dict[str, Any]]:
    """Each param group's options, with the names of its parameters in the order given."""
    names = param_names(opt)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in mps]}
        for group, mps in zip(opt.param_groups, opt.model_param_groups, strict=True)
    ]


def optimizer_state_dict(opt: _BufferOptimizer) -> dict[str, Any]:
    main_params: dict[str, FlatShard] = {}
    state: dict[str, dict[str, Any]] = {}
    for owned in owned_pieces(opt):
        main_params[owned.name] = FlatShard(owned.main.detach(), owned.start, owned.param.numel())
        entries = {k: state_entry(v, owned, k) for k, v in opt.state.get(owned.main, {}).items()}
        if entries:
            state[owned.name] = entries
    return {
        "format": FORMAT,
        "optimizer": class_path(type(opt.optimizer)),
        "param_groups": hyper_params(opt),
        "main_params": main_params,
        "state": state,
        "loss_scaler": scaler_state(opt),
    }


def scaler_state(opt: _BufferOptimizer) -> dict[str, Any] | None:
    scaler = opt.loss_scaler
    if scaler is None:
        return None
    return {"type": type(scaler).__name__, "state": scaler.state_dict()}


# ---------------------------------------------------------------------- load_state_dict


def check_groups(opt: _BufferOptimizer, saved: list[list[str]], source: str) -> None:
    """The saved param groups must hold the same parameters as this optimizer's."""
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


def check_scaler(opt: _BufferOptimizer, saved_type: str | None, source: str) -> None:
    current = None if opt.loss_scaler is None else type(opt.loss_scaler).__name__
    if saved_type != current:
        raise CheckpointError(
            f"{source} was saved with loss scaler {saved_type}, this optimizer has {current}: "
            "pass the same kind of loss_scaler to the optimizer (None for bf16 and fp32)"
        )


def piece_of(source: Any, owned: OwnedPiece, what: str) -> torch.Tensor:
    """The elements of ``owned``'s piece out of a full tensor, a FlatShard or a list of them."""
    numel = owned.param.numel()
    if isinstance(source, torch.Tensor) and source.dim() >= 1:
        if source.numel() != numel:
            raise CheckpointError(
                f"{what} of '{owned.name}' has shape {tuple(source.shape)}, the parameter "
                f"{tuple(owned.param.shape)}"
            )
        return source.reshape(-1)[owned.start : owned.end]
    shards = source if isinstance(source, list) else [source]
    if not shards or not all(isinstance(s, FlatShard) for s in shards):
        raise CheckpointError(
            f"{what} of '{owned.name}' is a {type(source).__name__}; expected a tensor of the "
            "parameter's elements, a distopt.checkpoint.FlatShard or a list of them"
        )
    parts, covered = [], owned.start
    for shard in sorted(shards, key=lambda s: s.offset):
        if shard.numel != numel:
            raise CheckpointError(
                f"{what} of '{owned.name}' has {shard.numel} elements, the parameter {numel}"
            )
        if shard.end <= covered or covered >= owned.end:
            continue
        if shard.offset > covered:
            break  # a gap: reported below
        stop = min(shard.end, owned.end)
        parts.append(shard.local[covered - shard.offset : stop - shard.offset])
        covered = stop
    if covered < owned.end:
        held = ", ".join(f"[{s.offset}, {s.end})" for s in shards)
        raise CheckpointError(
            f"{what} of '{owned.name}' holds elements {held} but this rank owns "
            f"[{owned.start}, {owned.end}): pass entries that cover this rank's elements (full "
            "tensors, or every rank's shards merged with distopt.checkpoint.merge_state_dicts)"
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def merge_state_dicts(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict holding every given rank's shards (lists of FlatShards per entry).

    What a rank of any DP size loads from the ``state_dict()`` of every rank of another run.
    """
    if not state_dicts:
        raise ValueError("merge_state_dicts needs at least one state dict")
    merged = {k: v for k, v in state_dicts[0].items() if k not in ("main_params", "state")}
    main_params: dict[str, list[FlatShard]] = {}
    state: dict[str, dict[str, Any]] = {}
    for sd in state_dicts:
        for name, shard in sd["main_params"].items():
            main_params.setdefault(name, []).append(shard)
        for name, entries in sd["state"].items():
            into = state.setdefault(name, {})
            for key, value in entries.items():
                if isinstance(value, FlatShard):
                    into.setdefault(key, []).append(value)
                else:
                    into.setdefault(key, value)  # a scalar, the same for every piece
    merged["main_params"], merged["state"] = main_params, state
    return merged


def new_state_value(value: Any, owned: OwnedPiece, group: dict[str, Any], key: str,
                    live: dict[str, Any]) -> Any:
    """A state value for this piece, reusing the live tensor where it fits."""
    if isinstance(value, torch.Tensor):
        old = live.get(key)
        if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
            return old.copy_(value)
        if value.dim() == 0 and key == "step" and not (group.get("capturable")
                                                       or group.get("fused")):
            return value.detach().to("cpu", copy=True)  # torch keeps plain step counts on CPU
        return value.detach().to(owned.main.device, copy=True)
    return value


def load_optimizer_state_dict(opt: _BufferOptimizer, state_dict: dict[str, Any]) -> None:
    """Validate ``state_dict`` against this rank's pieces, agree across ranks, then load it."""
    error, plan = None, None
    try:
        plan = _plan_load(opt, state_dict)
    except (CheckpointError, TypeError, KeyError) as exc:
        error = f"cannot load the optimizer state dict: {exc}"
    agree(error, group_of(opt))
    assert plan is not None
    mains, states = plan
    group_of_main = {id(m): g for g in opt.param_groups for m in g["params"]}
    with torch.no_grad():
        for owned, source in mains:
            owned.main.detach().copy_(source)
        new_states = []
        for owned, entries in states:
            live = opt.state.get(owned.main, {})
            group = group_of_main[id(owned.main)]
            new_states.append(
                (owned, {k: new_state_value(v, owned, group, k, live) for k, v in entries.items()})
            )
    install_loaded_state(opt, new_states, state_dict["param_groups"], state_dict["loss_scaler"])


def install_loaded_state(
    opt: _BufferOptimizer,
    piece_states: Iterable[tuple[Any, dict[str, Any]]],
    saved_groups: list[dict[str, Any]],
    saved_scaler: dict[str, Any] | None,
) -> None:
    """The last, infallible part of every load: optimizer state per piece, the groups'
    options, the loss scaler, and the model params rebuilt from the loaded main params."""
    for owned, new in piece_states:
        if new:
            opt.optimizer.state[owned.main] = new
        else:
            opt.optimizer.state.pop(owned.main, None)
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if opt.loss_scaler is not None:
        opt.loss_scaler.load_state_dict(saved_scaler["state"])
    opt.sync_model_params()


def _plan_load(opt: _BufferOptimizer, sd: dict[str, Any]):
    found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
    if found != FORMAT:
        raise CheckpointError(
            f"not a distopt optimizer state dict (format {found!r}, expected {FORMAT!r}); "
            "torch.optim state dicts load with distopt.load_plain_checkpoint"
        )
    expected = class_path(type(opt.optimizer))
    if sd["optimizer"] != expected:
        raise CheckpointError(
            f"the state dict is of {sd['optimizer']}, this optimizer wraps {expected}: build "
            "the optimizer with the class that was saved"
        )
    check_groups(opt, [g["params"] for g in sd["param_groups"]], "the state dict")
    scaler = sd["loss_scaler"]
    check_scaler(opt, None if scaler is None else scaler["type"], "the state dict")
    mains, states = [], []
    for owned in owned_pieces(opt):
        if owned.name not in sd["main_params"]:
            raise CheckpointError(f"no main params for '{owned.name}' in the state dict")
        mains.append((owned, piece_of(sd["main_params"][owned.name], owned, "main params")))
        entries = {}
        for key, value in sd["state"].get(owned.name, {}).items():
            scalar = isinstance(value, Number) or (
                isinstance(value, torch.Tensor) and value.dim() == 0
            )
            entries[key] = value if scalar else piece_of(value, owned, f"state '{key}'")
        states.append((owned, entries))
    return mains, states
