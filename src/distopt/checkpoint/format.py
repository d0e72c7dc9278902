"""The optimizer state as distopt stores it: keyed by parameter name, independent of the DP size.

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
     "loss_scaler": {"type": "DynamicLossScaler", "state": {"scale": 65536.0, ...}} or None,
     "rank_part": {"rank": 1, "world_size": 2}}        # sharded, unconsolidated: whose part

A param group of params given as ``(name, param)`` pairs also lists ``"param_names"``, the
names as given, as torch.optim's state dicts do.

Names are the DDP's parameter names, prefixed by ``chunk{i}.`` when the optimizer spans several
model chunks. As with ``torch.optim``, the tensors are the live ones, not copies. A checkpoint
holds the same entries under DCP keys (``main/{name}``, ``state/{name}/{key}``).

[Note: whole-tensor state]
A param of a whole-tensor optimizer (Muon, Adafactor; [Note: optimizer kinds]) is owned whole
by one rank and its main param has the param's shape, and so does its per-element state (Muon's
momentum). Such state is stored like any other, flattened into a ``FlatShard`` of the whole
param, so it reshards over DP as element-wise state does, and even loads into an element-wise
layout of the same class. What a flat shard cannot hold is state that is not one value per
element (Adafactor's row and column statistics, shapes such as (rows, 1)): *whole-parameter
state*. It is a plain tensor of its own shape, held and written by the owner alone (one DCP
key, present on one rank at save) and read whole by whichever rank owns the param at load;
``distopt.json`` lists each such entry, so a load tells it from per-element state before
reading anything. It has no meaning for a piece of a param, so a load into a layout that splits
the param element-wise refuses it (see checks.py). A state tensor is per-element when it has
the main param's shape; loaded values count as per-element when they are 1-D of the param's
numel or have the param's shape.

A param group that names its own class keeps the class under "optimizer"; stored state holds
the class's path instead (a string, which pickles and JSON hold), and every load checks each
group's class against the saved one and leaves the live group's class in place.

[Note: expert checkpoints]
Under expert parallelism ([Note: expert parallelism] in parallel/experts.py) a rank holds some
experts only, under local names (``moe.experts.0`` of EP rank 1 is the model's expert n). A
checkpoint knows every expert by its global name, the one the model with every expert local
gives it: the main params, the state and the ``model/`` entries of this rank's experts are keyed
by it, and what every rank must agree on (each param group's names, the manifest's parameters
and state_dict entries) lists every EP rank's experts, in the order the model with every
expert local registers them (``expert_names_everywhere``). The expert-DP ranks of one EP
coordinate hold one copy of its experts between them, as the dense group holds one of the dense
params, so each element is written once; the ``model/`` entries of experts are dealt over the
expert-DP group (parts.py). A load asks for its own pieces by global name, whatever (dp, ep) it
runs at, with every expert local (no ``experts=``) included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from numbers import Number
from typing import Any, Protocol

import torch
from torch import nn

from ..ddp.params.whole_module import module_entries
from ..layout.elementwise import ShardPiece
from ..optim.kinds import whole_tensor_cost
from ..optim.param_groups import CLASS_KEY
from .files import CheckpointError

STATE_DICT_FORMAT = "distopt.optimizer/1"

RANK_PART_KEY = "rank_part"
"""In ``opt.state_dict()`` of a sharded optimizer: ``{"rank": r, "world_size": w}``, the
process whose part of the state the dict holds (see [Note: torch's way of saving the
optimizer] in state_dict.py)."""

class Optimizer(Protocol):
    """What every checkpoint function reads of a distopt optimizer (either of them,
    optim/base.py): the whole interface between the two, so that neither reaches into the
    other's internals."""

    models: list[Any]  # the DDP wrappers: their params, names, buffers and groups
    parallel: Any  # ParallelGroups: the DP, replicate and TP groups
    options: Any  # StepOptions
    loss_scaler: Any
    model_parallel_group: Any
    model_param_groups: list[list[nn.Parameter]]  # each group's model params, as given
    default_param_groups: bool
    param_groups: list[dict[str, Any]]  # the inner groups, over main params
    optimizer: torch.optim.Optimizer  # the first inner optimizer (its state is everyone's)
    optimizers: list[torch.optim.Optimizer]  # one per class
    state: dict[Any, Any]
    state_precision: Any  # StatePrecision: the dtypes the state is held in
    tied_copies: frozenset[nn.Parameter]  # tied stage params another stage writes
    local_params: Any  # LocalParams of torch DDP's ignore list, or None

    @property
    def sharded(self) -> bool: ...

    def pieces(self) -> list[tuple[nn.Parameter, ShardPiece, nn.Parameter]]: ...

    def param_group_of(self, main: nn.Parameter) -> dict[str, Any]: ...

    def main_params_materialized(self) -> contextlib.AbstractContextManager[None]: ...

    def sync_model_params(self) -> None: ...

    def adopt_param_writes(self) -> None: ...

    def settle_offloaded(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...



@dataclass(slots=True)
class FlatShard:
    """Elements ``[offset, offset + local.numel())`` of a flattened tensor of ``numel`` elements."""

    local: torch.Tensor
    """The elements held, 1-D."""
    offset: int
    """Where ``local`` starts in the flattened tensor; the shard must lie inside it."""
    numel: int
    """The flattened tensor's number of elements."""

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


def as_shard(value: Any) -> Any:
    """The flat shard of ``opt.state_dict()``'s boxes (checkpoint/reshardable.py), else
    ``value``."""
    shard = getattr(value, "shard", None) if isinstance(value, torch.Tensor) else None
    return value if shard is None else shard


# The default torch.load (weights_only) reads a saved state dict's shards; see
# [Note: torch's way of saving the optimizer] in state_dict.py.
torch.serialization.add_safe_globals([FlatShard])


@dataclass(frozen=True, slots=True)
class OwnedPiece:
    """One piece this rank updates: its parameter's name, the model param, the fp32 main param."""

    name: str
    param: nn.Parameter
    main: nn.Parameter
    piece: ShardPiece
    whole: bool = False  # the param is owned whole by a whole-tensor optimizer's group

    @property
    def start(self) -> int:
        return self.piece.param_range.start

    @property
    def end(self) -> int:
        return self.piece.param_range.end


# ---------------------------------------------------------------------- names


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def model_prefixes(opt: Optimizer) -> list[str]:
    """Name prefix of each model chunk: none for one model, ``chunk{i}.`` for several; none for
    pipeline stages, whose names are the whole model's ([Note: pipeline checkpoints] in
    pipeline.py)."""
    if len(opt.models) == 1 or opt.parallel.pp_group is not None:
        return [""] * len(opt.models)
    return [f"chunk{i}." for i in range(len(opt.models))]


def buffer_keys(module: nn.Module) -> set[str]:
    """The ``state_dict()`` keys of ``module``'s buffers (every name each is registered under)."""
    return {name for name, _ in module.named_buffers(remove_duplicate=False)}


def global_name(model: Any, name: str) -> str:
    """A param's or a module entry's name in the model with every expert local; see
    [Note: expert checkpoints]."""
    return name if model.experts is None else model.experts.global_name(name)


def names_everywhere(model: Any, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(name, value) of ``model``'s entries, an expert's repeated under the global names of
    the experts in its place on every EP rank (the same structure); see [Note: expert
    checkpoints]."""
    return items if model.experts is None else model.experts.everywhere(items)


def untrained_entries(opt: Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Each model's state-dict tensors that are not trainable params (buffers, frozen params),
    by model prefix and global name: a load reads them as saved, where the trainable params
    come from the fp32 masters. A pipeline's stages load the whole model's checkpoint
    ([Note: pipeline checkpoints])."""
    entries = []
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        trainable = {id(p) for p in model.params}
        for key, value in module_entries(model.module).items():
            if isinstance(value, torch.Tensor) and id(value) not in trainable:
                entries.append((prefix + global_name(model, key), value.detach()))
    return entries


def param_names(opt: Optimizer) -> dict[nn.Parameter, str]:
    names = {}
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        for p in model.params:
            names[p] = prefix + global_name(model, model.param_names[p])
    return names


def _group_names(opt: Optimizer, params: list[nn.Parameter]) -> list[str]:
    """The names a param group lists: its params', with every EP rank's experts."""
    local = {}
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        for p in model.params:
            local[p] = (prefix + model.param_names[p], model)
    listed = [local[p] for p in params]
    experts = [m for m in opt.models if m.experts is not None]
    if not experts:
        return [name for name, _ in listed]
    # One model with experts (the optimizer refuses model chunks beside it; prefix "").
    return experts[0].experts.global_order([name for name, _ in listed])




def group_classes(opt: Optimizer) -> list[type[torch.optim.Optimizer]]:
    """The class of the inner optimizer that steps each param group, in ``param_groups`` order."""
    owner = {id(group): type(inner) for inner in opt.optimizers for group in inner.param_groups}
    return [owner[id(group)] for group in opt.param_groups]


def group_class_paths(opt: Optimizer) -> list[str]:
    return [class_path(cls) for cls in group_classes(opt)]


def saved_group_classes(groups: list[dict[str, Any]], optimizer: str) -> list[str]:
    """Each saved group's class: its own "optimizer" entry, else the state's class."""
    return [g.get(CLASS_KEY, optimizer) for g in groups]


def whole_names(opt: Optimizer) -> set[str]:
    """The names of the params that whole-tensor optimizers' groups own whole."""
    names = param_names(opt)
    return {names[p] for cls, mps in zip(group_classes(opt), opt.model_param_groups, strict=True)
            if whole_tensor_cost(cls) is not None for p in mps}


def owned_pieces(opt: Optimizer, *, per_rank: bool = False) -> list[OwnedPiece]:
    """This rank's pieces in param-group order (at most one per parameter; see the layout
    rule); refused with params of torch DDP's ignore list unless the form is this rank's own
    (``per_rank``): [Note: ignored params stepped locally] in optim/local_params.py."""
    local = getattr(opt, "local_params", None)
    if local is not None and not per_rank:
        raise CheckpointError(
            f"the optimizer steps params of torch DDP's ignore list ("
            f"{', '.join(repr(local.names[p]) for p in local.params)}), each rank its own copy "
            "and state, which this form (a replicated optimizer's whole state_dict(), "
            "consolidate_state_dict, sharded_state_dict, save_checkpoint, torch's DCP or plain "
            "checkpoints, the heal state) cannot hold, as it loads on other ranks: save each "
            "rank's own opt.state_dict() of a sharded optimizer (under 'local_state'), or step "
            "them with a torch optimizer of their own and distopt's over params=ddp.params")
    names = param_names(opt)
    whole = whole_names(opt)
    return [OwnedPiece(name=names[param], param=param, main=main, piece=piece,
                       whole=names[param] in whole)
            for param, piece, main in opt.pieces()]


def hyper_params(opt: Optimizer) -> list[dict[str, Any]]:
    """Each param group's options, with the names of its parameters in the order given and a
    class named by the group as its path; see [Note: whole-tensor state]."""
    return [
        {**{k: class_path(v) if k == CLASS_KEY and isinstance(v, type) else v
            for k, v in group.items() if k != "params"},
         "params": _group_names(opt, mps)}
        for group, mps in zip(opt.param_groups, opt.model_param_groups, strict=True)
    ]


def scaler_state(opt: Optimizer) -> dict[str, Any] | None:
    scaler = opt.loss_scaler
    if scaler is None:
        return None
    return {"type": type(scaler).__name__, "state": scaler.state_dict()}


def describe(value: Any) -> list[Any]:
    """A state_dict entry as the manifest lists it: ``[shape, dtype]``, or nulls for objects."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return [None, None]


# ---------------------------------------------------------------------- values


def state_entry(value: Any, owned: OwnedPiece, key: str) -> Any:
    """One state value as stored: per-element tensors as FlatShards, scalars as they are, and
    the whole-parameter state of a param owned whole as its tensor; see
    [Note: whole-tensor state]."""
    if isinstance(value, torch.Tensor):
        if value.shape == owned.main.shape and value.dim() >= 1:
            return FlatShard(value.detach().reshape(-1), owned.start, owned.param.numel())
        if value.dim() == 0:
            return value
        if owned.whole:
            return value.detach()
    elif isinstance(value, Number):
        return value
    raise TypeError(
        f"optimizer state '{key}' of parameter '{owned.name}' is a {type(value).__name__} of "
        f"shape {tuple(getattr(value, 'shape', ()))}; distopt checkpoints hold per-element "
        "tensors and scalars of element-wise optimizers (they keep nothing else), and besides "
        "tensors of any shape for params that whole-tensor optimizers own whole"
    )


def is_per_element(value: torch.Tensor, param: nn.Parameter) -> bool:
    """Whether loaded state ``value`` (dim >= 1) holds one value per element of ``param``: 1-D
    of its numel, or of its shape. Anything else is whole-parameter state."""
    return value.numel() == param.numel() and (
        value.dim() == 1 or tuple(value.shape) == tuple(param.shape)
    )


def check_loaded_state(opt: Optimizer, state: dict[str, dict[str, Any]]) -> None:
    """Whole-parameter state among loaded entries (``{name: {key: value}}``) must be of params
    owned whole here. Checks every param, not only this rank's pieces, so that every rank given
    the same entries reaches the same verdict without communicating."""
    whole = whole_names(opt)
    params = {name: p for p, name in param_names(opt).items()}
    for name, entries in state.items():
        param = params.get(name)
        if param is None or not isinstance(entries, dict):
            continue  # not a param of this model: left to the checks of the model
        for key, value in entries.items():
            if (isinstance(value, torch.Tensor) and value.dim() > 0
                    and not is_per_element(value, param)):
                check_whole_state_fits(name, key, tuple(value.shape), name in whole)


def loaded_entry(value: Any, owned: OwnedPiece, key: str) -> Any:
    """A state entry of an in-memory or plain state dict as ``owned`` holds it: a scalar as it
    is, per-element state as the piece's elements (shaped like its main param), whole-parameter
    state as it is where the param is owned whole. Raises CheckpointError otherwise."""
    if isinstance(value, Number) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return value
    if isinstance(value, torch.Tensor) and not is_per_element(value, owned.param):
        check_whole_state_fits(owned.name, key, tuple(value.shape), owned.whole)
        return value
    return piece_of(value, owned, f"state '{key}'")


def check_whole_state_fits(name: str, key: str, shape: tuple[int, ...], whole: bool) -> None:
    """Whole-parameter state loads only where its param is owned whole."""
    if not whole:
        raise CheckpointError(
            f"state '{key}' of parameter '{name}' has shape {shape}: it is whole-parameter "
            f"state (not one value per element), which only a rank owning '{name}' whole can "
            f"hold, but this optimizer splits '{name}' element-wise over the ranks. Load it "
            "with the param in a group of a whole-tensor optimizer (declare a class of your own "
            "with distopt.register_whole_tensor_optimizer, as the saving run did)"
        )


def piece_of(source: Any, owned: OwnedPiece, what: str) -> torch.Tensor:
    """The elements of ``owned``'s piece out of a full tensor, a FlatShard or a list of them,
    shaped like its main param."""
    numel = owned.param.numel()
    if isinstance(source, torch.Tensor) and source.dim() >= 1:
        if source.numel() != numel:
            raise CheckpointError(
                f"{what} of '{owned.name}' has shape {tuple(source.shape)}, the parameter "
                f"{tuple(owned.param.shape)}"
            )
        return source.reshape(-1)[owned.start : owned.end].reshape(owned.main.shape)
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
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.reshape(owned.main.shape)  # a param owned whole: its main param's shape


def merge_state_dicts(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict holding every given rank's shards (lists of FlatShards per entry).

    What a rank of any DP size loads from the ``state_dict()`` of every rank of another run.

    Args:
        state_dicts: the ``sharded_state_dict()`` (or ``state_dict()``) of each rank of one
            run, in any order; at least one. The param groups, optimizer class and loss scaler
            are taken from the first; the shards of all are kept side by side, for a load to
            pick those that cover its own pieces.
    """
    if not state_dicts:
        raise ValueError("merge_state_dicts needs at least one state dict")
    merged = {k: v for k, v in state_dicts[0].items()
              if k not in ("main_params", "state", RANK_PART_KEY)}  # every rank's, no one's
    main_params: dict[str, list[FlatShard]] = {}
    state: dict[str, dict[str, Any]] = {}
    for sd in state_dicts:
        for name, shard in sd["main_params"].items():
            main_params.setdefault(name, []).append(as_shard(shard))
        for name, entries in sd["state"].items():
            into = state.setdefault(name, {})
            for key, value in entries.items():
                value = as_shard(value)
                if isinstance(value, FlatShard):
                    into.setdefault(key, []).append(value)
                else:
                    into.setdefault(key, value)  # a scalar, the same for every piece
    merged["main_params"], merged["state"] = main_params, state
    return merged
