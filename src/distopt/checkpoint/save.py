"""``save_checkpoint``: every rank writes what it owns, rank 0 commits the checkpoint; with
``async_save=True`` the writing and the commit go on in the background (background.py)."""

from __future__ import annotations

import contextlib
import io
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..comm import collectives as comm
from ..ddp.params.whole_module import module_entries
from . import background, files, layout, parts
from .background import AsyncCheckpoint
from .checks import Models, check_pair
from .files import CheckpointError
from .format import (
    Optimizer,
    class_path,
    describe,
    group_class_paths,
    hyper_params,
    model_prefixes,
    names_everywhere,
    scaler_state,
)
from .pipeline import WholeModel, check_unique_names, pipelined, whole_model
from .staging import staging_of


def save_checkpoint(
    path: str | os.PathLike,
    ddp: Models,
    opt: Optimizer,
    extra: Any = None,
    *,
    keep: int | None = None,
    name: str | None = None,
    latest: bool = True,
    async_save: bool = False,
) -> Path | AsyncCheckpoint:
    """Save a checkpoint into the run directory ``path``; collective; returns its directory.

    Each call adds a checkpoint (``ckpt-000001``, ``ckpt-000002``, ... or ``name``) and points
    ``path/latest`` at it once it is complete. A save or load that finds an async save in
    flight waits for it.

    Args:
        path: the run directory that holds the checkpoints (created if missing), not a
            checkpoint itself; the same on every rank.
        ddp: the model the optimizer was built over: its DistributedDataParallel (or the
            wrapped module), or the list of model chunks.
        opt: the run's ``DistributedOptimizer`` or ``BasicOptimizer``; each rank writes the
            shard of its state and main params it owns. One with a ``model_parallel_group`` is
            refused (its parts would write the same names).
        extra: any object ``torch.save`` accepts (LR scheduler, data position, RNG), taken
            from rank 0 and returned by ``load_checkpoint``; None: nothing.
        keep: keep only the newest ``keep`` checkpoints of ``path``, deleting the older ones
            once this one is committed; a positive int. None: keep them all.
        name: the checkpoint's directory name, a plain name (no "/", not hidden, not
            "latest") that does not exist yet. None: the next ``ckpt-NNNNNN``.
        latest: point ``path/latest`` at the new checkpoint (True, the default). False writes
            no ``latest`` file, for a folder another tool owns (Lightning's ModelCheckpoint):
            load the checkpoint by its own directory then.
        async_save: copy what this rank writes into a host buffer kept between saves and
            return an ``AsyncCheckpoint`` at once; the files are written, agreed on and
            published in the background, with the same atomic commit (``handle.wait()`` gives
            the directory or raises the save's CheckpointError). Refused for tensor-parallel
            models. False (the default): write, then return the directory. See
            [Note: async saves] in background.py.
    """
    check_pair(ddp, opt)
    group = opt.parallel.checkpoint_group()
    whole = None
    if pipelined(opt):  # one checkpoint of the whole model: [Note: pipeline checkpoints]
        check_unique_names(opt)
        whole = whole_model(opt)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive number of checkpoints or None, got {keep!r}")
    if name is not None and (
        not isinstance(name, str) or not name or "/" in name or name.startswith(".")
        or name == files.LATEST
    ):
        raise ValueError(
            f"name must be a plain directory name (no '/', not hidden, not 'latest'), got {name!r}"
        )
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be True or False, got {async_save!r}")
    if async_save and opt.parallel.tp is not None:
        raise ValueError(
            "async_save=True does not stage tensor-parallel models (their DTensor entries): "
            "save them with async_save=False"
        )
    called = time.perf_counter()
    waited = background.wait_for_in_flight()  # one save in flight; see [Note: async saves]
    rank = comm.group_rank(group)
    for model in opt.models:
        model.finish_param_sync()  # an overlapped gather may still be writing the model params

    setup: Any = None
    if rank == 0:
        try:
            torch.save(extra, io.BytesIO())  # fail here, on every rank, not inside DCP
            setup = files.begin_save(Path(path), name)
        except Exception as exc:  # anything torch.save or the file system raises
            latest_name = files.latest_name(Path(path))
            kept = f"; 'latest' still names {latest_name}" if latest_name else ""
            setup = f"cannot save a checkpoint in {path}: {exc}. Nothing was written{kept}"
    setup = comm.broadcast_object(setup, group)
    if isinstance(setup, str):
        raise CheckpointError(setup)
    final, tmp, sequence = setup

    # torch's layout where torch's state-dict functions describe the model: [Note: torch's
    # layout on disk] in layout.py.
    nested = layout.covers(opt)
    publish = partial(_write_and_publish,
                      manifest=_manifest(opt, sequence, final.name, whole, nested),
                      tmp=tmp, final=final, keep=keep, latest=latest, nested=nested)
    with _params_gathered(opt):
        if nested:
            state, whole_state = layout.dcp_state(opt, extra, group, whole)
        else:
            state, whole_state = parts.dcp_state(
                opt, extra, group, None if whole is None else whole.param_groups)
        if not async_save:
            try:
                return publish(state, whole_state, group)
            finally:
                opt.settle_offloaded()  # the offloaded state read, dropped from memory
        writers = background.writer_group(group)  # collective the first time
        staged = _staged(opt, state, nested)
        opt.settle_offloaded()
    handle = AsyncCheckpoint(final, waited)
    handle.stall_s = time.perf_counter() - called
    return background.start(handle, lambda: publish(staged, whole_state, writers),
                            partial(_lost_message, final, rank))


def _staged(opt: Optimizer, state: dict[str, Any], nested: bool) -> dict[str, Any]:
    """``state`` copied into ``opt``'s staging buffer ([Note: async staging]), nested as it
    came."""
    if not nested:
        return staging_of(opt).stage(state)
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    flat, mappings = flatten_state_dict(state)
    return unflatten_state_dict(staging_of(opt).stage(flat), mappings)


def _params_gathered(opt: Optimizer) -> contextlib.ExitStack:
    """Sharded params gathered while their entries are read (and, saving synchronously,
    written), as a user's ``state_dict()`` sees them whole: a transient of the whole model per
    rank ([Note: sharded params] in ddp/buffers/param_storage.py). An async save has copied them
    into its staging when the block ends."""
    gathered = contextlib.ExitStack()
    for model in opt.models:
        # The others hold their params whole, or write them from their shards ([Note: model
        # entries from shards] in parts.py).
        if model.options.shard_params and not parts.shards_written_whole(opt, model):
            gathered.enter_context(model.gathered_params())
    return gathered


def _write_and_publish(state: dict[str, Any], whole: dict[str, dict[str, list[Any]]],
                       group: Any, *, manifest: dict[str, Any], tmp: Path, final: Path,
                       keep: int | None, latest: bool, nested: bool) -> Path:
    """Write ``state`` into ``tmp``, agree on every rank's outcome, and (rank 0) commit; raises
    the same CheckpointError on every rank if any rank failed. See [Note: failed saves]."""
    from . import dcp  # see [Note: one-way imports]

    rank = comm.group_rank(group)
    # Each rank's outcome, agreed on before anything is published; see [Note: failed saves].
    outcome: Any
    try:
        # The manifest lists every rank's files (their CRC32s taken as they were written) and
        # the whole-parameter state its owner wrote.
        outcome = (dcp.save(state, tmp, group, nested), whole)
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
                manifest = {**manifest, "whole_state": whole_state, "files": listed}
                files.commit(tmp, final, manifest, keep, latest)
            except Exception as exc:  # a full disk, a lost directory: nothing is published
                problems.append(f"rank 0: {type(exc).__name__}: {exc}")
        if problems:
            failure = _failure_message(final, tmp, problems)
    failure = comm.broadcast_object(failure, group)
    if failure:
        raise CheckpointError(failure)
    return final


def _lost_message(final: Path, rank: int, error: Exception) -> str:
    """What an async save that ended without the ranks' agreement (a peer lost during the
    write) tells this rank: the error, and that nothing of it is loaded."""
    latest = files.latest_name(final.parent)
    kept = f"'latest' still names {latest}" if latest else "no checkpoint was saved before"
    return (f"cannot save checkpoint {final}: rank {rank}: {type(error).__name__}: {error}. It "
            f"was not published: {kept}; what it wrote is hidden, never loaded, and the next "
            "save removes it")


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


def _manifest(opt: Optimizer, sequence: int, name: str,
              whole: WholeModel | None, nested: bool) -> dict[str, Any]:
    """The manifest as the save begins; the writing fills in the whole-parameter state its
    owners wrote and every file's checksum. ``whole``: a pipeline's whole model, described as
    one model."""
    models = []
    for prefix, model in zip(model_prefixes(opt), opt.models, strict=True):
        module = model.module
        models.append({
            "prefix": prefix,
            # Every EP rank's experts; see [Note: expert checkpoints] in format.py.
            "parameters": [[n, list(p.shape), p.requires_grad] for n, p in names_everywhere(
                model, list(module.named_parameters()))],
            "state_dict": [[k, *describe(v)] for k, v in names_everywhere(
                model, list(module_entries(module).items()))],
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
        "pp_size": opt.parallel.pp_size,
        "param_group_classes": group_class_paths(opt),
        "whole_state": None,
        "default_param_groups": opt.default_param_groups,
        "loss_scaler": scaler_state(opt),
        "models": models,
        "files": None,
    } | ({"layout": layout.TORCH} if nested else {}) | (
        {} if whole is None else {"models": whole.manifest_models(),
                                  "param_groups": whole.param_groups,
                                  "pipeline": whole.structure()})
