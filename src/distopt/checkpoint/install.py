"""The last, infallible part of every load: loaded values into the optimizer.

Every loader checks first (checks.py) and changes nothing before its checks pass on every rank
that agrees; from here on nothing is checked. A load reads each state tensor into the tensor
``state_tensor`` picks (a DCP load reads straight into it; an in-memory one copies into it),
and ``install`` then makes those tensors the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .format import CLASS_KEY, Optimizer, OwnedPiece

KERNEL_OPTIONS = frozenset({"foreach", "fused", "capturable"})
"""Param-group options that say how torch.optim runs a step, not what it computes. They suit
the device the optimizer runs on (fused on CUDA, foreach on CPU by default; see
distopt.optim.optimizers.default_kernel_kwargs), so a load keeps the loading optimizer's own: a
checkpoint saved on CUDA resumes on the CPU with the CPU's kernels, and the reverse. Where
``state_tensor`` places the step counts follows the same, loading, options."""


def state_tensor(opt: Optimizer, owned: OwnedPiece, key: str, shape: Sequence[int],
                 dtype: torch.dtype) -> torch.Tensor:
    """The tensor that is to hold state ``key`` of a piece: the live one where it has this
    shape and dtype (no second copy of the state), else a new one where torch.optim keeps it."""
    live = opt.state.get(owned.main, {}).get(key)
    if isinstance(live, torch.Tensor) and live.shape == tuple(shape) and live.dtype == dtype:
        return live
    group = opt.param_group_of(owned.main)
    # torch.optim keeps plain step counts on the CPU; capturable and fused steps on the device.
    on_cpu = key == "step" and len(shape) == 0 and not (group.get("capturable")
                                                         or group.get("fused"))
    return torch.empty(shape, dtype=dtype, device="cpu" if on_cpu else owned.main.device)


def install(opt: Optimizer, states: Iterable[tuple[OwnedPiece, dict[str, Any]]],
            options: list[dict[str, Any]], scaler: dict[str, Any] | None) -> None:
    """Make ``states`` each piece's optimizer state, set the param groups' options (all but
    their params, ``KERNEL_OPTIONS`` and the group's class, which stays the class object the
    checks compared with the saved path) and the loss scaler's state (when both sides have a
    scaler).

    Per-element state takes the dtype the optimizer holds it in (rounded once, or widened).
    The model params are left as they are: a loader that loaded the main params rebuilds them
    with ``opt.sync_model_params()``.
    """
    states = list(states)
    if states:  # a load on a rank without pieces gives none: see [Note: opt.state by model param]
        opt.state.made = True
    for owned, state in states:
        if state:
            # Per-element state in the dtypes this run holds it in: see [Note: state
            # precision] in optim/state_precision.py.
            opt.optimizer.state[owned.main] = opt.state_precision.hold(owned.main, state)
        else:
            opt.optimizer.state.pop(owned.main, None)
    for group, saved in zip(opt.param_groups, options, strict=True):
        group.update({k: v for k, v in saved.items()
                      if k not in ("params", CLASS_KEY) and k not in KERNEL_OPTIONS})
    if opt.loss_scaler is not None and scaler is not None:
        opt.loss_scaler.load_state_dict(scaler["state"])
    opt.settle_offloaded()  # state loaded beside the offload tier moves into it


def install_values(opt: Optimizer, values: Iterable[tuple[OwnedPiece, torch.Tensor,
                                                          dict[str, Any]]],
                   options: list[dict[str, Any]], scaler: dict[str, Any] | None) -> None:
    """Load values held in memory: per piece its main values and its state entries (tensors
    laid out like the piece, or scalars), then ``install``."""
    states = []
    with torch.no_grad(), opt.main_params_materialized():
        for owned, main, entries in values:
            owned.main.detach().copy_(main)  # fp32 values kept exactly
            states.append((owned, {k: _placed(opt, owned, k, v) for k, v in entries.items()}))
    install(opt, states, options, scaler)


def install_states(opt: Optimizer, values: Iterable[tuple[OwnedPiece, dict[str, Any]]],
                   options: list[dict[str, Any]] | None = None) -> None:
    """Load state entries held in memory (per piece: tensors laid out like the piece, or
    scalars), leaving the main params as they are, then ``install`` them with the groups'
    options (kept as they are without ``options``)."""
    states = [(owned, {k: _placed(opt, owned, k, v) for k, v in entries.items()})
              for owned, entries in values]
    install(opt, states, options or [{} for _ in opt.param_groups], None)


def _placed(opt: Optimizer, owned: OwnedPiece, key: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return state_tensor(opt, owned, key, value.shape, value.dtype).copy_(value)
