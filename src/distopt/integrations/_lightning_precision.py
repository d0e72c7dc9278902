"""The precision plugin behind DistoptStrategy: Lightning's casts and autocast, distopt's step.

Lightning picks a precision plugin from ``Trainer(precision=...)``; DistoptStrategy wraps it in
``DistoptPrecision``, which keeps what the plugin does to the module and the forward (bf16
weights, autocast, input casts) and replaces what it does around the optimizer: distopt's step
takes no closure, fp16 loss scaling is distopt's ``DynamicLossScaler`` (the step unscales, checks
for inf on every rank and skips), and clipping by norm happens inside the step, over every shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from ..optim.loss_scalers import DynamicLossScaler

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")


def check_precision(plugin: Precision) -> None:
    """Raise unless ``plugin`` is one of Lightning's plain plugins for a supported precision."""
    known = {Precision: ("32-true",), MixedPrecision: ("bf16-mixed", "16-mixed"),
             HalfPrecision: ("bf16-true",)}
    if plugin.precision not in known.get(type(plugin), ()):
        raise ValueError(
            f"DistoptStrategy supports precision "
            f"{', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}; got "
            f"{type(plugin).__name__}(precision={plugin.precision!r}): pass one of those as "
            "Trainer(precision=...), or Trainer(plugins=[MixedPrecision('16-mixed', device)]) "
            "for fp16 autocast on a device Lightning would switch to bf16"
        )
    if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed":
        # Lightning's GradScaler would unscale grads that distopt keeps in its own buffers.
        plugin.scaler = None


class DistoptPrecision(Precision):
    """A Lightning precision plugin (``inner``) whose optimizer side is distopt's."""

    def __init__(self, inner: Precision) -> None:
        check_precision(inner)
        super().__init__()
        self.inner = inner
        self.precision = inner.precision
        # The distopt optimizer whose scale_loss the backward uses; DistoptStrategy sets it.
        self.optimizer: Any = None

    def loss_scaler(self) -> DynamicLossScaler | None:
        """A new loss scaler for the distopt optimizer: fp16 autocast needs one."""
        return DynamicLossScaler() if self.precision == "16-mixed" else None

    # -------------------------------------------------- the module and the forward: Lightning's

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.inner.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.inner.module_init_context()

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.inner.forward_context():
            yield

    # -------------------------------------------------- backward and step: distopt's

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)  # the on_before_backward hooks
        return tensor if self.optimizer is None else self.optimizer.scale_loss(tensor)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if kwargs:
            raise TypeError(
                f"distopt's step takes no arguments, got {sorted(kwargs)}: call optimizer.step() "
                "(or optimizer.step(closure)) with nothing else"
            )
        closure_result = closure()  # training_step, zero_grad and backward
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        if model.automatic_optimization and closure_result is None:
            return None  # training_step returned None: Lightning skips the step
        optimizer.step()
        return closure_result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: Any = "norm",
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) != "norm":
            raise ValueError(
                "distopt clips by the global grad norm only; clipping by value is not "
                "supported: use gradient_clip_algorithm='norm'"
            )
        if optimizer.options.clip_grad != clip_val:
            raise ValueError(
                f"distopt clips by norm inside its step, at the gradient_clip_val the optimizer "
                f"was built with ({optimizer.options.clip_grad}); clipping at {clip_val} here "
                "would need a second pass: set Trainer(gradient_clip_val=...) instead"
            )
        # Nothing to do now: the step clips every shard by the one global norm.

    def state_dict(self) -> dict[str, Any]:
        return {}  # the loss scaler's state is in distopt's checkpoint, with the optimizer's
