"""torch's state-dict layout from distopt's shards, and back: what ``get_state_dict`` and
``set_state_dict`` (torch.distributed.checkpoint.state_dict) give and take over a distopt model
([Note: torch's DCP state dicts] in ddp/torch_compat/torch_dcp.py).

[Note: torch's layout from flat shards]
torch's layout keys the model by FQN and each param's optimizer state by the param's FQN and
torch's names (``step``, ``exp_avg``, ``momentum_buffer``, ...), each tensor in the param's shape;
FSDP2 gives DTensors sharded on dim 0, torch DDP whole tensors. DCP reshards by boxes: each rank
declares the boxes of a tensor's global shape that it writes, or wants, and a load reads every
saved box that overlaps its own. A distopt rank holds a contiguous range [a, b) of each
flattened param it owns a piece of (its main params, its state), which is not a box of the
param's shape, but it is the union of at most two boxes per dimension: a partial first row, the
whole rows, a partial last row, each partial row cut again one dimension down
(``dcp.flat_range_boxes``). So each such tensor is given to DCP as a ``_DcpFlat`` of the
param's shape whose chunks are those boxes, each a view of the rank's flat piece: a save writes
the live values and a load reads straight into them, with no copy and no whole tensor on any
rank. Ranks that own no element of a param declare no box of it. ``full_state_dict=True`` is
torch's: whole tensors on every rank (on rank 0 alone with ``cpu_offload``), gathered the way
``opt.consolidate_state_dict`` gathers.

Which values the model entries hold: a trainable param's entry is its fp32 main param (the
master values, exact, rebuilt from bf16 params and remainders with ``store_param_remainders``),
not the bf16 or fp16 param the forward reads. That is what the optimizer steps, what FSDP2
with a ``MixedPrecisionPolicy`` keeps as its params (fp32 shards, bf16 compute) and what torch
DDP over an fp32 model with autocast keeps; a run resumed from it continues exactly, and a
bf16 model loading it (torch DDP over ``model.bfloat16()``) rounds once in DCP's copy. A model
given without its optimizer and never given one has no main params: its entries are its
params as they are (gathered whole under sharded params). Buffers and frozen params are the
module's own, replicated, which DCP writes once.

Optimizer state is in the dtype distopt holds it (``state_dtype``); DCP's load converts dtypes
in its copy, so bf16 state loads into FSDP2's fp32 and back. Scaled state (a bf16 mantissa
with exponents, [Note: state precision]) is given as its fp32 values, since the exponents are
no torch name. A fresh optimizer, which holds no state before its first step, is given the
state a step with zero grads and lr 0 creates (zeros, ``step`` 1), as torch's functions do for
a torch optimizer, stepped on this rank's own pieces alone, with no collective.

Loads write the main params and the state of this rank's pieces out of any value that covers
them: the boxes DCP read into, or whole tensors (a full state dict, ``broadcast_from_rank0``),
then cast the params from the main params and gather them, as any distopt load does. The optimizer's
state dict in torch's flat layout (``flatten_optimizer_state_dict``, torchtitan's) is this one
flattened ([Note: torch's flat optimizer layout] in torch_flat.py). Not covered, and refused by
name on every rank before any collective: full state dicts of tensor-parallel DTensor params
(their sharded form is covered: a piece of a local shard is runs of the global tensor, each
cut into boxes), experts, pipeline stages and model chunks (``distopt.save_checkpoint`` covers
them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.params.whole_module import module_entries
from ..ddp.torch_compat import torch_dcp
from ..optim.state_precision import EXPONENTS, scaled_values
from . import torch_flat
from .checks import agree, check_groups
from .files import CheckpointError
from .format import (
    FlatShard,
    check_loaded_state,
    hyper_params,
    loaded_entry,
    owned_pieces,
    piece_of,
)
from .install import install_states
from .state_dict import consolidated_state_dict, state_dict

# The prefixes torch's FQNs leave out: torch.compile's module and activation checkpointing's.
_HIDDEN_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def torch_fqn(name: str) -> str:
    """A name of ``module.state_dict()`` as torch's state-dict functions key it."""
    for hidden in _HIDDEN_PREFIXES:
        name = name.replace(hidden, "")
    return name


# ---------------------------------------------------------------------- checks


def check(call: torch_dcp.DistoptCall) -> None:
    """Refuse what this module does not cover, from the arguments alone (every rank alike)."""
    ddp, opt, options = call.ddp, call.optimizer, call.options
    fix = ("save with distopt.save_checkpoint(path, ddp, opt) and resume with "
           "distopt.load_checkpoint, which cover it")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("StateDictOptions(broadcast_from_rank0=True) needs "
                         "full_state_dict=True, as torch requires")
    parallel = ddp.parallel
    full_tp = parallel.tp is not None and options.full_state_dict
    for present, what in ((full_tp, "full state dicts of tensor-parallel DTensor params"),
                          (ddp.experts is not None, "experts (expert parallelism)"),
                          (parallel.pp_group is not None, "a pipeline stage"),
                          (opt is not None and len(opt.models) > 1, "several model chunks")):
        if present:
            raise ValueError(f"torch's DCP state-dict functions do not yet cover {what} under "
                             f"distopt: {fix}")


# ---------------------------------------------------------------------- boxes


def boxes(param: torch.Tensor, shard: FlatShard | None, like: torch.Tensor) -> torch.Tensor:
    """``shard`` (a range of ``param`` flattened) as DCP's boxes of ``param``'s shape, views of
    the shard's values; no box without a shard. See [Note: torch's layout from flat shards]."""
    from .dcp import param_boxes

    return param_boxes(param, shard, like)


def _loadable(value: Any, key: str) -> Any:
    """A loaded value as the install path reads it: the boxes' flat shard, or the value."""
    if hasattr(value, "shard"):
        if value.shard is None:
            raise CheckpointError(f"'{key}' holds boxes of another rank's elements")
        return value.shard
    if type(value).__name__ == "DTensor":
        raise CheckpointError(
            f"'{key}' is a DTensor (another system's sharded state dict): load it into distopt's "
            "own state dict with torch.distributed.checkpoint.load, which reshards, or pass a "
            "full state dict (StateDictOptions(full_state_dict=True))")
    return value


def _offloaded(value: Any, options: Any) -> Any:
    if options.cpu_offload and isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    return value


# ---------------------------------------------------------------------- model


def _entries(call: torch_dcp.DistoptCall) -> dict[str, tuple[str, Any]]:
    """torch's FQN -> (the module's key, its value) for every entry torch's layout holds."""
    out = {}
    frozen = call.options.ignore_frozen_params
    for key, value in module_entries(call.ddp.module).items():
        if frozen and isinstance(value, nn.Parameter) and not value.requires_grad:
            continue
        out[torch_fqn(key)] = (key, value)
    return out


def get_model(call: torch_dcp.DistoptCall) -> dict[str, Any]:
    """The model's state dict in torch's layout; see [Note: torch's layout from flat shards]."""
    ddp, opt, options = call.ddp, call.optimizer, call.options
    full = options.full_state_dict
    if opt is None:
        plain = ddp.full_state_dict() if ddp.options.shard_params else None
        out = {fqn: (plain[key] if plain is not None and key in plain else value)
               for fqn, (key, value) in _entries(call).items()}
        out = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        if full and options.cpu_offload and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {k: _offloaded(v, options) for k, v in out.items()}
    if full:
        merged = _consolidated(opt, options, state=False)
        if merged is None:
            return {}
        mains = merged["main_params"]
    else:
        mains = state_dict(opt)["main_params"]
    names = ddp.param_names
    out = {}
    for fqn, (_, value) in _entries(call).items():
        if isinstance(value, nn.Parameter) and value in names:
            shard = mains.get(names[value])
            if full:
                out[fqn] = shard.local.view(value.shape)
            else:
                out[fqn] = boxes(value, shard, torch.empty(0, dtype=torch.float32,
                                                           device=value.device))
        elif isinstance(value, torch.Tensor):
            out[fqn] = _offloaded(value.detach(), options)
        else:
            out[fqn] = value
    return out


def _consolidated(opt: Any, options: Any, *, state: bool) -> dict[str, Any] | None:
    """Every rank's main params (and with ``state`` its optimizer state) merged whole, as
    ``consolidate_state_dict`` merges them, on every rank, or with ``cpu_offload`` on global
    rank 0 alone (None elsewhere), as torch's full state dicts."""
    mine = state_dict(opt)
    if not state:  # the model's entries need the masters alone
        mine["state"] = {}
    merged = consolidated_state_dict(opt, 0 if options.cpu_offload else None, mine)
    if options.cpu_offload and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return merged


def _broadcast_from_rank0(sd: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's full state dict on every rank (torch's ``broadcast_from_rank0``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sd
    held = [sd if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(held, src=0)
    return held[0]


def load_model(call: torch_dcp.DistoptCall, sd: dict[str, Any]) -> Any:
    """Load ``sd`` (torch's layout) into the model and its main params; torch's
    ``_IncompatibleKeys`` back, or torch's strict error."""
    from torch.nn.modules.module import _IncompatibleKeys

    ddp, opt, options = call.ddp, call.optimizer, call.options
    if options.broadcast_from_rank0:
        # Before anything else: torch's set_state_dict sees an empty dict on the other ranks
        # as "optimizer only", and every rank must join rank 0's broadcast.
        sd = _broadcast_from_rank0(sd)
    if not sd:
        return _IncompatibleKeys([], [])
    entries = _entries(call)
    missing = [fqn for fqn in entries if fqn not in sd]
    unexpected = [fqn for fqn in sd if fqn not in entries]
    error = None
    if options.strict and (missing or unexpected):
        error = (f"Error(s) in loading state_dict for {type(ddp.module).__name__}: missing "
                 f"keys {missing[:5]}, unexpected keys {unexpected[:5]} (torch's FQNs; pass "
                 "StateDictOptions(strict=False) to load the keys that match)")
    # By identity, not name: a tied param (a head tied to the embedding) has two keys.
    trainable = set() if opt is None else {id(p) for p in ddp.params}
    mains, rest = [], {}
    if error is None:
        try:
            rest = {key: _loadable(sd[fqn], fqn) for fqn, (key, value) in entries.items()
                    if fqn in sd and id(value) not in trainable}
            for owned in owned_pieces(opt) if opt is not None else ():
                fqn = torch_fqn(owned.name)
                if fqn in sd:
                    value = _loadable(sd[fqn], fqn)
                    mains.append((owned, piece_of(value, owned, f"model entry '{fqn}'")))
        except CheckpointError as exc:
            error = f"cannot load the model state dict: {exc}"
    agree(error, ddp.process_group)
    with torch.no_grad():
        ddp.module.load_state_dict(rest, strict=False)
        if opt is not None:
            with opt.main_params_materialized():
                for owned, value in mains:
                    owned.main.detach().copy_(value)
            opt.sync_model_params()
    return _IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------- optimizer


def _torch_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """A piece's state as torch names it: scaled keys as their fp32 values."""
    out = dict(entries)
    for key in [k for k in entries if k.endswith(EXPONENTS)]:
        name = key.removesuffix(EXPONENTS)
        exponents = out.pop(key)
        shard = out[name]
        out[name] = FlatShard(scaled_values(shard.local, exponents.local), shard.offset,
                              shard.numel)
    return out


def get_optim(call: torch_dcp.DistoptCall) -> dict[str, Any]:
    """The optimizer's state dict in torch's layout; see [Note: torch's layout from flat
    shards]."""
    opt, options = call.optimizer, call.options
    if opt is None:
        return {}
    ensure_state(opt)
    full = options.full_state_dict
    sd = _consolidated(opt, options, state=True) if full else state_dict(opt)
    if sd is None:
        return {}
    params = {name: p for p, name in call.ddp.param_names.items()}
    state: dict[str, dict[str, Any]] = {}
    in_order = [n for group in sd["param_groups"] for n in group["params"] if n in sd["state"]]
    for name, entries in ((n, sd["state"][n]) for n in in_order):  # torch's order
        param = params[name]
        converted = {}
        for key, value in _torch_entries(entries).items():
            if isinstance(value, FlatShard):
                value = (value.local.view(param.shape) if full
                         else boxes(param, value, value.local))
            converted[key] = _offloaded(value, options)
        state[torch_fqn(name)] = converted
    groups = [{**group, "params": [torch_fqn(n) for n in group["params"]]}
              for group in sd["param_groups"]]
    osd = {"state": state, "param_groups": groups}
    return torch_flat.flatten(osd) if options.flatten_optimizer_state_dict else osd


def ensure_state(opt: Any) -> None:
    """Give the pieces that hold no state yet the state a step with zero grads and lr 0 makes
    (this rank's pieces, no collective); see [Note: torch's layout from flat shards]."""
    fresh = [owned for owned in owned_pieces(opt) if not opt.state.get(owned.main)]
    if not fresh:
        return
    mains = {owned.main for owned in fresh}
    with torch.no_grad(), opt.main_params_materialized():
        for inner in opt.optimizers:
            stepped = [m for g in inner.param_groups for m in g["params"] if m in mains]
            if not stepped:
                continue
            others = {m: m.grad for g in inner.param_groups for m in g["params"]}
            lrs = [g["lr"] for g in inner.param_groups]
            for group in inner.param_groups:
                group["lr"] = 0.0
            for main in others:
                main.grad = torch.zeros_like(main) if main in mains else None
            try:
                inner.step()
            finally:
                for group, lr in zip(inner.param_groups, lrs, strict=True):
                    group["lr"] = lr
                for main, grad in others.items():
                    main.grad = grad
    install_states(opt, [(owned, opt.state.pop(owned.main, {})) for owned in fresh])


def load_optim(call: torch_dcp.DistoptCall, osd: dict[str, Any]) -> None:
    """Load ``osd`` (torch's layout) into this rank's pieces' state and the groups' options."""
    opt, options = call.optimizer, call.options
    if opt is None:
        return
    if options.broadcast_from_rank0:
        osd = _broadcast_from_rank0(osd)
    if not osd:
        return  # nothing given: torch's set_state_dict(..., optim_state_dict={})
    error, values, groups = None, [], []
    try:
        if torch_flat.is_flat(osd):  # torch's rule, whatever the options say
            live = hyper_params(opt)
            osd = torch_flat.unflatten(
                osd, [[torch_fqn(n) for n in g["params"]] for g in live],
                [[k for k in g if k != "params"] for g in live])
        if not isinstance(osd, dict) or "param_groups" not in osd or "state" not in osd:
            raise CheckpointError("expected torch's optimizer state dict, a dict with 'state' "
                                  "and 'param_groups'")
        by_fqn = {torch_fqn(name): name for name in call.ddp.param_names.values()}
        unknown = sorted({f for g in osd["param_groups"] for f in g["params"]} - set(by_fqn))
        if unknown:
            raise CheckpointError(f"its param groups name params this model lacks: {unknown[:5]}")
        groups = [{**g, "params": [by_fqn[f] for f in g["params"]]} for g in osd["param_groups"]]
        check_groups(opt, [g["params"] for g in groups], "the optimizer state dict")
        state = {by_fqn[fqn]: {k: _loadable(v, f"{fqn}.{k}") for k, v in entries.items()}
                 for fqn, entries in osd["state"].items() if fqn in by_fqn}
        check_loaded_state(opt, state)
        for owned in owned_pieces(opt):
            if owned.name not in state:
                raise CheckpointError(f"no optimizer state for '{torch_fqn(owned.name)}'")
            values.append((owned, {k: loaded_entry(v, owned, k)
                                   for k, v in state[owned.name].items()}))
    except (CheckpointError, TypeError, KeyError) as exc:
        error = f"cannot load the optimizer state dict: {exc}"
    agree(error, opt.parallel.dp_group if opt.sharded else None)
    install_states(opt, values, groups)


torch_dcp.use_handlers(check=check, get_model=get_model, get_optim=get_optim,
                       load_model=load_model, load_optim=load_optim)
