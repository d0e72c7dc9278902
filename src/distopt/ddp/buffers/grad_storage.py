"""Where a bucket's grads live: the one place a bucket's behaviour depends on the sharding.

``FullGrads`` keeps every grad of the bucket in the model's grad buffer for the whole step
(nothing sharded, or optimizer state only): ``grad_data`` is a fixed view, each reduction writes
this rank's shard of it (or all of it, all-reduced), and nothing happens around the reduction.

``ShardedGrads`` (grads sharded too) keeps only ``grad_shard``, this rank's reduced shard, between
steps; the full grads live in a buffer borrowed from the ``GradPool`` from the bucket's first
grad of a backward until its reduction is waited for. See [Note: sharded grads] in
ddp/buffers/grad_pool.py for the whole life of those buffers; this module is its code on the
bucket's side: take a buffer, zero what a reused buffer holds stale, reduce into the kept shard or
add to it, give the buffer back.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ...layout.elementwise import Range
from ...parallel.dtensor import local_tensor
from .grad_pool import GradPool


class Bucket(Protocol):
    """What a storage reads of its bucket (ddp/buffers/bucket.py)."""

    owned_range: Range
    replicate_group: Any
    replica_due: bool

    def wait_reduction(self) -> None: ...

    def forget_written(self) -> None: ...


class FullGrads:
    """Every grad of the bucket in the model's grad buffer, all step long."""

    copy_next = True  # each reduction is the step's only one: it writes the shard
    unreplicated = False  # a reduction always runs its second stage with it

    def __init__(self, grad_data: torch.Tensor, grad_shard: torch.Tensor) -> None:
        self.grad_data: torch.Tensor | None = grad_data  # [bucket numel]
        self.grad_shard = grad_shard  # [bucket numel / d], a view of grad_data
        # A reduce-scattered bucket that takes another backward's grads: its reduced shard,
        # added back once the next reduction is in ([Note: several backwards per step]).
        self._reduced: torch.Tensor | None = None

    def begin_grads(self, bucket: Bucket) -> None:
        """Before the bucket's first grad of a backward: nothing to prepare."""

    def reopen(self, bucket: Any) -> None:
        """A reduced bucket gets grads again: keep what this rank holds reduced, and have the
        next grads overwrite the buffer (the other ranks' chunks hold local grads)."""
        if not bucket.reduce_scatter:
            return  # all-reduced: the buffer holds the average, the new grads add to it
        shard = self.grad_shard
        self._reduced = shard.clone() if self._reduced is None else self._reduced.add_(shard)
        bucket.forget_written()

    def prepare_launch(self, bucket: Bucket) -> None:
        """Before the reduction: the buffer already holds every grad."""

    def reduction_output(self, bucket: Bucket) -> torch.Tensor:
        return self.grad_shard

    def launched(self, bucket: Bucket) -> None:
        """Nothing to free when it is waited for."""

    def first_stage_done(self, bucket: Bucket) -> None:
        """The result is in place; an earlier backward's reduced grads are added to it."""
        if self._reduced is not None:
            self.grad_shard.add_(self._reduced)
            self._reduced = None

    def replica_started(self) -> None:
        """Nothing to note."""

    def forget(self, bucket: Bucket) -> None:
        """A new step: the next grads overwrite the buffer ([Note: grads written, not zeroed])."""
        self._reduced = None

    @property
    def holds_buffer(self) -> bool:
        return True


class ShardedGrads:
    """The kept shard of the bucket's reduced grads, and a pool buffer while it is reduced."""

    def __init__(self, grad_shard: torch.Tensor, pool: GradPool, bucket_numel: int,
                 params: list[nn.Parameter], param_ranges: list[Range]) -> None:
        self.grad_shard = grad_shard  # [bucket numel / d], kept between steps
        self.pool = pool
        self.numel = bucket_numel
        self.grad_data: torch.Tensor | None = None  # a view of the pool buffer, while held
        self._buffer: torch.Tensor | None = None
        self._slots = [(p, r, local_tensor(p).shape) for p, r in zip(params, param_ranges,
                                                                     strict=True)]
        # Bucket ranges no param covers (the padding): a reused buffer holds stale values there.
        self._gaps = _gaps(param_ranges, bucket_numel)
        self.copy_next = True  # the step's next reduction replaces grad_shard instead of adding
        self._into_kept = False  # the reduction in flight writes grad_shard itself
        self.unreplicated = False  # grad_shard got a reduction that no second stage followed

    @property
    def holds_buffer(self) -> bool:
        return self.grad_data is not None

    def begin_grads(self, bucket: Bucket) -> None:
        if self.grad_data is None:
            self._take(bucket)

    def reopen(self, bucket: Bucket) -> None:
        """A reduced bucket gets grads again: they go to a fresh buffer, whose reduction adds
        into the kept shard (every backward's does)."""

    def _take(self, bucket: Bucket) -> None:
        self._buffer = self.pool.acquire()
        self.grad_data = self._buffer[: self.numel]
        bucket.forget_written()  # see [Note: grads written, not zeroed]
        for param, slot, shape in self._slots:
            param.main_grad = self.grad_data[slot.start : slot.end].view(shape)

    def give_back(self) -> None:
        if self.grad_data is None:
            return
        for param, _, _ in self._slots:
            param.main_grad = None
        self.pool.give_back(self._buffer)
        self.grad_data = self._buffer = None

    def prepare_launch(self, bucket: Bucket) -> None:
        bucket.wait_reduction()  # an earlier backward's, still adding into grad_shard
        if self.grad_data is None:  # no grad this backward: it reduces zeros
            self._take(bucket)
        for gap in self._gaps:
            self.grad_data[gap.start : gap.end].zero_()

    def reduction_output(self, bucket: Bucket) -> torch.Tensor:
        # A step's first reduction writes the kept shard directly; later ones are added to it.
        self._into_kept, self.copy_next = self.copy_next, False
        shard = bucket.owned_range
        return self.grad_shard if self._into_kept else self.grad_data[shard.start : shard.end]

    def launched(self, bucket: Bucket) -> None:
        self.pool.launched(bucket)

    def first_stage_done(self, bucket: Bucket) -> None:
        if not self._into_kept:
            shard = bucket.owned_range
            self.grad_shard.add_(self.grad_data[shard.start : shard.end])
        if bucket.replicate_group is not None and not bucket.replica_due:
            self.unreplicated = True
        self.give_back()

    def replica_started(self) -> None:
        self.unreplicated = False

    def forget(self, bucket: Bucket) -> None:
        self.give_back()  # a backward that raised before its bucket was launched
        self.copy_next = True
        self.unreplicated = False


def _gaps(ranges: list[Range], size: int) -> list[Range]:
    """The parts of ``[0, size)`` that none of ``ranges`` covers."""
    gaps, end = [], 0
    for rng in sorted(ranges, key=lambda r: r.start):
        if rng.start > end:
            gaps.append(Range(end, rng.start))
        end = max(end, rng.end)
    if end < size:
        gaps.append(Range(end, size))
    return gaps
