"""What distopt's ``PipelineStage`` calls on the DDP beyond ``no_sync``: the division of a
step's grads by its micro-batches, and the weight grads of a split backward.

See [Note: pipeline stages] in distopt/pipelining.py. A mixin of ``DistributedDataParallel``
(ddp/wrapper.py), kept apart so that the wrapper stays one concept.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .grad_sync import GradSync


class PipelineStageMethods:
    """``divide_grads`` and ``assigned_grads`` of ``DistributedDataParallel``."""

    _grad_sync: GradSync
    _backward_seen: bool

    def _check_live(self) -> None: ...

    def divide_grads(self, divisor: float) -> None:
        """Divide this step's grads by ``divisor`` (the number of micro-batches, for a loss
        that averages each micro-batch), applied to the reduced grads this rank holds once
        ``finish_grad_sync`` has waited for them (at once, if it has). Reductions in flight go
        on: dividing commutes with averaging. ``zero_grad_buffer`` forgets a pending divisor.
        distopt's ``PipelineStage`` calls it where torch's stage divides ``p.grad``."""
        self._check_live()
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not (
                math.isfinite(divisor) and divisor > 0):
            raise ValueError(f"divide_grads takes a positive finite number, got {divisor!r}")
        self._grad_sync.divide(float(divisor))

    @contextlib.contextmanager
    def assigned_grads(self) -> Iterator[None]:
        """A backward whose grads are assigned to ``p.grad`` rather than accumulated by
        autograd (the weight half of a split backward: ``torch.autograd.grad``, then ``p.grad
        = dw``): when the block ends they go into the buffers and count as one backward,
        reduced or not as ``no_sync`` says."""
        self._check_live()
        self._backward_seen = True
        with self._grad_sync.assigned_grads():
            yield
