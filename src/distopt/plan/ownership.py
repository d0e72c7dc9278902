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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout.elementwise import TARGET_BUCKETS, BufferLayout, default_bucket_size
from ..layout.whole import BalanceReport, balance_report, build_mixed_layout
from ..memory import SHARDED, BytesPerParam, MemoryReport, bytes_per_param_breakdown
from ..optim.kinds import whole_tensor_cost

OptimizerClass = type[torch.optim.Optimizer]


def state_bytes(
    optimizer_cls: OptimizerClass | None, shape: Sequence[int], *, elementwise_bytes: float = 8
) -> float:
    """Bytes of state (step counters aside) that ``optimizer_cls`` keeps for one whole param of
    ``shape`` stepped in fp32: Muon its momentum, Adafactor the row and column statistics of a
    matrix (of every matrix of a stacked tensor) or the full second moment of a vector; an
    element-wise optimizer ``elementwise_bytes`` per element (8 for Adam's two moments, 4 for
    SGD's momentum). None (a param no group steps) keeps nothing."""
    numel = math.prod(shape)
    if optimizer_cls is None:
        return 0.0
    if issubclass(optimizer_cls, torch.optim.Muon):
        return 4.0 * numel
    if issubclass(optimizer_cls, torch.optim.Adafactor):
        if len(shape) < 2:
            return 4.0 * numel
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return 4.0 * (rows + cols)
    return elementwise_bytes * numel


def mean_state_bytes(
    params: Iterable[tuple[Sequence[int], OptimizerClass | None]], *, elementwise_bytes: float = 8
) -> float:
    """The model's optimizer state per parameter: every param's ``state_bytes`` over all its
    elements; ``params`` are (shape, optimizer class) pairs. See
    [Note: memory of whole-tensor ownership]."""
    total = numel = 0.0
    for shape, cls in params:
        total += state_bytes(cls, shape, elementwise_bytes=elementwise_bytes)
        numel += math.prod(shape)
    return total / numel if numel else 0.0


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """One of a model's flat buffers (one dtype): its layout and, per param in layout order,
    its shape and the class of the optimizer that steps it."""

    layout: BufferLayout
    shapes: tuple[tuple[int, ...], ...]
    classes: tuple[OptimizerClass | None, ...]
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
        per_element = sum(getattr(t, name) / (d if name in SHARDED else 1)
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
    elementwise_bytes: float,
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
            held["params"] += breakdown.params * layout.numel
            held["grads"] += breakdown.grads * layout.numel
            held["main_params"] += breakdown.main_params * shard
            held["main_grads"] += breakdown.main_grads * shard
            for piece in layout.shard_pieces(rank):
                index = piece.param_index
                cls, shape = buf.classes[index], buf.shapes[index]
                if layout.params[index].owner is not None:  # owned whole
                    held["optimizer_state"] += state_bytes(
                        cls, shape, elementwise_bytes=elementwise_bytes)
                else:
                    held["optimizer_state"] += state_bytes(
                        cls, (piece.param_range.size,), elementwise_bytes=elementwise_bytes)
    # The table: one buffer's dtypes (a model of several dtypes gets the first one's).
    first = buffers[0]
    table = bytes_per_param_breakdown(
        first.param_dtype, first.grad_dtype, store_param_remainders=store_param_remainders,
        optimizer_state_bytes=mean_state_bytes(
            ((shape, cls) for buf in buffers for shape, cls in zip(buf.shapes, buf.classes,
                                                                    strict=True)),
            elementwise_bytes=elementwise_bytes,
        ),
    )
    reports = tuple(
        MemoryReport(num_params=num_params, **{k: int(v) for k, v in held.items()})
        for held in ranks
    )
    return OwnershipPlan(dp_size=dp_size, num_params=num_params, padding=padding, table=table,
                         ranks=reports, buffers=tuple(buffers))


def _group_classes(
    param_groups: Sequence[dict[str, Any]], optimizer_cls: OptimizerClass,
) -> dict[nn.Parameter, OptimizerClass]:
    return {p: group.get("optimizer", optimizer_cls)
            for group in param_groups for p in group["params"]}


def classes_of(optimizer: Any) -> dict[nn.Parameter, OptimizerClass]:
    """The optimizer class that steps each model param of a distopt optimizer (the class its
    group names under "optimizer", or the optimizer's own)."""
    default_cls = type(optimizer.optimizer)
    return {
        p: group.get("optimizer", default_cls)
        for params, group in zip(optimizer.model_param_groups, optimizer.param_groups,
                                 strict=True)
        for p in params
    }


def plan_of(optimizer: Any, *, elementwise_bytes: float = 8) -> OwnershipPlan:
    """The plan of a ``distopt.DistributedOptimizer``'s own buffers, as its models laid them
    out; ``elementwise_bytes``: the state per element of its element-wise classes."""
    if not optimizer.sharded:
        raise ValueError("plan_of needs a DistributedOptimizer (sharded state); a "
                         "BasicOptimizer's ranks hold everything, as the table's replicated "
                         "column says")
    classes = classes_of(optimizer)
    buffers = []
    for model in optimizer.models:
        whole = model.whole_tensor_costs
        for buf in model.flat_buffers:
            buffers.append(BufferPlan(
                layout=buf.layout,
                shapes=tuple(tuple(p.shape) for p in buf.params),
                classes=tuple(classes.get(p) for p in buf.params),
                whole_costs=tuple(whole.get(p) for p in buf.params),
                param_dtype=buf.param_dtype,
                grad_dtype=buf.grad_dtype,
            ))
    # The layout's ranks: the shard group's, on a hierarchical mesh.
    return _plan(buffers, buffers[0].layout.dp_size,
                 store_param_remainders=optimizer.options.store_param_remainders,
                 elementwise_bytes=elementwise_bytes)


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
    elementwise_bytes: float = 8,
) -> OwnershipPlan:
    """The plan ``DistributedDataParallel(module, grad_dtype=..., bucket_size=...)`` and
    ``DistributedOptimizer(ddp, optimizer_cls, params=...)`` would give on ``dp_size`` ranks,
    without building either: the same layout arithmetic on the module's shapes (a module on
    the meta device will do). ``target_buckets``: the DDP's default bucket count, 4
    (``layout.TARGET_BUCKETS``) on NCCL, 2 on gloo (``layout.TARGET_BUCKETS_GLOO``)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": trainable}] if params is None else list(params)
    classes = _group_classes(groups, optimizer_cls)
    costs: dict[nn.Parameter, float] = {}
    for p, cls in classes.items():
        cost = whole_tensor_cost(cls)
        if cost is not None:
            costs[p] = cost(tuple(p.shape))
    total = sum(p.numel() for p in trainable)
    bucket_size = bucket_size or default_bucket_size(dp_size, total,
                                                     target_buckets=target_buckets)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in reversed(trainable):  # the DDP's order: reverse registration, one buffer a dtype
        by_dtype.setdefault(p.dtype, []).append(p)
    buffers = []
    for dtype, plist in by_dtype.items():
        numels = [p.numel() for p in plist]
        whole = [costs.get(p) for p in plist]
        # The DDP's buffer layout (ParamAndGradBuffer), element-wise where no cost is given.
        layout = build_mixed_layout(numels, whole, bucket_size=bucket_size, dp_size=dp_size)
        buffers.append(BufferPlan(
            layout=layout,
            shapes=tuple(tuple(p.shape) for p in plist),
            classes=tuple(classes.get(p) for p in plist),
            whole_costs=tuple(whole),
            param_dtype=dtype,
            grad_dtype=grad_dtype or dtype,
        ))
    return _plan(buffers, dp_size, store_param_remainders=store_param_remainders,
                 elementwise_bytes=elementwise_bytes)


__all__ = [
    "BufferPlan",
    "OwnershipPlan",
    "classes_of",
    "mean_state_bytes",
    "plan_of",
    "predict_plan",
    "state_bytes",
]
