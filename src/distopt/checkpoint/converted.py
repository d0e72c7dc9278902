"""What a conversion reads, described in torch's layout before it is read: ``Converted`` and
its ``Lazy`` tensors ([Note: converted checkpoints] in convert.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Lazy:
    """One tensor of the output, read from the source only when it is written."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 read: Callable[[], torch.Tensor]) -> None:
        self.shape, self.dtype, self._read = tuple(shape), dtype, read

    def read(self) -> torch.Tensor:
        value = self._read()
        if tuple(value.shape) != self.shape:
            value = value.reshape(self.shape)
        return value.to(self.dtype)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

        return [_create_write_item_for_tensor(
            fqn, torch.empty(self.shape, dtype=self.dtype, device="meta"))]


@dataclass
class Converted:
    """A source checkpoint described in torch's layout, its tensors not read yet."""

    source: str  # what was read, for the command's report
    model: dict[str, Lazy | torch.Tensor]
    state: dict[str, dict[str, Lazy | torch.Tensor]]
    param_groups: list[dict[str, Any]]
    not_carried: list[str] = field(default_factory=list)  # what torch's layout has no place for

    def numel(self) -> int:
        return sum(_numel(v) for v in self.model.values())


def _numel(value: Lazy | torch.Tensor) -> int:
    shape = value.shape
    out = 1
    for n in shape:
        out *= n
    return out
