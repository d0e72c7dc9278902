"""One model on every rank: what ``DistributedDataParallel`` checks before its first collective.

[Note: one model on every rank]
Every bucket collective assumes that the ranks of a group lay out the same params in the same
buckets. A model built differently on one rank (a config read differently, a layer frozen or
tied on one rank only, another ``bucket_size``) breaks that silently: a size mismatch aborts
gloo or hangs NCCL at the first step, and a mismatch that keeps the element count (a transposed
weight, two params swapped, another tie) trains on mixed-up numbers. So the DDP wrapper, before
its first broadcast, compares what every rank is about to communicate:

* every param and buffer, in registration order: name, global shape, dtype, ``requires_grad``,
  the name it is tied to (the same tensor registered twice), DTensor placements and this rank's
  local shape;
* the DDP options that change which collectives run (grad dtype, reduce-scatter or all-reduce,
  unused-param tracking, the nan check, fp32 accumulation, sharded grads and params, the
  broadcast of module buffers before each forward);
* the bucket layout it plans: every buffer's buckets, their element ranges and params;
* with experts, the expert mesh's sizes and which params are experts' (whose buffers the
  layout plans for the expert-data-parallel size; see [Note: expert parallelism] in
  parallel/experts.py).

``describe_model`` and ``first_difference`` are the pure part (they use no
torch.distributed; the layout comes from the DDP's own planner, layout/model_layout.py). The
collective part sends one 32-byte digest per rank per group (one all-gather); only when the
digests differ does it exchange the descriptions, to name the first differing param, its value
on each side and the ranks. It compares within the shard group and the replicate group
(the whole description) and within each tensor-parallel group (``global_view``: the local
shapes and the layout legitimately differ across TP ranks). With several groups, a verdict
found in one is spread over all of them (one small all-reduce per group, plus the message
itself when there is one), so that every rank raises the same ``ValueError`` and none is left
waiting in the broadcast that follows. The layout compared is the element-wise one; a
``DistributedOptimizer`` over whole-tensor optimizers has the buffers laid out for their owners
([Note: layout planned once]), deterministically from the (now checked) params and its param
groups, which must be the same on every rank too: the optimizer compares them ([Note: one
optimizer on every rank] in cross_rank/optimizer.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import collectives as comm
from ..layout.elementwise import BufferLayout
from ..layout.model_layout import ParamSpec, plan_model_layout
from ..options import GradSyncOptions
from ..parallel.dtensor import is_dtensor, local_tensor
from ..parallel.experts import ExpertParams
from ..parallel.process_groups import ParallelGroups
from .agree import compared_groups, raise_unless_same

_FIX = (
    "build the same model on every rank (the same config, the same frozen params and ties) and "
    "pass the same DistributedDataParallel arguments everywhere"
)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One registered param or buffer, as this rank sees it."""

    kind: str  # "parameter" or "buffer"
    name: str
    shape: tuple[int, ...]  # global (a DTensor's full shape)
    dtype: str
    requires_grad: bool
    tied_to: str | None  # the first name of the same tensor, when registered twice
    placements: str | None  # a DTensor's placements; None for a plain tensor
    local_shape: tuple[int, ...]  # this rank's shard

    def global_view(self) -> TensorEntry:
        return TensorEntry(self.kind, self.name, self.shape, self.dtype, self.requires_grad,
                           self.tied_to, self.placements, ())


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """One planned bucket: its elements in its buffer and the params it holds."""

    start: int
    end: int
    params: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BufferEntry:
    """One planned buffer (one param dtype): its grad dtype and its buckets."""

    param_dtype: str
    grad_dtype: str
    numel: int
    buckets: tuple[BucketEntry, ...]


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What a rank is about to communicate; equal on every rank of a group, or an error."""

    tensors: tuple[TensorEntry, ...]
    options: tuple[tuple[str, str], ...]
    buffers: tuple[BufferEntry, ...]
    bucket_size: int = field(compare=False)  # named in messages; the layout is what counts

    def global_view(self) -> ModelDescription:
        """What the ranks of a tensor-parallel group share: no local shapes, no layout."""
        return ModelDescription(tuple(t.global_view() for t in self.tensors), self.options,
                                (), self.bucket_size)

    def digest(self) -> bytes:
        """32 bytes that differ (but for a sha256 collision) when the descriptions do."""
        text = repr((self.tensors, self.options, self.buffers))
        return hashlib.sha256(text.encode()).digest()


# ---------------------------------------------------------------------- describing (pure)


def _element_wise_buffers(
    params: Sequence[nn.Parameter], grad_dtype: torch.dtype | None, *, bucket_size: int,
    dp_size: int, experts: ExpertParams | None = None,
    units: Mapping[nn.Parameter, int] | None = None,
) -> list[tuple[torch.dtype, torch.dtype, tuple[int, ...], BufferLayout]]:
    """The DDP's own planner on ``params`` (trainable, registration order) with no owners of
    whole tensors: per buffer its dtypes, the indices into ``params`` and the layout."""
    expert = frozenset() if experts is None else experts.params
    specs = [ParamSpec(tuple(local_tensor(p).shape), p.dtype, expert=p in expert,
                       unit=None if units is None else units.get(p, -1))
             for p in params]
    planned = plan_model_layout(
        specs, grad_dtype=grad_dtype, bucket_size=bucket_size, dp_size=dp_size,
        expert_dp_size=None if experts is None else experts.parallel.expert_dp_size)
    return [(b.param_dtype, b.grad_dtype, b.param_indices, b.layout) for b in planned.buffers]


def describe_model(
    module: nn.Module,
    trainable: Sequence[tuple[str, nn.Parameter]],
    options: GradSyncOptions,
    *,
    bucket_size: int,
    dp_size: int,
    experts: ExpertParams | None = None,
    units: Mapping[nn.Parameter, int] | None = None,
) -> ModelDescription:
    """This rank's description of ``module`` wrapped with ``options``; ``trainable`` are the
    (name, param) pairs the DDP lays out, in registration order; ``experts``: which of them
    are experts' and their mesh."""
    tensors = []
    for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        first_name: dict[int, str] = {}
        for name, tensor in named:
            tied_to = first_name.setdefault(id(tensor), name)
            tensors.append(TensorEntry(
                kind=kind,
                name=name,
                shape=tuple(tensor.shape),
                dtype=str(tensor.dtype),
                requires_grad=tensor.requires_grad,
                tied_to=None if tied_to == name else tied_to,
                placements=str(tuple(tensor.placements)) if is_dtensor(tensor) else None,
                local_shape=tuple(local_tensor(tensor).shape),
            ))
    names = [name for name, _ in trainable]
    buffers = tuple(
        BufferEntry(
            param_dtype=str(dtype),
            grad_dtype=str(grad_dtype),
            numel=layout.numel,
            buckets=tuple(
                BucketEntry(b.buffer_range.start, b.buffer_range.end,
                           tuple(names[indices[i]] for i in b.param_indices))
                for b in layout.buckets
            ),
        )
        for dtype, grad_dtype, indices, layout in _element_wise_buffers(
            [p for _, p in trainable], options.grad_dtype, bucket_size=bucket_size,
            dp_size=dp_size, experts=experts, units=units,
        )
    )
    compared = ("grad_dtype", "use_distributed_optimizer", "find_unused_parameters",
                "check_for_nan_in_grad", "reduce_scatter_with_fp32_accumulation", "shard_grads",
                "shard_params", "reshard_after_forward", "broadcast_buffers")
    described = [(name, str(getattr(options, name))) for name in compared]
    expert_names = [] if experts is None else [n for n, p in trainable if p in experts.params]
    described.append(("experts", "None" if experts is None else
                      f"{experts.parallel.describe()} params={expert_names}"))
    return ModelDescription(
        tensors=tuple(tensors),
        options=tuple(described),
        buffers=buffers,
        bucket_size=bucket_size,
    )


# ---------------------------------------------------------------------- comparing (pure)


def first_difference(
    descriptions: Sequence[ModelDescription], ranks: Sequence[int], group: str
) -> str | None:
    """The error for a group whose ranks (``ranks[i]`` described ``descriptions[i]``) do not
    all describe the same model, naming the first difference from the group's first rank;
    None when they all agree. ``group`` names the group in the message."""
    ref = descriptions[0]
    differing = [rank for rank, d in zip(ranks, descriptions, strict=True) if d != ref]
    if not differing:
        return None
    other = descriptions[list(ranks).index(differing[0])]
    detail = _difference(ref, other, ranks[0], differing[0])
    also = f" (ranks that differ from rank {ranks[0]}: {differing})" if len(differing) > 1 else ""
    return (
        f"distopt.DistributedDataParallel: the model differs across the {group} group (ranks "
        f"{list(ranks)}): {detail}{also}; {_FIX}"
    )


def _difference(a: ModelDescription, b: ModelDescription, rank_a: int, rank_b: int) -> str:
    on = f"on rank {rank_a} but"
    on_b = f"on rank {rank_b}"
    for x, y in zip(a.tensors, b.tensors, strict=False):
        if x == y:
            continue
        if (x.kind, x.name) != (y.kind, y.name):
            return _naming_difference(a, b, x, y, rank_a, rank_b)
        what = f"{x.kind} '{x.name}'"
        if x.shape != y.shape:
            return f"{what} has shape {x.shape} {on} {y.shape} {on_b}"
        if x.dtype != y.dtype:
            return f"{what} has dtype {x.dtype} {on} {y.dtype} {on_b}"
        if x.requires_grad != y.requires_grad:
            return (f"{what} has requires_grad={x.requires_grad} {on} requires_grad="
                    f"{y.requires_grad} {on_b}")
        if x.tied_to != y.tied_to:
            return f"{what} is {_tie(x)} {on} {_tie(y)} {on_b}"
        if x.placements != y.placements:
            return f"{what} has placements {x.placements} {on} {y.placements} {on_b}"
        return f"{what} has local shape {x.local_shape} {on} {y.local_shape} {on_b}"
    if len(a.tensors) != len(b.tensors):
        longer, rank = (a, rank_a) if len(a.tensors) > len(b.tensors) else (b, rank_b)
        extra = longer.tensors[min(len(a.tensors), len(b.tensors))]
        return (f"rank {rank_a} registers {len(a.tensors)} params and buffers, rank {rank_b} "
                f"{len(b.tensors)}: {extra.kind} '{extra.name}' is on rank {rank} only")
    for (name, x), (_, y) in zip(a.options, b.options, strict=True):
        if x != y:
            return f"{name}={x} {on} {name}={y} {on_b}"
    return _layout_difference(a, b, rank_a, rank_b)


def _naming_difference(a: ModelDescription, b: ModelDescription, x: TensorEntry,
                       y: TensorEntry, rank_a: int, rank_b: int) -> str:
    names_a = {(t.kind, t.name) for t in a.tensors}
    names_b = {(t.kind, t.name) for t in b.tensors}
    if (x.kind, x.name) not in names_b:
        return f"{x.kind} '{x.name}' (shape {x.shape}) is on rank {rank_a} but not on rank {rank_b}"
    if (y.kind, y.name) not in names_a:
        return f"{y.kind} '{y.name}' (shape {y.shape}) is on rank {rank_b} but not on rank {rank_a}"
    return (f"the {x.kind}s are registered in another order: '{x.name}' comes where rank "
            f"{rank_b} has '{y.name}' (shapes {x.shape} on rank {rank_a}, {y.shape} on rank "
            f"{rank_b})")


def _tie(entry: TensorEntry) -> str:
    return f"tied to '{entry.tied_to}'" if entry.tied_to else "a tensor of its own (untied)"


def _layout_difference(a: ModelDescription, b: ModelDescription, rank_a: int, rank_b: int) -> str:
    sizes = f"bucket_size {a.bucket_size} on rank {rank_a}, {b.bucket_size} on rank {rank_b}"
    for x, y in zip(a.buffers, b.buffers, strict=False):
        for i, (bx, by) in enumerate(zip(x.buckets, y.buckets, strict=False)):
            if bx != by:
                return (f"the planned bucket layout differs ({sizes}): bucket {i} of the "
                        f"{x.param_dtype} buffer holds {list(bx.params)} in elements "
                        f"[{bx.start}, {bx.end}) on rank {rank_a} but {list(by.params)} in "
                        f"[{by.start}, {by.end}) on rank {rank_b}")
        if x != y:
            return (f"the planned bucket layout differs ({sizes}): the {x.param_dtype} buffer "
                    f"has {len(x.buckets)} buckets of {x.numel} elements on rank {rank_a} but "
                    f"{len(y.buckets)} of {y.numel} on rank {rank_b}")
    return (f"the planned bucket layout differs ({sizes}): {len(a.buffers)} buffers on rank "
            f"{rank_a}, {len(b.buffers)} on rank {rank_b}")


# ---------------------------------------------------------------------- collective part


def check_same_model(
    module: nn.Module,
    trainable: Sequence[tuple[str, nn.Parameter]],
    options: GradSyncOptions,
    *,
    bucket_size: int,
    parallel: ParallelGroups,
    stats: comm.CommStats | None = None,
    experts: ExpertParams | None = None,
    units: Mapping[nn.Parameter, int] | None = None,
) -> None:
    """Raise the same ``ValueError`` on every rank of ``parallel``'s groups unless they all
    hold the same model and plan the same buckets; see [Note: one model on every rank].
    Collective over those groups; nothing to do on one process."""
    groups = compared_groups(parallel)
    if not groups:
        return
    description = describe_model(module, trainable, options, bucket_size=bucket_size,
                                 dp_size=parallel.dp_size, experts=experts, units=units)
    raise_unless_same(
        [(name, group, description if full else description.global_view())
         for name, group, full in groups],
        lambda mine: mine.digest(), first_difference, trainable[0][1].device, stats)
