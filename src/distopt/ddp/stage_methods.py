"""What distopt's ``PipelineStage`` calls on the DDP beyond ``no_sync``: the division of a
step's grads by its micro-batches, and the weight grads of a split backward.

See [Note: pipeline stages] in distopt/pipelining.py. A mixin of ``DistributedDataParallel``
(ddp/wrapper.py), kept apart so that the wrapper stays one concept.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .grads.grad_sync import GradSync


class PipelineStageMethods:
    """``divide_grads`` and ``assigned_grads`` of ``DistributedDataParallel``."""

    _grad_sync: GradSync
    _backward_seen: bool
    _unsharder: Any

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


    def scheduled(self, on: bool) -> None:
        """Whether a pipeline schedule's training step drives the forwards and backwards now:
        every rank of the stage runs the same schedule, so the forward check of sharded
        params runs at the step's first forward alone, not at every micro-batch's forward and
        backward (see "Pipeline stages" in [Note: every rank runs every forward]).

        Args:
            on: True as a schedule's training step starts (distopt's ``PipelineStage`` calls it
                from ``clear_runtime_states``), False after the step's last backward.
        """
        if self._unsharder is not None and self._unsharder.check is not None:
            self._unsharder.check.scheduled(on)


def guard_torch_pipeline_stages(ddp_class: type) -> None:
    """Have torch's own ``PipelineStage`` refuse a distopt DDP when it is built (idempotent).

    torch's stage knows torch's DDP and FSDP2 only: over distopt's DDP it would run a plain
    backward per micro-batch, each reducing the grads (the second refused) and dividing a
    ``p.grad`` that holds none. Its constructor only stores the module, and its first use of it
    comes after the stages have begun exchanging metadata, where one stage's error leaves the
    others waiting; so the check is added to torch's constructor, which every rank runs before
    any micro-batch. distopt's stage is a subclass that passes (``_distopt_stage``). Installed
    when a DDP is built for a pipeline (a "pp" mesh dimension) or torch's pipelining is
    imported already (importing it takes a second)."""
    from torch.distributed.pipelining import stage as torch_stage

    base = torch_stage._PipelineStageBase
    original = base.__init__
    if getattr(original, "_distopt_guard", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, submodule: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(submodule, ddp_class) and not getattr(self, "_distopt_stage", False):
            raise TypeError(
                "torch.distributed.pipelining.PipelineStage cannot drive a "
                "distopt.DistributedDataParallel: it would reduce the grads on every "
                "micro-batch and scale a p.grad that holds none. Use "
                "distopt.pipelining.PipelineStage(ddp, stage_index, num_stages, device), which "
                "takes torch's arguments and runs under torch's schedules"
            )
        original(self, submodule, *args, **kwargs)

    __init__._distopt_guard = True  # type: ignore[attr-defined]
    base.__init__ = __init__
