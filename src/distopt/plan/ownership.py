"""What whole-tensor ownership costs a model on each data-parallel rank: the optimizer's work
(the balance of layout/whole.py) and the bytes each rank holds, against the memory table.

[Note: memory of whole-tensor ownership]
The table of docs/design.md counts the bytes per parameter a rank holds when it owns 1/d of
every element and the optimizer keeps a fixed state per element. Whole-tensor optimizers
change both:

* The state is not a fixed number of bytes per element: Muon keeps one fp32 momentum (4 B per
  element) where AdamW keeps two moments (8 B), and Adafactor keeps a row and a column
  statistic of each matrix (4 B per row and per column) and a full one of each vector. The
  table's ``optimizer_state`` becomes the model's mean: every param's state over every
  element (``state_bytes``, ``mean_state_bytes``).
* A rank owns whole params, so its state depends on which. Everything else does not: the
  param and grad buffers hold every element and all padding on every rank, and the fp32 main
  params and main grads (when params or grads are not fp32) hold the rank's shard of every
  bucket, padding included.

With N parameters, P padding elements in all and S_r bytes of state for what rank r owns
(S = the sum over ranks, each element's state once), rank r holds

    (params + grads) (N + P) + (main params + main grads) (N + P) / d + S_r
        = table(d) N  +  (params + grads + (main params + main grads) / d) P  +  (S_r - S / d)

the table, the padding, and the state of what the rank owns beyond an even share. The last
term sums to zero over the ranks, so the mean rank holds exactly the table plus the padding;
with element-wise sharding alone it is only the padding's own unevenness (the last rank's
shard holds a bucket's padding). ``plan_of`` computes every term from an optimizer's buffers,
``predict_plan`` from a module before any process group exists, by the same layout arithmetic
the DDP runs; tests/test_balance.py checks both against ``measure_state_bytes`` to the byte.
The state is counted once every param has been stepped (torch creates it lazily).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout.balance import BalanceReport, balance_report
from ..layout.elementwise import TARGET_BUCKETS, BufferLayout
from ..layout.model_layout import ParamSpec, plan_model_layout, resolve_bucket_size
from ..memory import BytesPerParam, MemoryReport, bytes_per_param_breakdown
from ..optim.block_scaling import DEFAULT_BLOCK_SIZE
from ..optim.kinds import StateDtypes, check_optimizer_cls, state_bytes
from ..optim.param_groups import group_class, whole_tensor_costs
from ..optim.state_precision import resolve_block_size, resolve_state_dtypes
from ..options import StateDtype
from ..parallel.dtensor import local_tensor

OptimizerClass = type[torch.optim.Optimizer]
Stepper = tuple[OptimizerClass, Mapping[str, Any]]
"""What steps a param: an optimizer class and its group's options."""


def mean_state_bytes(params: Iterable[tuple[Sequence[int], Stepper | None]],
                     state_dtypes: StateDtypes | None = None,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """The model's optimizer state per parameter: every param's ``state_bytes`` over all its
    elements; ``params`` are (shape, (optimizer class, group options)) pairs, the state keys
    in their ``state_dtypes`` (fp32 when absent). See [Note: memory of whole-tensor
    ownership]."""
    total = numel = 0.0
    for shape, stepper in params:
        if stepper is not None:
            total += state_bytes(stepper[0], shape, stepper[1], state_dtypes, block_size)
        numel += math.prod(shape)
    return total / numel if numel else 0.0


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """One of a model's flat buffers (one dtype): its layout and, per param in layout order,
    its shape and the class of the optimizer that steps it."""

    layout: BufferLayout
    shapes: tuple[tuple[int, ...], ...]
    steppers: tuple[Stepper | None, ...]
    """The optimizer class and group options that step each param (None: no group)."""
    whole_costs: tuple[float | None, ...]
    param_dtype: torch.dtype
    grad_dtype: torch.dtype

    def balance(self) -> BalanceReport | None:
        """The balance of its whole-tensor params, or None if it has none."""
        if all(cost is None for cost in self.whole_costs):
            return None
        return balance_report(self.layout, self.whole_costs)


@dataclass(frozen=True, slots=True)
class OwnershipPlan:
    """The bytes each data-parallel rank holds for a model and its optimizer, beside the table
    and the padding, and the balance of its whole-tensor params; see
    [Note: memory of whole-tensor ownership]."""

    dp_size: int
    num_params: int
    padding: int
    """Padding elements of all buffers (each rank's buffers hold all of it)."""
    table: BytesPerParam
    """The memory table, with the model's mean optimizer state."""
    ranks: tuple[MemoryReport, ...]
    """What each rank holds, by component."""
    buffers: tuple[BufferPlan, ...]

    @property
    def table_bytes_per_param(self) -> float:
        return self.table.total(self.dp_size)

    @property
    def padding_bytes_per_param(self) -> float:
        """What the padding costs every rank on average, per parameter."""
        t, d = self.table, self.dp_size
        per_element = sum(getattr(t, name) / (d if name in t.sharded else 1)
                          for name in ("params", "grads", "main_params", "main_grads"))
        return per_element * self.padding / self.num_params

    def ownership_bytes_per_param(self, rank: int) -> float:
        """The state of what ``rank`` owns beyond an even share, per parameter (sums to zero
        over the ranks)."""
        # The rest of a rank's bytes are the same on every rank (the buffers, and its shard
        # of each bucket): only the state differs, here against its mean, exactly.
        states = [report.optimizer_state for report in self.ranks]
        return (self.ranks[rank].optimizer_state - sum(states) / self.dp_size) / self.num_params

    def balance(self) -> list[BalanceReport]:
        """The balance report of each buffer with whole-tensor params."""
        return [b for b in (buf.balance() for buf in self.buffers) if b is not None]

    def format(self) -> str:
        """The bytes per parameter of each rank as the sum of its three terms."""
        lines = [f"{'rank':>4} {'table':>9} {'+ padding':>10} {'+ owned - 1/d':>14}"
                 f" {'= B/param':>10} {'bytes held':>14}"]
        for rank, report in enumerate(self.ranks):
            lines.append(
                f"{rank:>4} {self.table_bytes_per_param:>9.4f}"
                f" {self.padding_bytes_per_param:>10.4f}"
                f" {self.ownership_bytes_per_param(rank):>+14.4f}"
                f" {report.bytes_per_param:>10.4f} {report.total:>14,d}"
            )
        return "\n".join(lines)


def _plan(
    buffers: list[BufferPlan],
    dp_size: int,
    *,
    store_param_remainders: bool,
    state_dtypes: StateDtypes | None = None,
    shard_grads: bool = False,
    shard_params: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> OwnershipPlan:
    num_params = sum(math.prod(shape) for buf in buffers for shape in buf.shapes)
    padding = sum(buf.layout.numel for buf in buffers) - num_params
    totals = dict.fromkeys(("params", "grads", "main_params", "main_grads"), 0)
    ranks: list[dict[str, float]] = [
        {"optimizer_state": 0.0, **totals} for _ in range(dp_size)
    ]
    for buf in buffers:
        layout = buf.layout
        # Every rank's shard of every bucket, padding included: what its fp32 copies hold.
        shard = sum(bucket.shard_size for bucket in layout.buckets)
        breakdown = bytes_per_param_breakdown(
            buf.param_dtype, buf.grad_dtype, store_param_remainders=store_param_remainders
        )
        for rank in range(dp_size):
            held = ranks[rank]
            # Sharded params: only this rank's shard of each bucket between uses.
            held["params"] += breakdown.params * (shard if shard_params else layout.numel)
            # Sharded grads: only this rank's reduced shard of each bucket is kept.
            held["grads"] += breakdown.grads * (
                shard if shard_grads or shard_params else layout.numel)
            held["main_params"] += breakdown.main_params * shard
            held["main_grads"] += breakdown.main_grads * shard
            for piece in layout.shard_pieces(rank):
                index = piece.param_index
                stepper = buf.steppers[index]
                if stepper is None:
                    continue
                whole = layout.params[index].owner is not None
                shape = buf.shapes[index] if whole else (piece.param_range.size,)
                held["optimizer_state"] += state_bytes(stepper[0], shape, stepper[1],
                                                       state_dtypes, block_size)
    # The table: one buffer's dtypes (a model of several dtypes gets the first one's).
    first = buffers[0]
    table = bytes_per_param_breakdown(
        first.param_dtype, first.grad_dtype, store_param_remainders=store_param_remainders,
        shard_grads=shard_grads, shard_params=shard_params,
        optimizer_state_bytes=mean_state_bytes(
            ((shape, stepper) for buf in buffers
             for shape, stepper in zip(buf.shapes, buf.steppers, strict=True)),
            state_dtypes, block_size),
    )

    reports = tuple(
        MemoryReport(num_params=num_params, **{k: int(v) for k, v in held.items()})
        for held in ranks
    )
    return OwnershipPlan(dp_size=dp_size, num_params=num_params, padding=padding, table=table,
                         ranks=reports, buffers=tuple(buffers))


def steppers_of(optimizer: Any) -> dict[nn.Parameter, Stepper]:
    """The optimizer class and group options that step each model param of a distopt
    optimizer (the groups hold every option, torch having filled in the defaults)."""
    default_cls = type(optimizer.optimizer)
    return {
        p: (group_class(group, default_cls), group)
        for params, group in zip(optimizer.model_param_groups, optimizer.param_groups,
                                 strict=True)
        for p in params
    }


def plan_of(optimizer: Any) -> OwnershipPlan:
    """The plan of a ``distopt.DistributedOptimizer``'s own buffers, as its models laid them
    out."""
    if not optimizer.sharded:
        raise ValueError("plan_of needs a DistributedOptimizer (sharded state); a "
                         "BasicOptimizer's ranks hold everything, as the table's replicated "
                         "column says")
    steppers = steppers_of(optimizer)
    buffers = []
    for model in optimizer.models:
        whole = model.whole_tensor_costs
        for buf in model.flat_buffers:
            buffers.append(BufferPlan(
                layout=buf.layout,
                shapes=tuple(tuple(local_tensor(p).shape) for p in buf.params),
                steppers=tuple(steppers.get(p) for p in buf.params),
                whole_costs=tuple(whole.get(p) for p in buf.params),
                param_dtype=buf.param_dtype,
                grad_dtype=buf.grad_dtype,
            ))
    # The layout's ranks: the shard group's, on a hierarchical mesh.
    return _plan(buffers, buffers[0].layout.dp_size,
                 store_param_remainders=optimizer.options.store_param_remainders,
                 state_dtypes=optimizer.state_precision.dtypes,
                 block_size=optimizer.state_precision.block_size,
                 shard_grads=any(model.options.shard_grads for model in optimizer.models),
                 shard_params=any(model.options.shard_params for model in optimizer.models))


def predict_plan(
    module: nn.Module,
    optimizer_cls: OptimizerClass,
    params: Sequence[dict[str, Any]] | None = None,
    *,
    dp_size: int,
    grad_dtype: torch.dtype | None = torch.float32,
    bucket_size: int | None = None,
    target_buckets: int = TARGET_BUCKETS,
    store_param_remainders: bool = False,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    state_dtype: StateDtype = None,
    shard_grads: bool = False,
    state_block_size: int | None = None,
    shard_params: bool = False,
) -> OwnershipPlan:
    """The plan ``DistributedDataParallel(module, grad_dtype=..., bucket_size=...,
    shard_grads=..., shard_params=...)`` and
    ``DistributedOptimizer(ddp, optimizer_cls, params=..., **optimizer_kwargs)`` would give on
    ``dp_size`` ranks, without building either: the DDP's own planner on the module's local
    shapes (a module on the meta device will do). ``target_buckets``: the DDP's default
    bucket count, 4 (``TARGET_BUCKETS``) on NCCL, 2 on gloo (``TARGET_BUCKETS_GLOO``)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": trainable}] if params is None else list(params)
    classes = [group_class(g, optimizer_cls) for g in groups]
    check_optimizer_cls(optimizer_cls)
    names = {p: n for n, p in module.named_parameters()}
    # The same owners and costs the optimizer asks the DDP for, with the same checks.
    costs = whole_tensor_costs(groups, classes, names)
    steppers: dict[nn.Parameter, Stepper] = {}
    for group, cls in zip(groups, classes, strict=True):
        given = dict(optimizer_kwargs or {}) if cls is optimizer_cls else {}
        options = {**given, **{k: v for k, v in group.items() if k != "params"}}
        for p in group["params"]:
            steppers[p] = (cls, options)
    specs = []
    for p in trainable:
        specs.append(ParamSpec(tuple(local_tensor(p).shape), p.dtype, costs.get(p)))
    bucket_size = resolve_bucket_size(bucket_size, specs, dp_size, target_buckets)
    planned = plan_model_layout(specs, grad_dtype=grad_dtype, bucket_size=bucket_size,
                                dp_size=dp_size)
    buffers = []
    for buf in planned.buffers:
        plist = [trainable[i] for i in buf.param_indices]
        buffers.append(BufferPlan(
            layout=buf.layout,
            shapes=tuple(tuple(local_tensor(p).shape) for p in plist),
            steppers=tuple(steppers.get(p) for p in plist),
            whole_costs=tuple(specs[i].whole_cost for i in buf.param_indices),
            param_dtype=buf.param_dtype,
            grad_dtype=buf.grad_dtype,
        ))
    state_dtypes = resolve_state_dtypes(state_dtype, classes)
    return _plan(buffers, dp_size, store_param_remainders=store_param_remainders,
                 state_dtypes=state_dtypes,
                 block_size=resolve_block_size(state_block_size, state_dtypes),
                 shard_grads=shard_grads, shard_params=shard_params)


__all__ = [
    "BufferPlan",
    "OwnershipPlan",
    "steppers_of",
    "mean_state_bytes",
    "plan_of",
    "predict_plan",
    "state_bytes",
]
