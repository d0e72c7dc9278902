"""``save_checkpoint``'s files in torch's layout, and ``load_checkpoint``'s reading of them.

[Note: torch's layout on disk]
A checkpoint holds, under DCP's nested keys, what torch's ``get_state_dict`` gives over the same
model and optimizer ([Note: torch's layout from flat shards] in torch_layout.py)::

    model.{fqn}                           fp32 masters of trainable params, in the param's shape;
                                          the module's other entries (frozen params, buffers)
                                          in their own dtype
    optimizer.state.{fqn}.{key}           per-element state in the param's shape, in the dtype
                                          the run holds it (scaled state as its fp32 values);
                                          ``step`` as a 0-d tensor; whole-parameter state whole
    optimizer.param_groups.{i}.{option}   every group's options, ``params`` as torch's FQNs
    distopt.extra                         the caller's object, torch.save'd, from rank 0

So a torch script resumes it with torch's own recipe, without distopt::

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

and DCP's metadata records the nesting (``planner_data``), as torch's ``dcp.save`` does. What
torch's layout has no place for is converted to torch's form: scaled state (fp16/fp8 values
with block exponents) as its fp32 values, which a load quantizes with its own blocks exactly
as it would have from the values and exponents; the masters of a run with
``store_param_remainders`` rebuilt exactly, split back on load. The manifest beside it
(``distopt.json``, ``"layout": "torch"``) keeps what makes it distopt's: the structure every
load checks first, the files' sizes and CRC32s, the loss scaler's state.

Every layout distopt trains is written so, under the whole model's FQNs where distopt knows
them, as torchtitan writes its model parts: a pipeline stage's entries under the names the
whole model gives them ([Note: pipeline checkpoints] in pipeline.py), so that the unpipelined
model loads them with torch's recipe; a tie's optimizer state once, by the stage that counts
it ([Note: tied stage params]), and each model entry two stages hold by the lowest pipeline
rank holding it; the manifest's ``"pipeline"`` lists each pipeline rank's params and the tied
ones. An expert's entries are under its global FQN ([Note: expert checkpoints] in format.py),
each EP rank writing its own; model chunks that are not stages under ``chunk{i}.{fqn}``. The
earlier layout (``main/``, ``state/``, ``model/``; package docstring) is still read.

Each rank writes its part of the pieces it holds as boxes of the params' shapes, split between
replicas ([Note: each byte written once] in parts.py); the model's other entries are dealt out
over the ranks (buffers from the first DP ranks). The trainable params are written once, as
their fp32 masters, where the earlier layout wrote them twice (masters, and the model's own
copy): 12 bytes a param for fp32 AdamW instead of 16.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..comm import collectives as comm
from ..ddp.params.whole_module import module_entries
from . import parts
from .files import CheckpointError
from .format import (
    FlatShard,
    Optimizer,
    buffer_keys,
    describe,
    global_name,
    model_prefixes,
    owned_pieces,
    param_names,
    untrained_entries,
)
from .install import install, state_tensor
from .pipeline import WholeModel
from .state_dict import state_dict
from .torch_layout import _torch_entries, boxes, torch_fqn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

TORCH = "torch"
"""The manifest's ``layout`` of a checkpoint in torch's layout (absent: the earlier one)."""
EXTRA = ("distopt", "extra")

write_earlier_layout = False
"""Write the earlier layout (``main/``, ``state/``, ``model/``) instead: what the tests that
check that ``load_checkpoint`` still reads it set, never a user."""


def covers(opt: Optimizer) -> bool:
    """Whether ``opt``'s checkpoints are written in torch's layout: every layout distopt trains
    (one model, model chunks, pipeline stages, experts, tensor parallelism)."""
    return not write_earlier_layout


# ---------------------------------------------------------------------- save


def _model_entries(opt: Optimizer, mains: dict[str, FlatShard], part: Any,
                   whole: WholeModel | None, group: Any) -> dict[str, Any]:
    """The ``model`` entries this rank writes: the trainable params' boxes of its part of
    their masters, the module's other entries dealt out ([Note: each byte written once] in
    parts.py), each under the whole model's torch FQN (a chunk's prefixed ``chunk{i}.``, an
    expert's by its global name)."""
    tp = opt.parallel.tp
    names = param_names(opt)
    fp32 = torch.empty(0, dtype=torch.float32)
    # A pipeline stage's entries are held by its DP ranks alone, and one that two stages hold
    # (a tie's copies under one name) is written by the lowest pipeline rank holding it.
    rank, ranks = parts.model_dealers(opt, group)
    writers = None if whole is None else whole.entry_stages
    pp_rank = comm.group_rank(opt.parallel.pp_group) if whole is not None else 0
    entries: dict[str, Any] = {}
    dealer = parts.ModuleEntryDealer()
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        buffers = buffer_keys(model.module)
        trainable = {id(p) for p in model.params}
        for key, value in module_entries(model.module).items():
            name = prefix + global_name(model, key)
            if writers is not None and writers.get(name, pp_rank) != pp_rank:
                continue  # another stage's copy of it
            fqn = torch_fqn(name)
            if id(value) in trainable:  # boxes of this rank's part, if it holds a piece
                shard = mains.get(names[value])
                entries[fqn] = boxes(value, None if shard is None else part(names[value], shard),
                                     fp32)
            else:
                dealer.add(entries, fqn, key, value, model, buffers, tp)
    dealer.drop_others(entries, rank, ranks)
    return entries


def dcp_state(opt: Optimizer, extra: Any, group: Any, whole: WholeModel | None = None
              ) -> tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]:
    """What this rank gives DCP (nested, as torch's ``dcp.save`` is given it) and the
    whole-parameter state among it (``{name: {key: [shape, dtype]}}``). ``whole``: a
    pipeline's whole model ([Note: pipeline checkpoints] in pipeline.py)."""
    sd = state_dict(opt)
    # A tie's copies: their state is written by the stage that counts it ([Note: tied stage
    # params]); their model entries by the lowest stage holding each name.
    copies = {o.name for o in owned_pieces(opt) if o.param in opt.tied_copies}
    for name in copies:
        sd["state"].pop(name, None)
    order = [n for g in sd["param_groups"] for n in g["params"] if n in sd["state"]]
    if whole is not None:
        sd["param_groups"] = [{**g, "params": names}
                              for g, names in zip(sd["param_groups"], whole.param_groups,
                                                  strict=True)]
    tp = opt.parallel.tp
    index, count = parts.holders(opt)
    params = {name: p for p, name in param_names(opt).items()}

    def part(name: str, shard: FlatShard) -> FlatShard | None:
        if tp is not None and not tp.counts_once(params[name]):
            return None  # TP coordinate 0 writes a replicated param
        lo, hi = parts.part_of(shard.offset, shard.end, index, count)
        return FlatShard(shard.local.reshape(-1)[lo - shard.offset : hi - shard.offset], lo,
                         shard.numel)

    entries = _model_entries(opt, sd["main_params"], part, whole, group)
    state: dict[str, dict[str, Any]] = {}
    whole_state: dict[str, dict[str, list[Any]]] = {}
    starts = {o.name: o.start for o in owned_pieces(opt)}
    for position, name in enumerate(order):  # torch's order
        # Values of the whole param (step, whole-parameter state) from one of the ranks that
        # hold them: a holder of its first element, one replica ([Note: each byte written
        # once] in parts.py).
        first = tp is not None or (starts[name] == 0 and position % count == index)
        converted = {}
        for key, value in _torch_entries(sd["state"][name]).items():
            if isinstance(value, FlatShard):
                value = boxes(params[name], part(name, value), value.local)
            elif isinstance(value, torch.Tensor):
                if value.dim() > 0:  # every holder lists it for the manifest
                    whole_state.setdefault(name, {})[key] = describe(value)
                if not first:
                    continue
            converted[key] = value
        state[torch_fqn(name)] = converted
    groups = [{**g, "params": [torch_fqn(n) for n in g["params"]]} for g in sd["param_groups"]]
    out: dict[str, Any] = {"model": entries,
                           "optimizer": {"state": state, "param_groups": groups}}
    if comm.group_rank(group) == 0:
        buffer = io.BytesIO()
        torch.save(extra, buffer)  # one object, as DCP would not flatten it
        out[EXTRA[0]] = {EXTRA[1]: buffer.getvalue()}
    return out, whole_state


# ---------------------------------------------------------------------- load


def _paths(metadata: Metadata) -> dict[tuple[Any, ...], str]:
    """DCP's key of each nested path, from the metadata's record of the nesting."""
    data = metadata.planner_data or {}
    return {tuple(path): key for key, path in data.items()}


def check_index(opt: Optimizer, manifest: dict[str, Any], metadata: Metadata,
                ckpt_dir: Path) -> dict[str, list[str]]:
    """Check DCP's index against this rank's pieces; return each piece's saved state keys."""
    index = metadata.state_dict_metadata
    paths = _paths(metadata)
    keys: dict[str, list[str]] = {}
    for path in paths:
        if len(path) == 4 and path[:2] == ("optimizer", "state"):
            keys.setdefault(path[2], []).append(path[3])
    whole_state = manifest.get("whole_state") or {}
    for owned in owned_pieces(opt):
        fqn = torch_fqn(owned.name)
        entry = index.get(paths.get(("model", fqn), ""))
        if entry is None or getattr(entry, "size", None) != owned.param.shape:
            raise CheckpointError(
                f"checkpoint {ckpt_dir} has no fp32 masters of shape "
                f"{tuple(owned.param.shape)} for '{fqn}' in its index: it is damaged or of "
                "another model")
        for key, (shape, _) in whole_state.get(owned.name, {}).items():
            entry = index.get(paths.get(("optimizer", "state", fqn, key), ""))
            if entry is None or getattr(entry, "size", None) != torch.Size(shape):
                raise CheckpointError(
                    f"checkpoint {ckpt_dir} lists state '{key}' of '{owned.name}' of shape "
                    f"{tuple(shape)}, which its index does not hold: it is damaged")
    return keys


def read(opt: Optimizer, group: Any, ckpt_dir: Path, manifest: dict[str, Any],
         metadata: Metadata, state_keys: dict[str, list[str]]) -> Any:
    """Read every rank's elements into place (the checks have passed on every rank); return
    the ``extra`` saved with it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from . import dcp  # see [Note: one-way imports]

    for model in opt.models:
        model.finish_param_sync()
    index = metadata.state_dict_metadata
    paths = _paths(metadata)
    whole_state = manifest.get("whole_state") or {}
    flat: dict[str, Any] = {}
    targets = []
    with opt.main_params_materialized():
        for owned in owned_pieces(opt):
            fqn, param = torch_fqn(owned.name), owned.param
            main = owned.main.detach()
            flat[paths[("model", fqn)]] = boxes(
                param, FlatShard(main.view(-1), owned.start, param.numel()), main)
            slots: dict[str, Any] = {}
            for key in state_keys.get(fqn, []):
                at = paths[("optimizer", "state", fqn, key)]
                entry = index[at]
                if isinstance(entry, BytesStorageMetadata):  # an object: DCP replaces it
                    flat[at] = None
                    slots[key] = at
                    continue
                per_element = (key not in whole_state.get(owned.name, {})
                               and entry.size == param.shape
                               and (param.dim() > 0 or key != "step"))
                shape = owned.main.shape if per_element else entry.size
                target = state_tensor(opt, owned, key, shape, entry.properties.dtype)
                flat[at] = (boxes(param, FlatShard(target.reshape(-1), owned.start,
                                                   param.numel()), target)
                            if per_element else target)
                slots[key] = target
            targets.append((owned, slots))
        for name, value in untrained_entries(opt):
            flat[paths[("model", torch_fqn(name))]] = value
        for path, at in paths.items():
            if path[:2] == ("optimizer", "param_groups") or path == EXTRA:
                flat[at] = None
        with torch.no_grad():
            dcp.load(flat, ckpt_dir, group, metadata)
        install(opt, [(owned, {k: flat[v] if isinstance(v, str) else v
                               for k, v in slots.items()}) for owned, slots in targets],
                param_groups(flat, paths), manifest["loss_scaler"])
    opt.sync_model_params()
    saved = flat.get(paths.get(EXTRA, ""))
    return None if saved is None else torch.load(io.BytesIO(saved), weights_only=False)


def param_groups(objects: dict[str, Any], paths: dict[tuple[Any, ...], str]
                 ) -> list[dict[str, Any]]:
    """The param groups' options out of the loaded objects, in order (``params`` as FQNs)."""
    groups: dict[int, dict[str, Any]] = {}
    for path, at in paths.items():
        if path[:2] == ("optimizer", "param_groups"):
            groups.setdefault(int(path[2]), {})[str(path[3])] = objects[at]
    return [groups[i] for i in sorted(groups)]
