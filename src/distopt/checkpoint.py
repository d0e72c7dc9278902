"""Checkpoints that reshard: save at one DP size, resume at any other, export to plain PyTorch.

``save_checkpoint`` and ``load_checkpoint`` are collective over the data-parallel group. Each rank
writes only what it owns, through torch.distributed.checkpoint (DCP), under these keys::

    main/{name}          fp32 master values: 1-D [numel], one chunk per owning rank
    state/{name}/{key}   per-element optimizer state (exp_avg, ...): 1-D [numel], same chunks;
                         per-parameter scalars (step) once, as 0-d tensors
    model/{key}          the module's state_dict() in its own dtype, each tensor written once
    meta/param_groups    the param groups' options, each naming its parameters
    extra                the caller's object (LR scheduler, data position, RNG), from rank 0

next to ``distopt.json``, the manifest that describes the model and the optimizer and lists
every file with its CRC32. Loading reads the manifest and DCP's index, checks them against the
model and the optimizer, verifies the files' checksums (split over the ranks), and only then,
when every rank agrees, reads each rank's elements into place. See [Note: atomic checkpoints],
[Note: flat shards in DCP], [Note: DP-size independent state] and, for tensor-parallel
models, [Note: TP checkpoints] (distopt.tensor_parallel).
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from . import collectives as comm
from .checkpoint_export import export_checkpoint, export_main, load_plain_checkpoint
from .checkpoint_files import CheckpointError, has_checkpoint
from .checkpoint_state import (
    FlatShard,
    OwnedPiece,
    agree,
    check_groups,
    check_scaler,
    class_path,
    hyper_params,
    install_loaded_state,
    merge_state_dicts,
    model_prefixes,
    optimizer_state_dict,
    owned_pieces,
    scaler_state,
)
from .tensor_parallel import TensorParallelMesh, piece_runs

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .optimizer import _BufferOptimizer

# torch.distributed.checkpoint (through .checkpoint_dcp) is imported where it is used, so that
# `import distopt` stays as fast as before for processes that never checkpoint.

__all__ = [
    "CheckpointError",
    "FlatShard",
    "export_checkpoint",
    "export_main",
    "has_checkpoint",
    "load_checkpoint",
    "load_plain_checkpoint",
    "merge_state_dicts",
    "save_checkpoint",
]

Models = Any  # a DistributedDataParallel, its module, or a list of them (model chunks)


def check_pair(ddp: Models, opt: Any) -> None:
    """``ddp`` must be the model(s) ``opt`` was built over (the DDPs or their modules)."""
    from .optimizer import _BufferOptimizer

    if not isinstance(opt, _BufferOptimizer):
        raise TypeError(
            "opt must be a distopt.DistributedOptimizer or distopt.BasicOptimizer, got "
            f"{type(opt).__name__}; plain torch optimizers save with torch.save"
        )
    if getattr(opt, "model_parallel_group", None) is not None:
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


def _dcp_piece(tp: TensorParallelMesh | None, owned: OwnedPiece, values: torch.Tensor,
               writing: bool) -> torch.Tensor:
    """``values`` (1-D, laid out like ``owned``'s piece) as chunks of the flattened global
    parameter; see [Note: TP checkpoints]."""
    from . import checkpoint_dcp

    numel = owned.param.numel()
    if tp is None:
        return checkpoint_dcp.as_dcp(FlatShard(values, owned.start, numel))
    if writing and not tp.counts_once(owned.param):
        return checkpoint_dcp.as_dcp_chunks([], numel, values)  # TP coordinate 0 writes it
    runs = piece_runs(owned.param, owned.start, owned.end)
    return checkpoint_dcp.as_dcp_chunks([(g, values[i : i + n]) for i, g, n in runs], numel,
                                        values)


def _broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    if comm.group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if comm.group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * comm.group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------- save


def save_checkpoint(
    path: str | os.PathLike,
    ddp: Models,
    opt: _BufferOptimizer,
    extra: Any = None,
    *,
    keep: int | None = None,
    name: str | None = None,
) -> Path:
    """Save a checkpoint into the run directory ``path``; collective; returns its directory.

    Each call adds a checkpoint (``ckpt-000001``, ``ckpt-000002``, ... or ``name``) and points
    ``path/latest`` at it once it is complete; ``keep`` keeps only the newest ``keep``. ``extra``
    is any object ``torch.save`` accepts, taken from rank 0 and returned by load_checkpoint.
    """
    check_pair(ddp, opt)
    group = opt.parallel.checkpoint_group()
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive number of checkpoints or None, got {keep!r}")
    if name is not None and (
        not isinstance(name, str) or not name or "/" in name or name.startswith(".")
        or name == files.LATEST
    ):
        raise ValueError(
            f"name must be a plain directory name (no '/', not hidden, not 'latest'), got {name!r}"
        )
    rank = comm.group_rank(group)
    for model in opt.models:
        model.finish_param_sync()  # an overlapped gather may still be writing the model params

    setup: Any = None
    if rank == 0:
        try:
            torch.save(extra, io.BytesIO())  # fail here, on every rank, not inside DCP
            setup = files.begin_save(Path(path), name)
        except Exception as exc:  # anything torch.save or the file system raises
            setup = f"cannot save a checkpoint in {path}: {exc}"
    setup = _broadcast(setup, group)
    if isinstance(setup, str):
        raise CheckpointError(setup)
    final, tmp, sequence = setup

    from . import checkpoint_dcp

    checkpoint_dcp.save(_save_state(opt, extra, rank), tmp, group)
    written = _all_gather(files.checksum_files(tmp, f"__{rank}_"), group)

    failure = None
    if rank == 0:
        try:
            listed = {k: v for per_rank in written for k, v in per_rank.items()}
            listed[".metadata"] = files.checksum(tmp / ".metadata")
            files.commit(tmp, final, _manifest(opt, sequence, final.name, listed), keep)
        except OSError as exc:
            failure = f"cannot commit checkpoint {final}: {exc}"
    failure = _broadcast(failure, group)
    if failure:
        raise CheckpointError(failure)
    return final


def _save_state(opt: _BufferOptimizer, extra: Any, rank: int) -> dict[str, Any]:

    sd = optimizer_state_dict(opt)
    tp = opt.parallel.tp
    owned = {o.name: o for o in owned_pieces(opt)}
    state: dict[str, Any] = {}
    for name, shard in sd["main_params"].items():
        state[f"main/{name}"] = _dcp_piece(tp, owned[name], shard.local, writing=True)
    for name, entries in sd["state"].items():
        for key, value in entries.items():
            if isinstance(value, FlatShard):
                value = _dcp_piece(tp, owned[name], value.local, writing=True)
            state[f"state/{name}/{key}"] = value
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        for key, value in model.module.state_dict().items():
            state[f"model/{prefix}{key}"] = value
    state["meta/param_groups"] = sd["param_groups"]
    if rank == 0:
        state["extra"] = extra
    return state


def _describe(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return [None, None]


def _manifest(opt: _BufferOptimizer, sequence: int, name: str,
              listed: dict[str, dict[str, int]]) -> dict[str, Any]:
    models = []
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        module = model.module
        models.append({
            "prefix": prefix,
            "parameters": [[n, list(p.shape), p.requires_grad]
                           for n, p in module.named_parameters()],
            "state_dict": [[k, *_describe(v)] for k, v in module.state_dict().items()],
        })
    return {
        "format": files.FORMAT,
        "version": files.VERSION,
        "sequence": sequence,
        "name": name,
        "saved_at": time.time(),
        "dp_size": opt.parallel.dp_size,
        "tp_size": opt.parallel.tp_size,
        "torch": torch.__version__,
        "optimizer": class_path(type(opt.optimizer)),
        "param_groups": [group["params"] for group in hyper_params(opt)],
        "default_param_groups": opt.default_param_groups,
        "loss_scaler": scaler_state(opt),
        "models": models,
        "files": listed,
    }


# ---------------------------------------------------------------------- load


def load_checkpoint(
    path: str | os.PathLike, ddp: Models, opt: _BufferOptimizer, *, verify: bool = True
) -> Any:
    """Load a checkpoint saved at any DP size; collective; returns the ``extra`` saved with it.

    ``path`` is a run directory (its ``latest`` checkpoint is loaded) or a checkpoint directory.
    Everything is checked first (the model's and optimizer's structure, and with ``verify`` every
    file's size and CRC32, split over the ranks); on any problem every rank raises
    CheckpointError and the model and the optimizer are left as they were.
    """
    from . import checkpoint_dcp

    check_pair(ddp, opt)
    group = opt.parallel.checkpoint_group()
    rank, size = comm.group_rank(group), comm.group_size(group)
    error, checked = None, None
    try:
        ckpt_dir = files.resolve(path)
        manifest = files.read_manifest(ckpt_dir)
        listed = manifest["files"]
        files.verify_files(ckpt_dir, {".metadata": listed[".metadata"]})
        metadata = checkpoint_dcp.read_metadata(ckpt_dir)
        state_keys = _check_checkpoint(opt, manifest, metadata, ckpt_dir)
        if verify:
            data_files = sorted(k for k in listed if k != ".metadata")
            files.verify_files(ckpt_dir, {k: listed[k] for k in data_files[rank::size]})
        checked = (ckpt_dir, manifest, metadata, state_keys)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # an unreadable manifest or index: report it like the rest
        error = f"cannot read the checkpoint at {path}: {type(exc).__name__}: {exc}"
    agree(error, group)
    assert checked is not None
    return _load(opt, *checked)


def _shapes(entries: list[list[Any]]) -> dict[str, Any]:
    return {e[0]: e[1] for e in entries}


def _diff(saved: dict[str, Any], current: dict[str, Any], what: str, ckpt_dir: Path) -> None:
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    reshaped = [k for k in current if k in saved and list(current[k] or []) != (saved[k] or [])]
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        parts.append(f"not in this model: {', '.join(unexpected[:5])}")
    for k in reshaped[:5]:
        parts.append(f"'{k}' has shape {tuple(saved[k])} in the checkpoint, "
                     f"{tuple(current[k])} here")
    raise CheckpointError(
        f"checkpoint {ckpt_dir} is of another model ({what}: {'; '.join(parts)}): load a "
        "checkpoint of this model, or build the model that was saved"
    )


def _check_checkpoint(opt: _BufferOptimizer, manifest: dict[str, Any], metadata: Metadata,
                      ckpt_dir: Path) -> dict[str, list[str]]:
    """Compare the checkpoint with the model and optimizer; return each param's state keys."""
    expected = class_path(type(opt.optimizer))
    if manifest["optimizer"] != expected:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} holds {manifest['optimizer']} state, this optimizer wraps "
            f"{expected}: build the optimizer with the saved class, or export the checkpoint "
            "(distopt export) and convert the state yourself"
        )
    if len(manifest["models"]) != len(opt.models):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has {len(manifest['models'])} model chunks, the optimizer "
            f"{len(opt.models)}"
        )
    for saved, prefix, model in zip(manifest["models"], model_prefixes(opt), opt.models,
                                    strict=True):
        trainable = {n: s for n, s, requires_grad in saved["parameters"] if requires_grad}
        current = {model.param_names[p]: list(p.shape) for p in model.params}
        _diff(trainable, current, f"trainable parameters{' of ' + prefix if prefix else ''}",
              ckpt_dir)
        here = {k: _describe(v)[0] for k, v in model.module.state_dict().items()}
        _diff(_shapes(saved["state_dict"]), here, "state_dict entries", ckpt_dir)
    check_groups(opt, manifest["param_groups"], f"checkpoint {ckpt_dir}")
    scaler = manifest["loss_scaler"]
    check_scaler(opt, None if scaler is None else scaler["type"], f"checkpoint {ckpt_dir}")

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
    return state_keys


def _load(opt: _BufferOptimizer, ckpt_dir: Path, manifest: dict[str, Any], metadata: Metadata,
          state_keys: dict[str, list[str]]) -> Any:
    """Read every rank's elements into place (the checks have passed on every rank)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from . import checkpoint_dcp

    for model in opt.models:
        model.finish_param_sync()
    index = metadata.state_dict_metadata
    state: dict[str, Any] = {"meta/param_groups": None, "extra": None}
    targets = []
    group_of_main = {id(m): g for g in opt.param_groups for m in g["params"]}
    tp = opt.parallel.tp
    for owned in owned_pieces(opt):
        numel = owned.param.numel()
        state[f"main/{owned.name}"] = _dcp_piece(tp, owned, owned.main.detach(), writing=False)
        live = opt.state.get(owned.main, {})
        group = group_of_main[id(owned.main)]
        slots: dict[str, Any] = {}
        for key in state_keys.get(owned.name, []):
            fqn = f"state/{owned.name}/{key}"
            entry = index[fqn]
            if isinstance(entry, BytesStorageMetadata):
                state[fqn] = None
                slots[key] = fqn
                continue
            dtype = entry.properties.dtype
            shape = owned.main.shape if entry.size == torch.Size([numel]) else entry.size
            old = live.get(key)
            if isinstance(old, torch.Tensor) and old.shape == shape and old.dtype == dtype:
                target = old.detach()  # read in place: no second copy of the state
            else:
                on_cpu = key == "step" and not (group.get("capturable") or group.get("fused"))
                device = "cpu" if on_cpu and len(shape) == 0 else owned.main.device
                target = torch.empty(shape, dtype=dtype, device=device)
            if len(shape) == 0:
                state[fqn] = target
            else:
                state[fqn] = _dcp_piece(tp, owned, target, writing=False)
            slots[key] = target
        targets.append((owned, slots))
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        trainable = {id(p) for p in model.params}
        for key, value in model.module.state_dict(keep_vars=True).items():
            # Trainable params come from the fp32 main params below; the rest as saved.
            if isinstance(value, torch.Tensor) and id(value) not in trainable:
                state[f"model/{prefix}{key}"] = value.detach()

    with torch.no_grad():
        checkpoint_dcp.load(state, ckpt_dir, opt.parallel.checkpoint_group(), metadata)
    install_loaded_state(
        opt,
        [(owned, {k: state[v] if isinstance(v, str) else v for k, v in slots.items()})
         for owned, slots in targets],
        state["meta/param_groups"],
        manifest["loss_scaler"],
    )
    return state["extra"]
