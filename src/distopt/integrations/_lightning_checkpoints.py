"""What a DistoptStrategy checkpoint is on disk: a Lightning checkpoint file, and distopt's
sharded checkpoint beside it.

[Note: Lightning checkpoints under distopt]
``trainer.save_checkpoint("dir/name.ckpt")`` writes two things:

* ``dir/name.ckpt.distopt/``: distopt's checkpoint (each rank its shard of the fp32 master
  params and optimizer state, the module's state dict, Lightning's own state as ``extra``),
  what ``DistoptStrategy`` resumes from at any number of devices;
* ``dir/name.ckpt``: an ordinary Lightning checkpoint file, written by rank 0 from that
  checkpoint (distopt's export, one tensor at a time): the module's ``state_dict``, the
  optimizer state in torch.optim's format under ``optimizer_states`` (``torch_optimizer_state=
  False`` leaves it out) and Lightning's loops, schedulers and callbacks. Lightning's plain
  strategies (``DDPStrategy``), ``LightningModule.load_from_checkpoint`` and ``torch.load`` read
  it as they read their own.

A path is a file, as every Lightning tool expects (a directory at ``name.ckpt`` gave
``DDPStrategy`` a bare IsADirectoryError), and the folder gets nothing else: no ``latest``
pointer, which would be a stray file in ``ModelCheckpoint``'s folder. ``remove`` deletes both
parts; a ``last.ckpt`` that ``ModelCheckpoint(save_last="link")`` made a symlink finds its
sharded part beside the file it points to. A checkpoint directory of the earlier layout (the
distopt checkpoint at ``name.ckpt`` itself) still resumes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint import export_checkpoint, has_checkpoint

SUFFIX = ".distopt"


def sharded_dir(path: str | os.PathLike) -> Path:
    """Where the sharded part of the checkpoint at ``path`` lives (a symlink followed)."""
    real = Path(os.path.realpath(path))
    return real.with_name(real.name + SUFFIX)


def resolve(path: str | os.PathLike) -> Path | None:
    """The distopt checkpoint to resume ``path`` from: the sharded part beside it, or ``path``
    itself in the earlier layout; None when there is neither."""
    for candidate in (sharded_dir(path), Path(path)):
        if has_checkpoint(candidate):
            return candidate
    return None


def remove(path: str | os.PathLike) -> None:
    """Delete the checkpoint at ``path``: the file (or a symlink to one), its sharded part, or
    a directory of the earlier layout."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    shards = path.with_name(path.name + SUFFIX)
    if shards.is_dir() and not shards.is_symlink():
        shutil.rmtree(shards)


def write_file(sharded: Path, path: Path, *, optimizer: bool,
               trainable: list[list[bool]] | None) -> None:
    """Write the Lightning checkpoint file ``path`` from the sharded checkpoint ``sharded``
    (its ``extra`` is Lightning's checkpoint dict without the weights and optimizer states).
    ``optimizer``: include ``optimizer_states``; ``trainable`` says, for each param group of
    the optimizer ``configure_optimizers`` built, which of its params train (distopt leaves
    frozen ones out of its groups; torch's state dict lists them)."""

    def lightning_checkpoint(tree: dict[str, Any]) -> dict[str, Any]:
        checkpoint = {**tree["extra"], "state_dict": tree["model"]}
        if optimizer and "optimizer" in tree:  # one class: one torch.optim optimizer
            checkpoint["optimizer_states"] = [_with_frozen(tree["optimizer"], trainable)]
        return checkpoint

    export_checkpoint(sharded, path, verify=False, transform=lightning_checkpoint)


def _with_frozen(state: dict[str, Any], trainable: list[list[bool]] | None) -> dict[str, Any]:
    """``state`` (params numbered over the trainable ones) renumbered over every param of the
    original groups, frozen ones included, as ``optimizer.state_dict()`` numbers them."""
    if trainable is None or all(all(group) for group in trainable):
        return state
    new_ids, groups, old, new = {}, [], 0, 0
    for group, mask in zip(state["param_groups"], trainable, strict=True):
        ids = []
        for trains in mask:
            if trains:
                new_ids[old] = new
                old += 1
            ids.append(new)
            new += 1
        groups.append({**group, "params": ids})
    return {"state": {new_ids[k]: v for k, v in state["state"].items()}, "param_groups": groups}
