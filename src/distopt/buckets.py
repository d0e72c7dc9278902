"""Contiguous parameter and gradient buffers, and the buckets that reduce and gather them.

One ``ParamAndGradBuffer`` holds every trainable parameter of one dtype. After construction each
such parameter's ``.data`` (a DTensor's local shard) is a view into ``param_data`` and its
``main_grad`` (the one attribute distopt hangs on a parameter) is a view, of the same local
shape, into ``grad_data``. Both buffers share one layout (see [Note: layout rule] in
layout/elementwise.py), so a bucket is the same range of both, and the collectives of a bucket
run on one contiguous tensor without any copy.

A ``Bucket`` owns its step: which of its grads have been written and which are still to come,
its reduction and its gather in flight, and the region of grads this rank holds reduced. The
DDP wrapper only decides when each bucket acts (see [Note: bucket launch order] in ddp.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .layout.elementwise import BucketLayout, BufferLayout, Range
from .parallel.dtensor import alias_local, local_tensor


class Bucket:
    """A bucket's views of both buffers, and its per-step state and collectives.

    ``reduce_scatter`` says what the reduction leaves reduced on this rank: its shard of the
    bucket (for the distributed optimizer) or the whole bucket (all-reduce, replicated
    optimizers).
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: list[nn.Parameter],
        param_ranges: list[Range],
        param_data: torch.Tensor,
        grad_data: torch.Tensor,
        *,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        reduce_scatter: bool,
        stats: comm.CommStats | None,
        replicate_group: dist.ProcessGroup | None = None,
        fp32_accumulation: bool = False,
        check_local_grads: bool = False,
    ) -> None:
        self.layout = layout
        self.params = params
        self.param_ranges = param_ranges  # of each param, in bucket coordinates
        self.param_data = param_data  # [bucket numel], padding included
        self.grad_data = grad_data  # [bucket numel]
        shard = layout.shard_range(dp_rank)
        self.param_shard = param_data[shard.start : shard.end]  # [bucket numel / d]
        self.grad_shard = grad_data[shard.start : shard.end]  # [bucket numel / d]
        self.group = group
        self.replicate_group = replicate_group if comm.group_size(replicate_group) > 1 else None
        self.reduce_scatter = reduce_scatter
        self.fp32_accumulation = fp32_accumulation
        self.stats = stats
        # The grads this rank holds reduced once the reduction is waited for, in bucket
        # coordinates and as a view.
        self.owned_range = shard if reduce_scatter else Range(0, layout.buffer_range.size)
        self.owned_grad = self.grad_shard if reduce_scatter else grad_data
        self.order = -1  # position in the DDP's global launch order, set by the DDP

        self._written: set[nn.Parameter] = set()  # see [Note: grads written, not zeroed]
        self._pending: set[nn.Parameter] = set(params)  # grads still to come before a launch
        self._reduction: Any = None  # handle of the reduction in flight (in the shard group)
        self._replica_reduction: Any = None  # handle of its second stage (replicate group)
        self._replica_launched = False
        self.reduction_started = False
        self._gather: Any = None  # handle of the gather in flight
        # Per param, whether this rank's own grads were finite when the reduction was launched
        # (only with ``check_local_grads``: the nan check names the rank that produced one).
        self.check_local_grads = check_local_grads
        self._local_finite: torch.Tensor | None = None

    # ------------------------------------------------------------------ grads

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Write (first grad of the step) or add (later ones) ``grad`` into ``main_grad``."""
        if param in self._written:
            param.main_grad.add_(grad)
        else:  # see [Note: grads written, not zeroed]
            param.main_grad.copy_(grad)
            self._written.add(param)

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Note that ``param``'s last grad of the step arrived; True once all of them have."""
        self._pending.discard(param)
        return not self._pending

    @property
    def ready(self) -> bool:
        return not self._pending

    @property
    def has_grads(self) -> bool:
        """Whether a grad of this step has been written since the last ``forget_grads``."""
        return bool(self._written)

    def forget_grads(self) -> None:
        """A new step: the next grad of each param replaces the buffer's contents."""
        self._written.clear()
        self.reset_reduction()

    def reset_reduction(self) -> None:
        """Expect every grad again before the next launch (after a finished sync)."""
        self._pending = set(self.params)
        self.reduction_started = False
        self._replica_launched = False

    # ------------------------------------------------------------------ collectives

    def launch_reduction(self) -> None:
        """Start averaging the bucket's grads over the group; ``wait_reduction`` finishes it."""
        for param in self.params:
            if param not in self._written:
                param.main_grad.zero_()  # see [Note: grads written, not zeroed]
        if self.check_local_grads:  # now, before the reduction mixes every rank's grads
            self._local_finite = torch.stack(
                [torch.isfinite(param.main_grad).all() for param in self.params]
            )
        if self.reduce_scatter:
            # Looked up at call time, so that wrappers installed later (tests, benchmarks)
            # see the call.
            reduce_scatter = (
                comm.reduce_scatter_avg_fp32_accum if self.fp32_accumulation
                else comm.reduce_scatter_avg
            )
            handle = reduce_scatter(
                self.grad_shard, self.grad_data, self.group, async_op=True, stats=self.stats
            )
        else:
            handle = comm.all_reduce_avg(
                self.grad_data, self.group, async_op=True, stats=self.stats
            )
        self._reduction = handle
        self.reduction_started = True

    def advance_reduction(self, *, block: bool) -> bool:
        """Start the second stage of a hierarchical reduction once the first has finished:
        the average of this rank's reduced grads over the replicate group; see
        [Note: hierarchical data parallelism]. Without ``block`` it starts it only if the first
        stage is already done. True once nothing is left to start (always, when flat)."""
        if self.replicate_group is None or self._replica_launched:
            return True
        first = self._reduction
        if first is not None and not block and not first.is_completed():
            return False
        self._reduction = None
        if first is not None:
            with comm.failures_named(self._reduction_op, self._describe(self.grad_data)):
                first.wait()
        # See [Note: fp32-accumulated reduce-scatter]: the second stage sums in fp32 too.
        all_reduce = (
            comm.all_reduce_avg_fp32_accum if self.fp32_accumulation else comm.all_reduce_avg
        )
        self._replica_reduction = all_reduce(
            self.owned_grad, self.replicate_group, async_op=True, stats=self.stats,
            op="replicate_all_reduce",
        )
        self._replica_launched = True
        return True

    def wait_reduction(self) -> None:
        """Wait for the bucket's whole reduction (both stages when hierarchical)."""
        if self.reduction_started:
            self.advance_reduction(block=True)
        for name, op in (("_reduction", self._reduction_op),
                         ("_replica_reduction", "replicate_all_reduce")):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                with comm.failures_named(op, self._describe(self.grad_data)):
                    handle.wait()

    def start_gather(self, *, async_op: bool) -> None:
        """All-gather ``param_data`` from every rank's ``param_shard``."""
        with comm.failures_named("all_gather", self._describe(self.param_data)):
            handle = comm.all_gather(
                self.param_data, self.param_shard, self.group, async_op=async_op,
                stats=self.stats,
            )
        self._gather = handle if async_op and handle is not comm.DONE else None

    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None

    def wait_gather(self) -> None:
        handle, self._gather = self._gather, None
        if handle is not None:
            with comm.failures_named("all_gather", self._describe(self.param_data)):
                handle.wait()

    # What a failed collective names; see [Note: a stuck rank] in collectives.py.
    @property
    def _reduction_op(self) -> str:
        return "reduce_scatter" if self.reduce_scatter else "all_reduce"

    def _describe(self, data: torch.Tensor) -> str:
        return f"bucket {self.order} ({data.numel()} {data.dtype} elements)"

    # ------------------------------------------------------------------ checks

    def nonfinite_local_params(self) -> list[nn.Parameter]:
        """The params whose grads on this rank held a nan or inf when the last reduction was
        launched (always empty without ``check_local_grads``)."""
        finite = self._local_finite
        if finite is None or bool(finite.all()):
            return []
        return [p for p, ok in zip(self.params, finite.tolist(), strict=True) if not ok]

    def nonfinite_params(self) -> list[nn.Parameter]:
        """The params with a nan or inf in the part of their grads this rank holds reduced."""
        if bool(torch.isfinite(self.owned_grad).all()):
            return []
        bad = []
        for param, slot in zip(self.params, self.param_ranges, strict=True):
            owned = slot.intersect(self.owned_range)
            if owned is not None and not bool(
                torch.isfinite(self.grad_data[owned.start : owned.end]).all()
            ):
                bad.append(param)
        return bad


class ParamAndGradBuffer:
    """Flat param and grad storage for parameters of one dtype, cut into buckets."""

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: BufferLayout,
        *,
        grad_dtype: torch.dtype,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        reduce_scatter: bool,
        stats: comm.CommStats | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        fp32_accumulation: bool = False,
        check_local_grads: bool = False,
    ) -> None:
        """``params`` in layout order, laid out by ``layout`` (from layout/planner.py)."""
        if not params:
            raise ValueError("a buffer needs at least one parameter")
        self.params = params  # layout order
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.dp_size = layout.dp_size
        self.dp_rank = dp_rank
        self.layout = layout
        device = params[0].device
        # Padding must be zero: it is reduced and gathered with the rest and must stay finite.
        self.param_data = torch.zeros(self.layout.numel, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)

        with torch.no_grad():
            for param, slot in zip(params, self.layout.params, strict=True):
                rng = slot.buffer_range
                # A DTensor param keeps its local shard here; see [Note: DTensor params].
                local = local_tensor(param)
                view = self.param_data[rng.start : rng.end].view_as(local)
                view.copy_(local.detach())
                alias_local(param, view)
                param.main_grad = self.grad_data[rng.start : rng.end].view_as(local)

        self.buckets: list[Bucket] = []
        for bucket_layout in self.layout.buckets:
            rng = bucket_layout.buffer_range
            indices = bucket_layout.param_indices
            self.buckets.append(
                Bucket(
                    bucket_layout,
                    [params[i] for i in indices],
                    [self.layout.params[i].bucket_range for i in indices],
                    self.param_data[rng.start : rng.end],
                    self.grad_data[rng.start : rng.end],
                    dp_rank=dp_rank,
                    group=group,
                    reduce_scatter=reduce_scatter,
                    stats=stats,
                    replicate_group=replicate_group,
                    fp32_accumulation=fp32_accumulation,
                    check_local_grads=check_local_grads,
                )
            )
