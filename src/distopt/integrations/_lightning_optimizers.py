"""Turn the optimizer a LightningModule configures into distopt's over the same class and groups.

``configure_optimizers`` builds an ordinary ``torch.optim`` optimizer over the module's params, and
maybe LR schedulers on it. DistoptStrategy builds the distopt optimizer from it (same class, the
same groups with every option they hold, ``initial_lr`` included) and points the schedulers at the
distopt optimizer, whose ``param_groups`` the schedulers then step as they would have stepped the
original's. The original optimizer is dropped before it holds any state.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch

from ..ddp.wrapper import DistributedDataParallel
from ..optim.loss_scalers import LossScaler
from ..optim.optimizers import BasicOptimizer, DistributedOptimizer

# Kernel choices left unset in torch's groups (None or False); distopt picks its own kernel for
# the many small pieces of a shard (see distopt.optim.optimizers.default_kernel_kwargs).
_KERNEL_KEYS = ("foreach", "fused")


def _options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if not (k in _KERNEL_KEYS and not v)}


def to_distopt(
    optimizer: torch.optim.Optimizer,
    ddp: DistributedDataParallel,
    *,
    basic: bool,
    clip_grad: float | None,
    loss_scaler: LossScaler | None,
    **distopt_kwargs: Any,
) -> DistributedOptimizer | BasicOptimizer:
    """The distopt optimizer over ``ddp`` with ``optimizer``'s class, groups and options."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in _options(optimizer.defaults).items() if k in accepted}
    # Frozen params stay out, as torch.optim skips them (their grad is None); a group may end
    # up empty, and stays, so that per-group schedules keep their order.
    groups = [{**_options(g), "params": [p for p in g["params"] if p.requires_grad]}
              for g in optimizer.param_groups]
    distopt_cls = BasicOptimizer if basic else DistributedOptimizer
    return distopt_cls(ddp, cls, params=groups, clip_grad=clip_grad, loss_scaler=loss_scaler,
                       **distopt_kwargs, **defaults)


def check_convertible(optimizer: Any) -> None:
    """Raise unless ``optimizer`` is a plain torch.optim optimizer distopt can take over."""
    from ..optim.kinds import check_optimizer_cls

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"configure_optimizers returned a {type(optimizer).__name__}; DistoptStrategy "
            "rebuilds a torch.optim.Optimizer (AdamW, SGD, Muon, ...) as distopt's"
        )
    check_optimizer_cls(type(optimizer), "the optimizer from configure_optimizers")
    if optimizer.state:
        raise ValueError(
            "the optimizer from configure_optimizers already holds state; DistoptStrategy "
            "builds distopt's from its class and groups only: return a fresh optimizer (resume "
            "with Trainer.fit(ckpt_path=...) instead)"
        )


def repoint_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` (and the schedulers it chains) step ``optimizer``'s groups."""
    for sched in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        sched.optimizer = optimizer
    _track_step_calls(optimizer)


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    # What torch's LR schedulers do to the optimizer they are built on, so that they can tell
    # whether optimizer.step() ran before their first step().
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)  # no cycle through the instance attribute

    @functools.wraps(type(optimizer).step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
