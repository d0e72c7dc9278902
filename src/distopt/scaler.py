"""Loss scalers for fp16 training.

``scale_loss`` multiplies the loss by ``scale`` before backward; the optimizer divides the fp32
main grads by it, checks them for inf/nan, agrees with every rank on the verdict, and calls
``update(found_inf)`` once per step.

DynamicLossScaler's rules (the same as Megatron-LM's dynamic grad scaler):

* A step whose grads hold an inf or nan on any rank is skipped. It resets the count of good
  steps and spends one unit of hysteresis; when the hysteresis is used up (it reaches 0) the
  scale is multiplied by ``backoff_factor``, never going below ``min_scale``. With the default
  ``hysteresis=2`` the first overflow after a growth does not back off; every overflow after
  it does, until the scale grows again.
* A good step adds one to the count of good steps. When the count reaches
  ``growth_interval`` the scale is multiplied by ``growth_factor``, the count restarts at 0
  and the hysteresis is refilled to ``hysteresis``.
"""

from __future__ import annotations

from typing import Any


class ConstantLossScaler:
    """A fixed loss scale; overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is skipped all the same)."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """A loss scale that backs off on overflow and grows after a run of good steps."""

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        if not initial_scale > 0 or not min_scale > 0:
            raise ValueError("initial_scale and min_scale must be positive")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("growth_interval and hysteresis must be >= 1")
        self.scale = float(initial_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


LossScaler = ConstantLossScaler | DynamicLossScaler
