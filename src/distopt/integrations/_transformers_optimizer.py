"""The optimizer the Trainer drives under ``DistoptTrainer``: distopt's step behind torch's
``Optimizer`` interface, and the optimizer state in torch's format for the plain Trainer
([Note: distopt inside the Trainer] in integrations/transformers.py)."""

from __future__ import annotations

from typing import Any

import torch

import distopt


def carry_state(old: distopt.DistributedOptimizer, new: distopt.DistributedOptimizer) -> None:
    """``old``'s optimizer state (moments, step counts, the groups' options, the loss scale)
    into ``new``, built over the same model wrapped anew. The main params stay ``new``'s, the
    model's values now: the Trainer may have loaded other weights since (its best model)."""
    state = old.sharded_state_dict()
    state["main_params"] = new.sharded_state_dict()["main_params"]
    new.load_state_dict(state)  # collective, as every rank builds its optimizer


def trainer_optimizer_state(tree: dict[str, Any], slots: list[float | None]) -> dict[str, Any]:
    """The torch.optim state dict the plain Trainer's optimizer loads, from distopt's export:
    an empty param group wherever the Trainer keeps one (``slots``: None for a group distopt
    has, else the empty group's weight decay)."""
    state = tree["optimizer"]
    saved = list(state["param_groups"])
    template = saved[0]
    groups = []
    for weight_decay in slots:
        groups.append(saved.pop(0) if weight_decay is None
                      else {**template, "weight_decay": weight_decay, "params": []})
    return {"state": state["state"], "param_groups": groups + saved}


class TrainerOptimizer(torch.optim.Optimizer):
    """What the Trainer steps: distopt's optimizer, seen as one the Trainer can drive.

    ``step()`` runs distopt's step (grad sync, loss-scale check, global clip, sharded update,
    param gather), then zeroes the grad buffers, since the Trainer's ``model.zero_grad()``
    only drops ``.grad`` attributes, which distopt does not use. ``last_result`` is the
    ``distopt.StepResult``; ``step_was_skipped`` tells the Trainer (through accelerate) not to
    advance the LR schedule after an fp16 overflow. ``DistoptTrainer.create_optimizer`` makes
    it.

    Args:
        distributed: the ``distopt.DistributedOptimizer`` it drives; its param groups, state,
            defaults and loss scaler are this optimizer's.
        grad_norm: a 0-d tensor the step fills in place with the step's global grad norm (nan
            where the step computed none), which the Trainer reads as the norm it clipped.
    """

    # Accelerate takes it as prepared: no wrapper that would move or reload its state.
    _is_accelerate_prepared = True

    def __init__(self, distributed: distopt.DistributedOptimizer, grad_norm: torch.Tensor) -> None:
        # Not Optimizer.__init__: the groups and the state are distopt's.
        self.distributed = distributed
        self.last_result: distopt.StepResult | None = None
        self._grad_norm = grad_norm

    param_groups = property(lambda self: self.distributed.param_groups)
    state = property(lambda self: self.distributed.state)
    defaults = property(lambda self: self.distributed.defaults)
    loss_scaler = property(lambda self: self.distributed.loss_scaler)

    def step(self, closure: Any = None) -> distopt.StepResult:  # type: ignore[override]
        """distopt's step, then a new step's grads; returns its ``StepResult``.

        Args:
            closure: must be None: the Trainer runs forward and backward before the step.
        """
        if closure is not None:
            raise ValueError("DistoptTrainer's optimizer takes no closure: the Trainer runs "
                             "forward and backward before the step")
        result = self.distributed.step()
        self.distributed.zero_grad()
        self.last_result = result
        norm = result.grad_norm
        self._grad_norm.fill_(float("nan") if norm is None else norm)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero distopt's grad buffers.

        Args:
            set_to_none: torch's choice for ``.grad``; the buffers stay allocated either way.
        """
        self.distributed.zero_grad()

    @property
    def step_was_skipped(self) -> bool:
        return self.last_result is not None and not self.last_result.updated

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, ``sharded_state_dict()``'s."""
        return self.distributed.sharded_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load distopt's optimizer state; collective.

        Args:
            state_dict: as for ``DistributedOptimizer.load_state_dict``: the whole state, or
                shards that cover this rank's pieces.
        """
        self.distributed.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused, as by distopt's optimizers: the param groups are fixed when it is built.

        Args:
            param_group: torch.optim's new group; unused.
        """
        self.distributed.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"TrainerOptimizer({self.distributed!r})"


class ScaledBackward(torch.autograd.Function):
    """The identity forward; backward multiplies the incoming grad by ``scale``."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


# ---------------------------------------------------------------------- arguments refused
