"""``opt.state_dict()`` and ``opt.load_state_dict()``: the optimizer state in memory.

The format is [Note: DP-size independent state] (format.py). The public optimizers' methods
(optim/optimizers.py) call these functions; see [Note: one-way imports].

[Note: torch's way of saving the optimizer]
A sharded optimizer's rank holds its own shard of the state only. ``opt.state_dict()`` gives
what torch's FSDP2 optimizer state dict gives, each rank's part (its DTensor shards there, its
flat shards here), so that a warm restart on the same ranks (``sd = opt.state_dict()``, an
option changed in ``sd["param_groups"]``, ``opt.load_state_dict(sd)``) and one file per rank
work as under FSDP2; the part is marked with the process it belongs to (``RANK_PART_KEY``).
A torch DDP script saves the optimizer on one rank, ``torch.save(opt.state_dict(), path)``
under ``if rank == 0``, and loads it on every rank: rank 0's part resumes no other rank, so a
load of a part marked as another process's is refused on every rank, naming the ways that
work. The first of them is torch's ``ZeroRedundancyOptimizer`` rule:
``opt.consolidate_state_dict(to=r)`` on every rank gathers every rank's shard to rank ``r``,
whose ``state_dict()`` is then the whole state (each flat shard covering its whole param),
which loads on every rank at any data-parallel size (a load slices its own pieces out of it):
the whole optimizer state there, once. ``opt.sharded_state_dict()`` is each rank's own part
unmarked, for code that merges every rank's (a load takes any set of shards that covers its
pieces), and ``distopt.save_checkpoint`` writes a sharded checkpoint without gathering.
``FlatShard`` is registered with torch's safe globals, so the default ``torch.load`` reads
such a file.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from ..optim import optimizers
from ..optim.local_params import LOCAL_STATE_KEY
from .checks import agree, check_groups, check_optimizer_class, check_scaler
from .files import CheckpointError
from .format import (
    RANK_PART_KEY,
    STATE_DICT_FORMAT,
    FlatShard,
    Optimizer,
    OwnedPiece,
    as_shard,
    check_loaded_state,
    class_path,
    hyper_params,
    loaded_entry,
    merge_state_dicts,
    owned_pieces,
    piece_of,
    saved_group_classes,
    scaler_state,
    state_entry,
)
from .install import install_states, install_values
from .reshardable import is_torch_layout, reshardable, torch_layout_values


def state_dict(opt: Optimizer, per_rank: bool = False) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter name; ``per_rank``: the form that loads
    on this rank alone, which holds the state of the params of torch DDP's ignore list too
    ([Note: ignored params stepped locally] in optim/local_params.py)."""
    opt.adopt_param_writes()  # [Note: writes into the params] in optim/main_params.py
    main_params: dict[str, FlatShard] = {}
    state: dict[str, dict[str, Any]] = {}
    pieces = owned_pieces(opt, per_rank=per_rank)
    # With store_param_remainders the masters are rebuilt for the block; the shards keep them.
    with opt.main_params_materialized():
        for owned in pieces:
            main = owned.main.detach().reshape(-1)  # a view, also of a param owned whole
            main_params[owned.name] = FlatShard(main, owned.start, owned.param.numel())
            # Scaled state with an exponent per element; see [Note: state precision].
            held = opt.state_precision.saved(owned.main, opt.state.get(owned.main, {}))
            entries = {k: state_entry(v, owned, k) for k, v in held.items()}
            if entries:
                state[owned.name] = entries
    out = {
        "format": STATE_DICT_FORMAT,
        "optimizer": class_path(type(opt.optimizer)),
        "param_groups": hyper_params(opt),
        "main_params": main_params,
        "state": state,
        "loss_scaler": scaler_state(opt),
    }
    if opt.local_params is not None:
        out[LOCAL_STATE_KEY] = opt.local_params.state_dict()
    return out


def own_state_dict(opt: Optimizer, per_rank: bool = False) -> dict[str, Any]:
    """``opt.state_dict()`` of an optimizer not sharded over several ranks (or, ``per_rank``,
    a rank's part): ``state_dict`` whose per-element tensors DCP reshards ([Note: a state dict
    DCP reshards] in reshardable.py)."""
    return reshardable(opt, state_dict(opt, per_rank=per_rank), per_rank=per_rank)


def rank_part(opt: Optimizer) -> dict[str, Any]:
    """``own_state_dict`` of this rank's part, marked with the process it belongs to."""
    return {**own_state_dict(opt, per_rank=True), RANK_PART_KEY: {
        "rank": dist.get_rank(), "world_size": dist.get_world_size()}}


def load_state_dict(opt: Optimizer, state_dict: dict[str, Any]) -> None:
    """Validate ``state_dict`` against this rank's pieces, agree across ranks, then load it."""
    error, values, states, options = None, None, None, None
    try:
        if is_torch_layout(state_dict):  # torchtitan's; see [Note: a state dict DCP reshards]
            states, options = torch_layout_values(opt, state_dict)
        else:
            values = _pieces_of(opt, state_dict)
    except (CheckpointError, TypeError, KeyError) as exc:
        error = f"cannot load the optimizer state dict: {exc}"
    # The ranks that gather the params afterwards; see [Note: which ranks agree].
    agree(error, opt.parallel.dp_group if opt.sharded else None)
    if states is not None:
        install_states(opt, states, options)  # the masters are the model's entries
        return
    assert values is not None
    install_values(opt, values, state_dict["param_groups"], state_dict["loss_scaler"])
    if opt.local_params is not None:
        opt.local_params.load_state_dict(state_dict[LOCAL_STATE_KEY])
    opt.sync_model_params()


def _pieces_of(opt: Optimizer, sd: dict[str, Any]
               ) -> list[tuple[OwnedPiece, torch.Tensor, dict[str, Any]]]:
    """Check ``sd``; return each owned piece's main values and state entries out of it."""
    found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
    if found != STATE_DICT_FORMAT:
        raise CheckpointError(
            f"not a distopt optimizer state dict (format {found!r}, expected "
            f"{STATE_DICT_FORMAT!r}); torch.optim state dicts load with "
            "distopt.load_plain_checkpoint"
        )
    _check_rank_part(sd.get(RANK_PART_KEY))
    check_optimizer_class(opt, saved_group_classes(sd["param_groups"], sd["optimizer"]),
                          "the state dict")
    check_groups(opt, [g["params"] for g in sd["param_groups"]], "the state dict")
    scaler = sd["loss_scaler"]
    check_scaler(opt, None if scaler is None else scaler["type"], "the state dict")
    check_loaded_state(opt, sd["state"])
    if opt.local_params is not None:
        opt.local_params.check_loadable(sd.get(LOCAL_STATE_KEY))
    values = []
    for owned in owned_pieces(opt, per_rank=sd.get(RANK_PART_KEY) is not None):
        if owned.name not in sd["main_params"]:
            raise CheckpointError(f"no main params for '{owned.name}' in the state dict")
        main = piece_of(as_shard(sd["main_params"][owned.name]), owned, "main params")
        entries = {key: loaded_entry(as_shard(value), owned, key)
                   for key, value in sd["state"].get(owned.name, {}).items()}
        values.append((owned, main, entries))
    return values


def _check_rank_part(part: dict[str, int] | None) -> None:
    """A rank's part loads on that rank only; see [Note: torch's way of saving the optimizer]."""
    if part is None:
        return
    here = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1))
    if (part["rank"], part["world_size"]) != here:
        raise CheckpointError(
            f"it is the part of rank {part['rank']} of {part['world_size']} processes (a "
            "sharded optimizer's opt.state_dict() holds its own rank's shards, as FSDP2's "
            f"does), loaded on rank {here[0]} of {here[1]}: load each rank's own "
            "opt.state_dict() (one file per rank), or call opt.consolidate_state_dict(to=0) "
            "on every rank before rank 0's opt.state_dict() (the whole state, which loads on "
            "every rank at any size), or save with distopt.save_checkpoint(path, ddp, opt)"
        )


def consolidated_state_dict(opt: Optimizer, to: int | None,
                            mine: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Every rank's ``state_dict`` (or the part of it given as ``mine``) merged on
    data-parallel rank ``to`` (None on the others), or on every rank with ``to=None``;
    collective over the data-parallel group. See [Note: torch's way of saving the
    optimizer]."""
    from ..comm import collectives as comm

    group = opt.parallel.dp_group
    size = comm.group_size(group)
    if to is not None and not 0 <= to < size:
        raise ValueError(f"consolidate_state_dict(to={to}): to must be a data-parallel rank in "
                         f"[0, {size})")
    mine = state_dict(opt) if mine is None else mine
    if size == 1:
        return _merged([mine])
    if to is None:
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        return _merged(everyone)
    rank = comm.group_rank(group)
    gathered: list[Any] | None = [None] * size if rank == to else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, to), group=group)
    return None if gathered is None else _merged(gathered)


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict whose flat shards cover whole params, from the ranks' dicts."""
    out = merge_state_dicts(parts)
    out["main_params"] = {name: _whole(pieces) for name, pieces in out["main_params"].items()}
    out["state"] = {name: {key: _whole(value) if isinstance(value, list) else value
                           for key, value in entries.items()}
                    for name, entries in out["state"].items()}
    return out


def _whole(pieces: list[FlatShard]) -> FlatShard:
    numel = pieces[0].numel
    whole = torch.empty(numel, dtype=pieces[0].local.dtype)
    covered = 0
    for piece in pieces:
        whole[piece.offset : piece.end].copy_(piece.local)
        covered += piece.local.numel()
    if covered != numel:
        raise CheckpointError(f"the ranks' shards cover {covered} of {numel} elements")
    return FlatShard(whole, 0, numel)


def heal_state(opt: Optimizer) -> dict[str, Any]:
    """What this rank holds, for the same rank of a replica group that heals from it: its
    pieces of the optimizer state (``state_dict``) and the model params it holds between steps
    (every param, or with sharded params its shards), and the module buffers (BatchNorm's
    running statistics: the next forward broadcasts them from the group's rank 0, which must
    hold the healthy group's), so that the load needs no collective. See
    [Note: fault-tolerant replicas] in parallel/managed_replicas.py."""
    return {"optimizer": state_dict(opt), "params": opt.held_params(),
            "buffers": _module_buffers(opt, copies=True)}


def _module_buffers(opt: Optimizer, copies: bool = False) -> list[torch.Tensor]:
    # Copies to send: the transport may still be reading after this rank's next forward has
    # begun, and that forward's broadcast and statistics write the buffers in place (the
    # params wait for the transfer in should_commit, the buffers would not).
    return [buf.detach().clone() if copies else buf
            for model in opt.models for buf in model.module.buffers()]


def load_heal_state(opt: Optimizer, state: dict[str, Any]) -> None:
    """Load ``heal_state`` of the same rank of a group built alike, on this rank alone: torchft
    decides per rank which ones heal (at step 0 some ranks of a group may and others not), so
    nothing here may wait for another rank."""
    sd = state["optimizer"]
    values = _pieces_of(opt, sd)
    held = opt.held_params()
    saved = state["params"]
    if [(t.shape, t.dtype) for t in saved] != [(t.shape, t.dtype) for t in held]:
        raise CheckpointError(
            "the healthy group's params are laid out otherwise: every replica group must build "
            "the same model with the same options and the same number of ranks")
    buffers = _module_buffers(opt)
    if [(t.shape, t.dtype) for t in state["buffers"]] != [(t.shape, t.dtype) for t in buffers]:
        raise CheckpointError(
            "the healthy group's module buffers are laid out otherwise: every replica group "
            "must build the same model")
    install_values(opt, values, sd["param_groups"], sd["loss_scaler"])
    opt.load_held_params(saved)
    with torch.no_grad():
        for buf, value in zip(buffers, state["buffers"], strict=True):
            buf.copy_(value)


# The public optimizers' state-dict methods do their work here, and the optimizers sit a layer
# below this package: this module hands them its functions. See [Note: one-way imports].
optimizers.use_state_dict_functions(sys.modules[__name__])
