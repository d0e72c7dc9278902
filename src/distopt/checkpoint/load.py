"""``load_checkpoint``: check everything on every rank, agree, then read each rank's elements."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..comm import collectives as comm
from ..ddp.params.whole_module import module_entries
from . import background, files, layout
from .checks import (
    Models,
    agree,
    check_groups,
    check_optimizer_class,
    check_pair,
    check_same_model,
    check_scaler,
    check_whole_state,
)
from .files import CheckpointError
from .format import (
    Optimizer,
    describe,
    model_prefixes,
    names_everywhere,
    owned_pieces,
    untrained_entries,
)
from .install import install, state_tensor
from .pipeline import WholeModel, check_unique_names, pipelined, whole_model

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def load_checkpoint(
    path: str | os.PathLike, ddp: Models, opt: Optimizer, *, verify: bool = True
) -> Any:
    """Load a checkpoint saved at any DP size; collective; returns the ``extra`` saved with it.

    Everything is checked first; on any problem every rank raises CheckpointError and the model
    and the optimizer are left as they were.

    Args:
        path: a run directory (its ``latest`` checkpoint is loaded) or a checkpoint directory.
        ddp: the model to load into, the one the optimizer was built over: its
            DistributedDataParallel (or the wrapped module), or the list of model chunks. Its
            structure (names, shapes, dtypes) must be the saved model's.
        opt: the ``DistributedOptimizer`` or ``BasicOptimizer`` to load into, with the saved
            optimizer's classes, param groups and loss scaler; each rank reads the elements it
            owns, whatever data-parallel size saved them.
        verify: check every data file's size and CRC32 against the manifest before reading
            (True, the default; the files are split over the ranks, so each reads a part);
            False checks the manifest and DCP's index only, for a faster load of files known
            to be whole.
    """
    from . import dcp  # see [Note: one-way imports]

    check_pair(ddp, opt)
    group = opt.parallel.checkpoint_group()
    whole = None
    if pipelined(opt):  # see [Note: pipeline checkpoints] in pipeline.py
        check_unique_names(opt)
        whole = whole_model(opt)
    background.wait_for_in_flight()  # an async save may be publishing what this load reads
    rank, size = comm.group_rank(group), comm.group_size(group)
    error, checked = None, None
    try:
        ckpt_dir = files.resolve(path)
        manifest = files.read_manifest(ckpt_dir)
        listed = manifest["files"]
        files.verify_files(ckpt_dir, {".metadata": listed[".metadata"]})
        metadata = dcp.read_metadata(ckpt_dir)
        state_keys = _check_checkpoint(opt, manifest, metadata, ckpt_dir, whole)
        if verify:
            data_files = sorted(k for k in listed if k != ".metadata")
            files.verify_files(ckpt_dir, {k: listed[k] for k in data_files[rank::size]})
        checked = (ckpt_dir, manifest, metadata, state_keys)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # an unreadable manifest or index: report it like the rest
        error = f"cannot read the checkpoint at {path}: {type(exc).__name__}: {exc}"
    agree(error, group)  # see [Note: which ranks agree]
    assert checked is not None
    if checked[1].get("layout") == layout.TORCH:  # [Note: torch's layout on disk]
        return layout.read(opt, group, *checked)
    return _read(opt, group, *checked)


def _check_checkpoint(opt: Optimizer, manifest: dict[str, Any], metadata: Metadata,
                      ckpt_dir: Path, whole: WholeModel | None) -> dict[str, list[str]]:
    """Compare the checkpoint with the model and optimizer (``whole``: a pipeline's whole
    model); return each param's state keys."""
    source = f"checkpoint {ckpt_dir}"
    # Checkpoints written before param groups could name a class list one class for all.
    classes = manifest.get("param_group_classes") or [manifest["optimizer"]] * len(
        manifest["param_groups"])
    check_optimizer_class(opt, classes, source,
                          otherwise="export the checkpoint (distopt export) and convert the "
                          "state yourself")
    # A pipeline's checkpoint and an unpipelined one both describe one whole model:
    # [Note: pipeline checkpoints] in pipeline.py.
    current_models = _current_models(opt, whole)
    if len(manifest["models"]) != len(current_models):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has {len(manifest['models'])} model chunks, the optimizer "
            f"{len(current_models)}"
        )
    for saved, (prefix, params, entries) in zip(manifest["models"], current_models,
                                                strict=True):
        trainable = {n: s for n, s, requires_grad in saved["parameters"] if requires_grad}
        check_same_model(trainable, params,
                         f"trainable parameters{' of ' + prefix if prefix else ''}", source)
        check_same_model({e[0]: e[1] for e in saved["state_dict"]}, entries,
                         "state_dict entries", source)
    check_groups(opt, manifest["param_groups"], source,
                 None if whole is None else whole.param_groups)
    scaler = manifest["loss_scaler"]
    check_scaler(opt, None if scaler is None else scaler["type"], source)
    whole_state = manifest.get("whole_state", {})
    check_whole_state(opt, whole_state)

    if manifest.get("layout") == layout.TORCH:
        return layout.check_index(opt, manifest, metadata, ckpt_dir)
    index = metadata.state_dict_metadata
    state_keys: dict[str, list[str]] = {}
    for key in index:
        if key.startswith("state/"):
            name, _, state_key = key[len("state/"):].rpartition("/")
            state_keys.setdefault(name, []).append(state_key)
    for owned in owned_pieces(opt):
        entry = index.get(f"main/{owned.name}")
        if entry is None or getattr(entry, "size", None) != torch.Size([owned.param.numel()]):
            raise CheckpointError(
                f"checkpoint {ckpt_dir} has no fp32 main params of {owned.param.numel()} elements "
                f"for '{owned.name}' in its index: it is damaged or of another model"
            )
        for key, (shape, _) in whole_state.get(owned.name, {}).items():
            entry = index.get(f"state/{owned.name}/{key}")
            if entry is None or getattr(entry, "size", None) != torch.Size(shape):
                raise CheckpointError(
                    f"checkpoint {ckpt_dir} lists state '{key}' of '{owned.name}' of shape "
                    f"{tuple(shape)}, which its index does not hold: it is damaged"
                )
    return state_keys


def _current_models(opt: Optimizer, whole: WholeModel | None
                    ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(prefix, trainable params' shapes, state_dict entries' shapes) of each model as a
    checkpoint describes it: a pipeline's stages as one whole model."""
    if whole is not None:
        return [("", {n: s for n, s, requires_grad in whole.parameters if requires_grad},
                 {e[0]: e[1] for e in whole.state_dict})]
    # Every EP rank's experts; see [Note: expert checkpoints] in format.py.
    return [(prefix,
             dict(names_everywhere(model, [(model.param_names[p], list(p.shape))
                                           for p in model.params])),
             dict(names_everywhere(model, [(k, describe(v)[0])
                                           for k, v in module_entries(model.module).items()])))
            for prefix, model in zip(model_prefixes(opt), opt.models, strict=True)]


def _read(opt: Optimizer, group: dist.ProcessGroup | None, ckpt_dir: Path, manifest: dict[str, Any],
          metadata: Metadata, state_keys: dict[str, list[str]]) -> Any:
    """Read every rank's elements into place (the checks have passed on every rank)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from . import dcp  # see [Note: one-way imports]

    for model in opt.models:
        model.finish_param_sync()
    # With store_param_remainders the masters are rebuilt for the block, read into, and
    # split back into the params and remainders when it ends.
    with opt.main_params_materialized():
        index = metadata.state_dict_metadata
        state: dict[str, Any] = {"meta/param_groups": None, "extra": None}
        targets = []
        tp = opt.parallel.tp
        whole_state = manifest.get("whole_state", {})
        for owned in owned_pieces(opt):
            numel = owned.param.numel()
            state[f"main/{owned.name}"] = dcp.piece_as_dcp(tp, owned, owned.main.detach(),
                                                            writing=False)
            slots: dict[str, Any] = {}
            for key in state_keys.get(owned.name, []):
                fqn = f"state/{owned.name}/{key}"
                entry = index[fqn]
                if isinstance(entry, BytesStorageMetadata):  # an object: DCP replaces the value
                    state[fqn] = None
                    slots[key] = fqn
                    continue
                whole = key in whole_state.get(owned.name, {})
                per_element = not whole and entry.size == torch.Size([numel])
                shape = owned.main.shape if per_element else entry.size
                target = state_tensor(opt, owned, key, shape, entry.properties.dtype)
                if not per_element:  # a scalar, or whole-parameter state: read whole
                    state[fqn] = target
                else:
                    state[fqn] = dcp.piece_as_dcp(tp, owned, target, writing=False)
                slots[key] = target
            targets.append((owned, slots))
        for name, value in untrained_entries(opt):
            state[f"model/{name}"] = value

        with torch.no_grad():
            dcp.load(state, ckpt_dir, group, metadata)
        install(
            opt,
            [(owned, {k: state[v] if isinstance(v, str) else v for k, v in slots.items()})
             for owned, slots in targets],
            state["meta/param_groups"],
            manifest["loss_scaler"],
        )
    opt.sync_model_params()
    return state["extra"]
