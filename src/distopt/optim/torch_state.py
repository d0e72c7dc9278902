"""``opt.state[p]`` for a model param ``p``, as torch users read it.

[Note: opt.state by model param]
torch's ``opt.state`` is keyed by the params the optimizer steps; scripts read
``opt.state[p]["step"]`` with ``p`` a model param, to log or to resume. distopt's optimizers
step fp32 main params (pieces of the model params), so their state is keyed by those, and a
model param was no key: ``KeyError``. ``TorchState`` is the one state dict every inner
optimizer shares, keyed by main params as before, that also answers a model param of its own
optimizer: a dict of the param's scalar state (``step``) read from this rank's piece of it, or
from another piece of the same param group where this rank holds none of it (every param of a
group steps together). Per-element state (``exp_avg``, ...) is a piece of the param on each
rank, not a tensor of its shape: asking for it raises, naming
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which gives it in the
param's shape. The dict is built for the read and not stored: writing into it changes nothing.

``bool(opt.state)`` is whether the optimizer holds state, as torch's: true on every rank once a
step updated the params or a load installed state, also on a rank that owns no piece (whose
dict is empty), so that code asking it (torchtitan's ``init_optim_state``, which steps when it
is false) takes the same branch on every rank and the step's collectives match.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class ParamScalars(dict):
    """The scalar state of one model param; other keys raise naming where they are."""

    def __init__(self, name: str, scalars: dict[str, Any]) -> None:
        super().__init__(scalars)
        self.name = name

    def __missing__(self, key: str) -> Any:
        raise KeyError(
            f"opt.state[p][{key!r}] of parameter '{self.name}': distopt holds per-element "
            "optimizer state as shards of the param on each rank, so opt.state[p] holds its "
            f"scalars only ({sorted(self)}); get_optimizer_state_dict(ddp, opt) "
            "(torch.distributed.checkpoint.state_dict) gives every state in the param's shape"
        )


class TorchState(defaultdict):
    """The inner optimizers' shared state, which also answers a model param; see
    [Note: opt.state by model param]."""

    def __init__(self, scalars_of: Callable[[Any], ParamScalars | None]) -> None:
        super().__init__(dict)
        self._scalars_of = scalars_of
        self.made = False  # a step or a load made state, on every rank

    def __bool__(self) -> bool:
        return self.made or dict.__len__(self) > 0

    def __missing__(self, key: Any) -> Any:
        scalars = self._scalars_of(key)
        if scalars is not None:
            return scalars
        return super().__missing__(key)


def scalar_entries(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of a piece's state that are one value for the whole param."""
    return {k: v for k, v in state.items()
            if not isinstance(v, torch.Tensor) or v.dim() == 0}
