"""The hooks distopt puts on a user's modules, which a copy of the module leaves behind.

[Note: a copy of a wrapped module]
torch's own tools copy a model with ``copy.deepcopy``: ``torch.optim.swa_utils.AveragedModel``
(EMA and SWA), a teacher for distillation, a frozen reference model. torch DDP keeps its hooks
off the module (its reducer hooks the params' grad accumulators), so such a copy is a plain
module. distopt's hooks sit on the modules (waiting for and gathering params around forwards,
writing a loaded state dict into the shards, refusing a state dict of placeholders), bound to
the DDP that owns the buffers and process groups: a deep copy of them would copy the DDP and
fail on its process group, or leave the copy gathering the original's buckets. Each is a
``ModuleHook``, whose deep copy does nothing, so the copy is a plain module holding what its
params held when it was made: their full values with full params or inside
``ddp.gathered_params()``. With sharded params between uses they hold placeholders, and a
copy then would be a model of NaN: the hook that refuses a state dict of placeholders refuses
the copy too (``on_copy``), naming ``gathered_params()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def _left_behind(*_args: Any, **_kwargs: Any) -> None:
    """A copied module's hook: nothing."""


class ModuleHook(functools.partial):
    """``fn`` as a module hook; a deep copy of it (of the module) is a hook that does
    nothing. See [Note: a copy of a wrapped module]. A partial with nothing bound, so that a
    forward calls ``fn`` with no Python frame of its own in between."""

    def __new__(cls, fn: Callable[..., Any],
                on_copy: Callable[[], None] | None = None) -> ModuleHook:
        hook = super().__new__(cls, fn)
        hook.on_copy = on_copy  # called when the module is copied: it may refuse the copy
        return hook

    def __deepcopy__(self, _memo: dict[int, Any]) -> Callable[..., None]:
        if self.on_copy is not None:
            self.on_copy()
        return _left_behind
