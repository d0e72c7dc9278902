"""``distopt convert``: another system's checkpoint as a DCP checkpoint in torch's layout.

[Note: converted checkpoints]
A conversion writes what ``get_state_dict(model, opt)`` gives under torch DDP, FSDP2 or distopt,
saved with ``dcp.save({"model": msd, "optimizer": osd})``: ``model`` maps each FQN to its fp32
master values (a buffer or frozen param to its saved value) and ``optimizer`` is torch's
optimizer state dict keyed by FQN (each param's ``step``, ``exp_avg``, ``exp_avg_sq``, ...,
whole, and ``param_groups`` with their options and their params' FQNs). torch's recipe then
resumes it at any d, DCP resharding it on load::

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=DST)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

A reader (from_deepspeed.py, from_megatron.py) describes the source as a ``Converted``: the
tensors as ``Lazy`` values, each of which reads its elements from the source files when asked
([Note: reading foreign torch.save files] in torch_zip.py). DCP's planner sees each one's
shape and dtype through the checkpointable protocol (``__create_write_items__``), and the
planner here reads a value only when the writer asks for it; the writer (writing.py's
[Note: bounded writes]) writes it and lets it go before the next. So the conversion holds one
tensor of the output at a time (and the pieces it is read from), never the model.

The output is written atomically: into a hidden sibling directory, every file fsynced, the
directory renamed to DST, its parent fsynced. A failure removes the sibling and leaves DST
absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from . import from_deepspeed, from_megatron
from .converted import Converted, Lazy
from .files import CheckpointError, _fsync_dir

FORMATS = ("deepspeed", "megatron")


def detect(src: Path) -> str:
    """The format of the checkpoint at ``src``: one of ``FORMATS``."""
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory: give the checkpoint directory that "
                              "DeepSpeed's save_checkpoint or Megatron-Core wrote")
    if from_deepspeed.looks_like(src):
        return "deepspeed"
    if from_megatron.looks_like(src):
        return "megatron"
    raise CheckpointError(
        f"{src} holds neither a DeepSpeed checkpoint (a 'latest' file, or *_optim_states.pt and "
        "*_model_states.pt files) nor a Megatron-Core one (latest_checkpointed_iteration.txt, or "
        "a torch_dist directory with .metadata and metadata.json); pass --from to say which it "
        "is")


def read_source(src: Path, fmt: str | None = None) -> Converted:
    """``src`` described as a ``Converted`` (``fmt`` None: detected)."""
    fmt = fmt or detect(src)
    if fmt == "deepspeed":
        return from_deepspeed.read(src)
    if fmt == "megatron":
        return from_megatron.read(src)
    raise CheckpointError(f"unknown source format {fmt!r}; choose from {', '.join(FORMATS)}")


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    class LazyPlanner(DefaultSavePlanner):
        """DCP's default planner, reading each ``Lazy`` value when the writer asks for it."""

        def lookup_object(self, index: Any) -> Any:
            value = self.state_dict[index.fqn]
            if isinstance(value, Lazy):
                return value.read()
            return super().lookup_object(index)

    return LazyPlanner()


def write_dcp(converted: Converted, directory: Path) -> None:
    """Write ``converted`` as a DCP checkpoint into the existing, empty ``directory``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .writing import _Writer

    state = {"model": converted.model,
             "optimizer": {"state": converted.state, "param_groups": converted.param_groups}}
    try:
        dcp.save(state, storage_writer=_Writer(directory, sync_files=True), planner=_planner(),
                 no_dist=True)
    except CheckpointException as exc:  # DCP's wrapper of the one process's error: that error
        raise next(iter(exc.failures.values()))[0] from None


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str],
            fmt: str | None = None) -> Converted:
    """Convert the checkpoint at ``src`` into a DCP checkpoint at ``dst`` (which must not
    exist), atomically; see [Note: converted checkpoints]."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} exists: convert into a new path, or remove it first")
    converted = read_source(src, fmt)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_dcp(converted, tmp)
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return converted
