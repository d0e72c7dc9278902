"""The one planner of a model's flat buffers: the DDP lays its buffers out with it, and every
prediction (``distopt memory``, ``plan.ownership.predict_plan``) calls it on the same inputs.

[Note: layout planned once]
A model's layout depends on its trainable params (their local shapes, which for a DTensor are
its shard's, and dtypes, in registration order), the grad dtype, the bucket size, the
data-parallel size, and which params an optimizer needs whole with the cost their owners
balance ([Note: whole-tensor layout] in layout/whole.py). Construction runs one way: the DDP
lays its buffers out when it is built, with the owners it is told
(``whole_tensor_params={param: torch.optim.Muon, ...}``) or element-wise; the optimizer, built
after it, derives the owners its param groups need and checks them against that layout. Where
they differ and the DDP was told nothing and has run no backward, the optimizer has it lay its
buffers out once more, for those owners (the params' values move into the new buffers; the old
ones are freed once nothing views them, so for a moment a rank holds two param buffers: pass
``whole_tensor_params`` to the DDP to skip it). Anything later is refused, naming the fix: a
layout is never changed once a backward ran, nor a second time. Nothing is laid out on a first
read or a first grad. Params are grouped into one buffer per dtype in reverse registration order
(about the order backward produces grads), and the buckets of all buffers are launched in one
order, that of the param that completes each bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .elementwise import TARGET_BUCKETS, BufferLayout, default_bucket_size
from .whole import build_mixed_layout


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the layout needs of one trainable param."""

    shape: tuple[int, ...]
    """Its local shape: a DTensor's shard on this rank, else the param's shape."""
    dtype: torch.dtype
    whole_cost: float | None = None
    """The cost its owner balances when one rank owns it whole; None: element-wise shards."""
    alone: bool = False
    """In a buffer of its own, so that its shards are the same in every model it is laid out
    in at this DP size (a param tied across pipeline stages; see [Note: tied stage params] in
    optim/tied.py)."""
    expert: bool = False
    """An expert's param: in a buffer of its own, sharded over the expert-data-parallel group
    (see [Note: expert parallelism] in parallel/experts.py)."""
    unit: int | None = None
    """Its gather unit under sharded params (-1: loose): no element-wise bucket holds params of
    two units (see [Note: gather units] in ddp/params/gather_units.py); None for every param:
    buckets cut by size alone."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class PlannedBuffer:
    """One flat buffer: the params of one dtype, in layout order, and their layout."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    param_indices: tuple[int, ...]
    """Positions in the planner's ``specs`` (registration order), in layout order."""
    layout: BufferLayout
    expert: bool = False
    """Whether it holds experts' params, laid out for the expert-data-parallel size."""


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Every buffer of a model and the order in which their buckets launch."""

    bucket_size: int
    buffers: tuple[PlannedBuffer, ...]
    launch_order: tuple[tuple[int, int], ...]
    """(buffer, bucket) pairs in launch order; see [Note: bucket launch order] in
    ddp/grads/grad_sync.py."""


def resolve_bucket_size(
    bucket_size: int | None, specs: Sequence[ParamSpec], dp_size: int,
    target_buckets: int = TARGET_BUCKETS,
) -> int:
    """The bucket size given, or the default for the model's local elements."""
    if bucket_size:
        return bucket_size
    total = sum(spec.numel for spec in specs)
    return default_bucket_size(dp_size, total, target_buckets=target_buckets)


def plan_model_layout(
    specs: Sequence[ParamSpec],
    *,
    grad_dtype: torch.dtype | None,
    bucket_size: int,
    dp_size: int,
    expert_dp_size: int | None = None,
) -> ModelLayout:
    """Lay a model's params out; see [Note: layout planned once]. ``grad_dtype`` None: each
    buffer's grads in its params' dtype. Experts' params (``ParamSpec.expert``) get buffers of
    their own, laid out for ``expert_dp_size`` ranks, and so does each param tied across
    pipeline stages (``ParamSpec.alone``)."""
    # (dtype, expert, the tied param's own index or -1) -> its params' indices
    by_dtype: dict[tuple[torch.dtype, bool, int], list[int]] = {}
    for index in reversed(range(len(specs))):  # reverse registration ~ the order backward runs
        spec = specs[index]
        key = (spec.dtype, spec.expert, index if spec.alone else -1)
        by_dtype.setdefault(key, []).append(index)
    buffers = []
    for (dtype, expert, _), indices in by_dtype.items():
        units = [specs[i].unit for i in indices]
        layout = build_mixed_layout(
            [specs[i].numel for i in indices],
            [specs[i].whole_cost for i in indices],
            units=None if all(u is None for u in units) else units,
            bucket_size=bucket_size,
            dp_size=(expert_dp_size or dp_size) if expert else dp_size,
        )
        buffers.append(PlannedBuffer(dtype, grad_dtype or dtype, tuple(indices), layout,
                                     expert))
    # One launch order over the buckets of all dtypes: by the backward position of the param
    # that completes each bucket (its last), then of its first.
    def backward_position(buffer: PlannedBuffer, layout_index: int) -> int:
        return len(specs) - 1 - buffer.param_indices[layout_index]

    keyed = []
    for b, buffer in enumerate(buffers):
        for k, bucket in enumerate(buffer.layout.buckets):
            first, last = bucket.param_indices[0], bucket.param_indices[-1]
            key = (backward_position(buffer, last), backward_position(buffer, first))
            keyed.append((key, (b, k)))
    launch_order = tuple(pair for _, pair in sorted(keyed))
    return ModelLayout(bucket_size=bucket_size, buffers=tuple(buffers),
                       launch_order=launch_order)
