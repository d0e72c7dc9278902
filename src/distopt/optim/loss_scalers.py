"""Loss scalers for fp16 training.

``opt.scale_loss(loss)`` multiplies the loss by ``scale`` before backward. In ``step()`` the
optimizer multiplies the fp32 main grads of its shard by ``1 / scale``, checks them for inf and
nan, takes the maximum of that verdict over the data-parallel group (and the model-parallel
group, if any) so that every rank decides alike, and calls ``update(found_inf)`` once. A step
with ``found_inf`` is skipped on every rank: no param, optimizer state or step count changes.

DynamicLossScaler keeps three numbers: ``scale``, ``growth_tracker`` (good steps since the last
overflow or growth) and ``hysteresis_tracker`` (overflows still tolerated before backing off).
It starts at ``initial_scale``, 0 and ``hysteresis``; ``update`` does exactly this::

    if found_inf:
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_tracker = hysteresis
            scale = scale * growth_factor

So an overflow always restarts the count towards growth, the hysteresis is refilled only when
the scale grows (good steps alone do not refill it), and once it is spent every overflow backs
off until the next growth. With the defaults the first overflow after the start or after a
growth keeps the scale, the second halves it. These are the rules of Megatron-LM's dynamic grad
scaler; torch.amp.GradScaler is the case ``hysteresis=1`` without ``min_scale``.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


class ConstantLossScaler:
    """A fixed loss scale; overflowing steps are still skipped, on every rank.

    Args:
        scale: what ``opt.scale_loss(loss)`` multiplies the loss by, and the step divides the
            grads by; a positive, finite number (a power of two keeps both exact).
    """

    def __init__(self, scale: float) -> None:
        self.scale = _positive_float("scale", scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is skipped all the same).

        Args:
            found_inf: whether some rank's grads held an inf or nan this step; unused.
        """

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the scale back from a checkpoint.

        Args:
            state: a dict of ``state_dict()``'s format, ``{"scale": ...}``.
        """
        self.scale = float(state["scale"])

    def __repr__(self) -> str:
        return f"ConstantLossScaler(scale={self.scale})"


class DynamicLossScaler:
    """A loss scale that backs off on overflow and grows after a run of good steps.

    See the module docstring for the exact rules. ``scale`` is the current scale.

    Args:
        initial_scale: the scale of the first step; positive and finite, at least
            ``min_scale``. The default, 2**16, is torch.amp.GradScaler's; the first overflows
            bring it down to what the model's grads allow.
        growth_factor: what the scale is multiplied by after ``growth_interval`` good steps in
            a row; above 1.
        backoff_factor: what the scale is multiplied by on an overflow once the hysteresis is
            spent; in (0, 1).
        growth_interval: good steps in a row (no inf or nan on any rank) before the scale
            grows; at least 1.
        hysteresis: overflows tolerated, after the start or after a growth, before the scale
            backs off; at least 1 (1: every overflow backs off, as torch.amp.GradScaler's).
        min_scale: the scale never backs off below it, so that a run of overflows cannot
            drive it to zero; positive, at most ``initial_scale``.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        initial_scale = _positive_float("initial_scale", initial_scale)
        min_scale = _positive_float("min_scale", min_scale)
        growth_factor = _positive_float("growth_factor", growth_factor)
        backoff_factor = _positive_float("backoff_factor", backoff_factor)
        if min_scale > initial_scale:
            raise ValueError(
                f"min_scale ({min_scale}) is above initial_scale ({initial_scale}); lower "
                "min_scale or raise initial_scale"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        self.scale = initial_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = _positive_int("growth_interval", growth_interval)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_scale = min_scale
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Apply one step's verdict (the same on every rank) to the scale.

        Args:
            found_inf: whether some rank's grads held an inf or nan this step, agreed over the
                ranks; the optimizer's ``step()`` passes it once per step.
        """
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
        """Take the scale and its two counters back from a checkpoint; the options
        (``growth_factor``, ...) stay the constructor's.

        Args:
            state: a dict of ``state_dict()``'s format: ``scale``, ``growth_tracker`` and
                ``hysteresis_tracker``.
        """
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, "
            f"hysteresis_tracker={self.hysteresis_tracker})"
        )


LossScaler = ConstantLossScaler | DynamicLossScaler
