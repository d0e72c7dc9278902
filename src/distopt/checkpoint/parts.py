"""What each rank writes into a checkpoint: its part of every piece it holds, and the model
entries dealt to it.

[Note: each byte written once]
Several ranks may hold the same piece of the state: the replicas of a shard group on a
hierarchical mesh (the replicate group), and every rank of a ``BasicOptimizer`` (the DP group).
The k ranks that hold a piece split it: the i-th writes the i-th of k contiguous parts
(``part_of``). The model's entries (``module.state_dict()``, the same on every rank) are dealt
out over the checkpoint group, largest first, each to the rank with the fewest bytes so far;
buffers stay with the first DP rank, whose values the next forward broadcasts ([Note: buffer
broadcasting]). A param's values that are not per element (its ``step``, the whole-parameter
state of a param owned whole) are written by one rank that holds its first element, one
replica of it. So no two ranks write the same byte, each writes about 1/N of the checkpoint
over N ranks, and the write bandwidth grows with the ranks.

DCP would deduplicate replicated chunks by itself (its global plan keeps each duplicated item
on one rank), but only after every rank had declared them all, and whole chunks at a time: a
piece two replicas hold would be written whole by one of them. Declaring only what a rank
writes is also what bounds an async save's staging (staging.py): a rank copies only its part.
The param groups are a small replicated object that DCP's deduplication writes once. With
tensor parallelism the model entries are DTensors, which DCP writes shard by shard and
deduplicates across DP replicas, and the scalars are left to its deduplication too.

Any split loads at any layout: a load asks for its own pieces and DCP reads every saved chunk
that overlaps them ([Note: flat shards in DCP] in dcp.py).

[Note: model entries from shards]
With sharded params no rank holds a param whole, and gathering the model to write it would cost
every rank the whole model at once. Instead each rank writes the part of each param that its
shards hold (the part of a piece its replicas split, [Note: each byte written once]) as the
boxes of the param's own shape that cover that flat range (``dcp.range_as_dcp``): the
checkpoint holds the same entries, loadable whole or at any layout, and the save holds nothing
beyond the state. Tensor-parallel, expert and pipeline models still gather for the write.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import collectives as comm
from ..ddp.params.whole_module import module_entries
from .format import (
    FlatShard,
    Optimizer,
    buffer_keys,
    describe,
    global_name,
    model_prefixes,
    owned_pieces,
)
from .state_dict import state_dict


def holders(opt: Optimizer) -> tuple[int, int]:
    """(this rank's index, count) among the ranks that hold the same pieces as this one."""
    parallel = opt.parallel
    replica = comm.group_rank(parallel.replicate_group)
    if opt.sharded:
        return replica, parallel.replicate_size
    return replica * parallel.dp_size + parallel.dp_rank, parallel.replicate_size * parallel.dp_size


def part_of(start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """The ``index``-th of ``count`` contiguous parts of ``[start, end)``."""
    n = end - start
    return start + n * index // count, start + n * (index + 1) // count


def deal(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """The rank that writes each entry: largest first, each to the rank with the fewest bytes
    so far (the lowest such rank); the same on every rank given the same sizes."""
    load = [0] * ranks
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += sizes[key]
    return owner


def dcp_state(opt: Optimizer, extra: Any, group: Any,
              param_groups: list[list[str]] | None = None
              ) -> tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]:
    """What this rank gives DCP to write, under the keys of the package docstring, and the
    whole-parameter state among it (``{name: {key: [shape, dtype]}}``); see [Note: each byte
    written once]. The tensors are the live ones (views), as DCP reads them. ``param_groups``:
    each group's names in the whole model, for pipeline stages ([Note: pipeline checkpoints]
    in pipeline.py)."""
    from .dcp import piece_as_dcp

    sd = state_dict(opt)
    # A tie's copies are written by the stage that counts it; see [Note: tied stage params].
    pieces = owned_pieces(opt)
    counted = {o.name for o in pieces if o.param not in opt.tied_copies}
    for name in {o.name for o in pieces} - counted:
        del sd["main_params"][name]
        sd["state"].pop(name, None)
    if param_groups is not None:
        sd["param_groups"] = [{**group, "params": names}
                              for group, names in zip(sd["param_groups"], param_groups,
                                                      strict=True)]
    tp = opt.parallel.tp
    index, count = holders(opt)
    owned = {o.name: o for o in owned_pieces(opt)}
    state: dict[str, Any] = {}
    whole: dict[str, dict[str, list[Any]]] = {}

    def flat(name: str, values: torch.Tensor) -> torch.Tensor:
        piece = owned[name]
        return piece_as_dcp(tp, piece, values, writing=True,
                            part=part_of(piece.start, piece.end, index, count))

    for name, shard in sd["main_params"].items():
        state[f"main/{name}"] = flat(name, shard.local)
    for position, (name, entries) in enumerate(sd["state"].items()):
        # Values of the whole param (scalars such as step, whole-parameter state) are written
        # by one of the ranks that hold them: a holder of its first element, one replica.
        first = owned[name].start == 0 and position % count == index
        for key, value in entries.items():
            if isinstance(value, FlatShard):
                value = flat(name, value.local)
            else:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    # Whole-parameter state, from its owner only; see [Note: whole-tensor
                    # state]. Every holder lists it for the manifest.
                    whole.setdefault(name, {})[key] = describe(value)
                if not first and tp is None:
                    continue
            state[f"state/{name}/{key}"] = value
    state.update(_model_entries(opt, *model_dealers(opt, group)))
    state["meta/param_groups"] = sd["param_groups"]
    if comm.group_rank(group) == 0:
        state["extra"] = extra
    return state, whole


def model_dealers(opt: Optimizer, group: Any) -> tuple[int, int]:
    """(this rank's index, count) among the ranks the model's entries are dealt over: the
    checkpoint group, or a pipeline stage's DP ranks, which alone hold its entries."""
    parallel = opt.parallel
    if parallel.pp_group is None:
        return comm.group_rank(group), comm.group_size(group)
    replica = comm.group_rank(parallel.replicate_group)
    return replica * parallel.dp_size + parallel.dp_rank, parallel.replicate_size * parallel.dp_size


def shards_written_whole(opt: Optimizer, model: Any) -> bool:
    """Whether ``model``'s sharded params are written from their shards, each rank its pieces
    as boxes of the param ([Note: model entries from shards]), rather than gathered first."""
    parallel = opt.parallel
    return (model.options.shard_params and parallel.tp is None and model.experts is None
            and parallel.pp_group is None)


def _params_from_shards(opt: Optimizer, model: Any) -> dict[torch.Tensor, torch.Tensor]:
    """Each of ``model``'s params, as the boxes this rank writes of it; see
    [Note: model entries from shards]."""
    from .dcp import range_as_dcp

    if not shards_written_whole(opt, model):
        return {}
    index, count = holders(opt)
    out: dict[torch.Tensor, torch.Tensor] = {}
    for owned in owned_pieces(opt):
        param = owned.param
        if param not in model.buffer_of:
            continue
        bucket = model.buffer_of[param].buckets[owned.piece.bucket]
        local = owned.piece.local_range
        values = bucket.param_shard[local.start : local.end]
        lo, hi = part_of(owned.start, owned.end, index, count)
        out[param] = range_as_dcp(tuple(param.shape), lo,
                                  values[lo - owned.start : hi - owned.start])
    for param in model.params:  # params with no piece here: declared by their holders
        if param not in out:
            nothing = torch.empty(0, dtype=param.dtype, device=param.device)
            out[param] = range_as_dcp(tuple(param.shape), 0, nothing)
    return out


class ModuleEntryDealer:
    """The module entries that are not trainable params' masters, as a save writes them:
    buffers from the first DP ranks only, so that DCP writes theirs, which the next forward
    broadcasts ([Note: buffer broadcasting] in ddp/module_buffers.py); other replicated tensors
    dealt over the ranks ([Note: each byte written once]), an expert's over the ranks holding
    the same experts ([Note: expert checkpoints] in format.py); DTensors and objects as they
    are, which DCP writes once. The two layouts of a save (this file's and layout.py's) add
    their entries through it."""

    def __init__(self) -> None:
        self._dealt: dict[str, int] = {}
        self._dealt_experts: dict[str, int] = {}
        self._expert_group: Any = None

    def add(self, entries: dict[str, Any], fqn: str, key: str, value: Any, model: Any,
            buffers: set[str], tp: Any) -> None:
        """``value`` (a module entry of ``model`` under ``key``) into ``entries`` as ``fqn``,
        noted for dealing where it is dealt."""
        if isinstance(value, torch.Tensor):
            value = value.detach()
        if key in buffers:
            if model.parallel.first_dp_rank:
                entries[fqn] = value
        elif isinstance(value, torch.Tensor) and tp is None:
            expert = model.experts is not None and model.experts.is_expert_entry(key)
            (self._dealt_experts if expert else self._dealt)[fqn] = (
                value.numel() * value.element_size())
            entries[fqn] = value
            if expert:
                self._expert_group = model.experts.parallel.expert_dp_group
        else:
            entries[fqn] = value

    def drop_others(self, entries: dict[str, Any], rank: int, ranks: int) -> None:
        """Remove from ``entries`` the dealt entries another rank writes."""
        dealt_to = [(self._dealt, rank, ranks)]
        if self._expert_group is not None:
            dealt_to.append((self._dealt_experts, comm.group_rank(self._expert_group),
                             comm.group_size(self._expert_group)))
        for sizes, mine, count in dealt_to:
            for fqn, owner in deal(sizes, count).items():
                if owner != mine:
                    del entries[fqn]


def _model_entries(opt: Optimizer, rank: int, ranks: int) -> dict[str, Any]:
    """The entries of ``module.state_dict()`` this rank writes, under ``model/``."""
    entries: dict[str, Any] = {}
    dealer = ModuleEntryDealer()
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        buffers = buffer_keys(model.module)
        from_shards = _params_from_shards(opt, model)
        for key, value in module_entries(model.module).items():
            fqn = f"model/{prefix}{global_name(model, key)}"
            if isinstance(value, torch.Tensor) and value in from_shards:
                entries[fqn] = from_shards[value]
            else:
                dealer.add(entries, fqn, key, value, model, buffers, opt.parallel.tp)
    dealer.drop_others(entries, rank, ranks)
    return entries
