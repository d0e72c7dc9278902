"""``opt.state_dict()`` whose tensors DCP reshards, and ``opt.load_state_dict`` of torch's
layout made of them: what torchtitan's optimizer helpers save and load.

[Note: a state dict DCP reshards]
FSDP2's ``opt.state_dict()`` holds each rank's part of every per-element state as a DTensor of
the param's shape: DCP writes each rank's local shard at its place in the param and reads, at
another data-parallel size, the saved shards that overlap each rank's own. torchtitan 0.3.0 saves
the optimizer that way: ``get_flat_optim_state_dict`` re-keys ``opt.state_dict()`` by the names
of its groups' ``param_names`` (``state.{fqn}.{name}``, ``param_groups.{fqn}.{option}``), dcp
saves it, and a resumed run's own flat dict is ``dcp.load``-ed into and handed back through
``load_flat_optim_state_dict``, which rebuilds torch's integer-keyed layout from the live
``param_groups`` and calls ``opt.load_state_dict``.

distopt gives DCP the same: each per-element entry (main params and state) of
``opt.state_dict()`` is the boxes of torch_layout.py ([Note: torch's layout from flat shards]),
a tensor of the param's shape whose chunks view this rank's flat piece and which carries that
piece (``.shard``), so ``dcp.load`` writes straight into the live state, and pickled, copied or
merged the boxes are their flat shards still. A load of distopt's own format takes the boxes'
shards.

A dict in torch's layout (``{"state": {id: ...}, "param_groups": [...]}``, no ``"format"``)
loads when its per-element values are such boxes: each names its piece, so the ids need not
match anything. They cannot: torchtitan pairs each group's ``param_names`` (every param of the
group) with its ``params``, which on a distopt rank are the fp32 pieces it owns (fewer), so its
ids name the wrong params and leave the last ones out. A piece the dict gives no per-element
entry for keeps the state it holds, which ``dcp.load`` already wrote through the boxes; scalars
(``step``) are one per group, since every param of a group steps together; the options are the
groups' in order. A whole tensor, or boxes of another optimizer, is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from .files import CheckpointError
from .format import (
    FlatShard,
    Optimizer,
    OwnedPiece,
    loaded_entry,
    owned_pieces,
    state_entry,
)


def reshardable(opt: Optimizer, sd: dict[str, Any], per_rank: bool = False) -> dict[str, Any]:
    """``sd`` (state_dict.py's, of flat shards; ``per_rank``: this rank's own form) with each
    flat shard laid out like its param given as the boxes of that param; see [Note: a state
    dict DCP reshards]."""
    from .dcp import param_boxes

    params = {owned.name: owned.param for owned in owned_pieces(opt, per_rank=per_rank)}

    def boxed(name: str, value: Any) -> Any:
        param = params.get(name)
        if not isinstance(value, FlatShard) or param is None or value.numel != param.numel():
            return value
        out = param_boxes(param, value, value.local)
        out._chunks.owner = name  # which piece the boxes are, whatever key they travel under
        return out

    return {**sd,
            "main_params": {n: boxed(n, v) for n, v in sd["main_params"].items()},
            "state": {n: {k: boxed(n, v) for k, v in entries.items()}
                      for n, entries in sd["state"].items()}}


def is_torch_layout(sd: Any) -> bool:
    """torch's optimizer state dict (no distopt ``"format"``)."""
    return (isinstance(sd, dict) and "format" not in sd and "state" in sd
            and "param_groups" in sd)


def torch_layout_values(opt: Optimizer, sd: dict[str, Any]
                        ) -> tuple[list[tuple[OwnedPiece, dict[str, Any]]], list[dict[str, Any]]]:
    """Each owned piece's state entries out of ``sd`` (torch's layout of boxes), and the
    groups' options; see [Note: a state dict DCP reshards]."""
    groups = sd["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        raise CheckpointError(
            f"it has {len(groups) if isinstance(groups, list) else 'no list of'} param groups, "
            f"the optimizer {len(opt.param_groups)}")
    group_of = {pid: index for index, group in enumerate(groups) for pid in group["params"]}
    boxed: dict[tuple[str, str], FlatShard] = {}
    scalars: list[dict[str, Any]] = [{} for _ in groups]
    for pid, entries in sd["state"].items():
        for key, value in entries.items():
            owner = _owner(value)
            if owner is not None:
                boxed[(owner, key)] = value.shard
            elif not isinstance(value, torch.Tensor) or value.dim() == 0:
                if pid not in group_of:
                    raise CheckpointError(f"state of param {pid!r} is in no param group")
                scalars[group_of[pid]].setdefault(key, value)
            else:
                raise CheckpointError(
                    f"state '{key}' of param {pid!r} is a {type(value).__name__} of shape "
                    f"{tuple(value.shape)}: distopt's opt.load_state_dict takes torch's layout "
                    "as the boxes of its own opt.state_dict() (after dcp.load); load a "
                    "torch.optim state dict with torch.distributed.checkpoint.state_dict."
                    "set_optimizer_state_dict(ddp, opt, ...) or distopt.load_plain_checkpoint")
    index_of = {id(group): i for i, group in enumerate(opt.param_groups)}
    owned_names = set()
    values = []
    for owned in owned_pieces(opt):
        owned_names.add(owned.name)
        group = index_of[id(opt.param_group_of(owned.main))]
        held = opt.state_precision.saved(owned.main, opt.state.get(owned.main, {}))
        given = {key: shard for (name, key), shard in boxed.items() if name == owned.name}
        if not given and not held:
            continue  # a fresh piece the dict names nothing of: no state, as before
        entries = {**{k: state_entry(v, owned, k) for k, v in held.items()},
                   **scalars[group], **given}
        values.append((owned, {k: loaded_entry(v, owned, k) for k, v in entries.items()}))
    strangers = sorted({name for name, _ in boxed} - owned_names)
    if strangers:
        raise CheckpointError(f"it holds boxes of params this rank owns no piece of: "
                              f"{strangers[:5]} (another optimizer's state dict)")
    options = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
               for g in groups]
    return values, options


def _owner(value: Any) -> str | None:
    """The piece a value of ``reshardable``'s boxes belongs to, else None."""
    if not isinstance(value, torch.Tensor):
        return None
    chunks = getattr(value, "_chunks", None)
    return None if chunks is None else chunks.__dict__.get("owner")
