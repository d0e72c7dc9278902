"""Optimizer state held between steps in fewer bytes than fp32 (``state_dtype``).

[Note: state precision]
``state_dtype=torch.bfloat16`` (or a dict per state key) keeps every per-element state tensor
of the inner torch optimizer (a tensor shaped like its main param: Adam's moments, SGD's and
Muon's momentum, RMSprop's square average) in that dtype between steps. The step expands a
chunk's state to fp32 just before the inner step of that chunk and rounds it back just after
(round to nearest, ties to even: torch's ``.to``), so the unchanged ``torch.optim`` code steps
fp32 state, and only one chunk's state is fp32 at a time: with ``state_dtype`` the whole-shard
source steps one bucket's shard per chunk (see [Note: step chunks] in optim/step.py). torch
creates state at a param's first step, in fp32; leaving the chunk rounds it like any other.
Scalars (``step``, NAdam's ``mu_product``) and state that is not per element (Adafactor's row
and column statistics of a matrix) stay as torch keeps them. A step the loss scaler skips
returns before any chunk is stepped, so it leaves the state as it was.

So a step with bf16 state is the fp32-state step from the state rounded once to bf16, and its
result is rounded once more: after one step every element equals the fp32-state step's state
rounded once, and over many steps a run equals plain torch.optim with the state rounded to
bf16 after each step (tests/test_state_dtype.py checks both bit for bit).

fp16 holds 11 significant bits but only magnitudes from 6.1e-5 (5.96e-8 with subnormals) to
65504. State linear in the grads (momentum, ``exp_avg``) of typical magnitude is within it;
squares of grads (Adam's ``exp_avg_sq``, ~1e-8 to 1e-12 for grads of 1e-4 to 1e-6) underflow
to zero, after which Adam divides by ``eps`` alone and the update explodes. Rather than scale
blocks of it (scales to keep, reshard and check), fp16 is refused for the keys the table of
optimizer classes marks as squares (``StateKey.square`` in optim/kinds.py): use bf16 there.

Checkpoints hold the state as it is held (bf16 state writes bf16 shards). A load gives every
per-element state tensor the dtype of the loading run: fp32 state loaded into a bf16-state run
is rounded once, bf16 state loaded into an fp32-state run widens exactly, and the export to a
plain torch file widens to fp32, which is what ``torch.optim`` steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..options import StateDtype, check_state_dtype
from .kinds import StateKey, state_keys


def resolve_state_dtypes(
    state_dtype: StateDtype, classes: Iterable[type[torch.optim.Optimizer]]
) -> dict[str, torch.dtype]:
    """The dtype of each per-element state key of ``classes`` that is not held in fp32.

    Raises for a key none of the classes keeps, and for fp16 asked for a square of grads (see
    [Note: state precision]); the same verdict on every rank, before any collective.
    """
    check_state_dtype(state_dtype)
    if state_dtype is None:
        return {}
    classes = list(dict.fromkeys(classes))
    known: dict[str, list[tuple[type, StateKey]]] = {}
    open_ended = False  # a registered class whose keys distopt does not know
    for cls in classes:
        keys = state_keys(cls)
        if keys is None:
            open_ended = True
            continue
        for key in keys:
            known.setdefault(key.name, []).append((cls, key))
    if isinstance(state_dtype, Mapping):
        unknown = sorted(k for k in state_dtype if k not in known)
        if unknown and not open_ended:
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"state_dtype names {unknown}, not a state key of {names}, whose per-element "
                f"state keys are {sorted(known)}: name those, or pass one dtype for all"
            )
        dtypes = dict(state_dtype)
    else:
        dtypes = dict.fromkeys(known, state_dtype)
    for name, dtype in dtypes.items():
        squares = [cls.__name__ for cls, key in known.get(name, []) if key.square]
        if dtype == torch.float16 and squares:
            raise ValueError(
                f"state_dtype: '{name}' of {', '.join(squares)} holds squares of grads, which "
                "underflow fp16 (its smallest normal is 6.1e-5); hold it in torch.bfloat16 "
                "(e.g. state_dtype={'exp_avg': torch.float16, 'exp_avg_sq': torch.bfloat16})"
            )
    return {k: d for k, d in dtypes.items() if d != torch.float32}


class StatePrecision:
    """The dtypes per-element state is held in, and the conversions around an inner step."""

    def __init__(self, state: dict[nn.Parameter, dict[str, Any]],
                 dtypes: Mapping[str, torch.dtype]) -> None:
        self.state = state  # the inner optimizers' one state dict (optim/base.py)
        self.dtypes = dict(dtypes)

    @contextlib.contextmanager
    def fp32(self, mains: list[nn.Parameter]) -> Iterator[None]:
        """Inside the block the state of ``mains`` is fp32 (copies); after it, held again."""
        for main in mains:
            self._convert(main, self.state.get(main), lambda key: torch.float32)
        try:
            yield
        finally:
            for main in mains:
                self._convert(main, self.state.get(main), self.held_dtype)

    def held_dtype(self, key: str) -> torch.dtype:
        return self.dtypes.get(key, torch.float32)

    def hold(self, main: nn.Parameter, entries: dict[str, Any]) -> dict[str, Any]:
        """Loaded state entries of ``main`` in the dtypes this run holds (fp32 for the keys
        not named): rounded once, or widened exactly."""
        self._convert(main, entries, self.held_dtype)
        return entries

    @staticmethod
    def _convert(main: nn.Parameter, entries: dict[str, Any] | None, dtype_of: Any) -> None:
        if not entries:
            return
        for key, value in entries.items():
            if (isinstance(value, torch.Tensor) and value.dim() >= 1
                    and value.shape == main.shape and value.is_floating_point()):
                dtype = dtype_of(key)
                if value.dtype != dtype:
                    entries[key] = value.to(dtype)
