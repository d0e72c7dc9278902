"""A Megatron-Core distributed-optimizer checkpoint read as torch's layout, without
Megatron-Core ([Note: converted checkpoints] in convert.py)."""

from __future__ import annotations

from pathlib import Path

from .converted import Converted
from .files import CheckpointError


def looks_like(path: Path) -> bool:
    """Whether ``path`` is a Megatron checkpoint directory (or one iteration of it)."""
    return (path / "latest_checkpointed_iteration.txt").is_file() or (
        (path / "common.pt").is_file() and (path / ".metadata").is_file())


def read(path: Path) -> Converted:
    raise CheckpointError("Megatron-Core checkpoints are not covered yet")
