"""``save_checkpoint``: every rank writes what it owns, rank 0 commits the checkpoint."""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..comm import collectives as comm
from . import files
from .checks import Models, check_pair
from .files import CheckpointError
from .format import (
    FlatShard,
    Optimizer,
    buffer_keys,
    class_path,
    describe,
    group_class_paths,
    hyper_params,
    model_prefixes,
    owned_pieces,
    scaler_state,
)
from .state_dict import state_dict


def save_checkpoint(
    path: str | os.PathLike,
    ddp: Models,
    opt: Optimizer,
    extra: Any = None,
    *,
    keep: int | None = None,
    name: str | None = None,
    latest: bool = True,
) -> Path:
    """Save a checkpoint into the run directory ``path``; collective; returns its directory.

    Each call adds a checkpoint (``ckpt-000001``, ``ckpt-000002``, ... or ``name``) and points
    ``path/latest`` at it once it is complete; ``keep`` keeps only the newest ``keep``. ``extra``
    is any object ``torch.save`` accepts, taken from rank 0 and returned by load_checkpoint.
    ``latest=False`` writes no ``latest`` file, for a folder another tool owns (Lightning's
    ModelCheckpoint): load the checkpoint by its own directory then.
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
            latest = files.latest_name(Path(path))
            kept = f"; 'latest' still names {latest}" if latest else ""
            setup = f"cannot save a checkpoint in {path}: {exc}. Nothing was written{kept}"
    setup = comm.broadcast_object(setup, group)
    if isinstance(setup, str):
        raise CheckpointError(setup)
    final, tmp, sequence = setup

    from . import dcp  # see [Note: one-way imports]

    # Sharded params are gathered for the write, as a user's state_dict() sees them whole:
    # a transient of the whole model per rank while DCP writes ([Note: sharded params]).
    gathered = contextlib.ExitStack()
    for model in opt.models:
        if model.options.shard_params:  # the others hold their params whole
            gathered.enter_context(model.gathered_params())
    # Each rank's outcome, agreed on before anything is published; see [Note: failed saves].
    outcome: Any
    try:
        with gathered:
            state, whole = _dcp_state(opt, extra, rank)
            dcp.save(state, tmp, group)
        # The manifest lists every rank's files and the whole-parameter state its owner wrote.
        outcome = (files.checksum_files(tmp, f"__{rank}_"), whole)
    except dcp.WriteFailed as exc:  # the same on every rank
        outcome = str(exc)
    except OSError as exc:  # this rank's alone
        outcome = f"rank {rank}: {type(exc).__name__}: {exc}"
    written = comm.all_gather_object(outcome, group)
    problems = list(dict.fromkeys(o for o in written if isinstance(o, str)))

    failure = None
    if rank == 0:
        if not problems:
            try:
                listed = {k: v for per_rank, _ in written for k, v in per_rank.items()}
                listed[".metadata"] = files.checksum(tmp / ".metadata")
                whole_state: dict[str, dict[str, list[Any]]] = {}
                for _, per_rank in written:
                    for name, entries in per_rank.items():
                        whole_state.setdefault(name, {}).update(entries)
                manifest = _manifest(opt, sequence, final.name, listed, whole_state)
                files.commit(tmp, final, manifest, keep, latest)
            except Exception as exc:  # a full disk, a lost directory: nothing is published
                problems.append(f"rank 0: {type(exc).__name__}: {exc}")
        if problems:
            failure = _failure_message(final, tmp, problems)
    failure = comm.broadcast_object(failure, group)
    if failure:
        raise CheckpointError(failure)
    return final


def _failure_message(final: Path, tmp: Path, problems: list[str]) -> str:
    """Clean up after a failed save (rank 0) and say what happened and what is left."""
    left = files.discard(tmp, final)
    latest = files.latest_name(final.parent)
    if latest == final.name:  # published, then a later fsync failed
        return (f"checkpoint {final} was saved and 'latest' names it, but the save did not "
                f"finish cleanly: {'; '.join(problems)}")
    kept = f"'latest' still names {latest}" if latest else "no checkpoint was saved before"
    debris = (
        "; could not remove " + ", ".join(str(p) for p in left)
        + " (hidden, never loaded; the next save deletes it)" if left else ""
    )
    return (f"cannot save checkpoint {final}: {'; '.join(problems)}. Nothing of it was kept: "
            f"{kept} and earlier checkpoints are untouched{debris}. Free space or fix the "
            "directory, then save again")


def _dcp_state(opt: Optimizer, extra: Any, rank: int
               ) -> tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]:
    """What this rank gives DCP to write, under the keys of the package docstring, and the
    whole-parameter state among it (``{name: {key: [shape, dtype]}}``)."""
    from .dcp import piece_as_dcp

    sd = state_dict(opt)
    tp = opt.parallel.tp
    owned = {o.name: o for o in owned_pieces(opt)}
    state: dict[str, Any] = {}
    whole: dict[str, dict[str, list[Any]]] = {}
    for name, shard in sd["main_params"].items():
        state[f"main/{name}"] = piece_as_dcp(tp, owned[name], shard.local, writing=True)
    for name, entries in sd["state"].items():
        for key, value in entries.items():
            if isinstance(value, FlatShard):
                value = piece_as_dcp(tp, owned[name], value.local, writing=True)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                # Whole-parameter state, from its owner only; see [Note: whole-tensor state].
                whole.setdefault(name, {})[key] = describe(value)
            state[f"state/{name}/{key}"] = value
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        # Buffers from the first DP ranks only, so that DCP writes theirs, which the next
        # forward broadcasts; see [Note: buffer broadcasting] in ddp/module_buffers.py.
        others = set() if model.parallel.first_dp_rank else buffer_keys(model.module)
        for key, value in model.module.state_dict().items():
            if key not in others:
                state[f"model/{prefix}{key}"] = value
    state["meta/param_groups"] = sd["param_groups"]
    if rank == 0:
        state["extra"] = extra
    return state, whole


def _manifest(opt: Optimizer, sequence: int, name: str, listed: dict[str, dict[str, int]],
              whole_state: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    models = []
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        module = model.module
        models.append({
            "prefix": prefix,
            "parameters": [[n, list(p.shape), p.requires_grad]
                           for n, p in module.named_parameters()],
            "state_dict": [[k, *describe(v)] for k, v in module.state_dict().items()],
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
        "param_group_classes": group_class_paths(opt),
        "whole_state": whole_state,
        "default_param_groups": opt.default_param_groups,
        "loss_scaler": scaler_state(opt),
        "models": models,
        "files": listed,
    }
