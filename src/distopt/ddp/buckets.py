"""Contiguous parameter and gradient buffers, and the buckets that reduce and gather them.

One ``ParamAndGradBuffer`` holds every trainable parameter of one dtype. After construction each
such parameter's ``.data`` (a DTensor's local shard) is a view into ``param_data`` and its
``main_grad`` (the one attribute distopt hangs on a parameter) is a view, of the same local
shape, into ``grad_data``. Both buffers share one layout (see [Note: layout rule] in
layout/elementwise.py), so a bucket is the same range of both, and the collectives of a bucket
run on one contiguous tensor without any copy.

A ``Bucket`` owns its step: which of its grads have been written and which are still to come,
its reduction and its gather in flight, and the region of grads this rank holds reduced. The
DDP wrapper only decides when each bucket acts (see [Note: bucket launch order] in ddp/wrapper.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..layout.elementwise import BucketLayout, BufferLayout, Range
from ..parallel.dtensor import alias_local, local_tensor
from .grad_pool import GradPool


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
        grad_data: torch.Tensor | None,
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
        self.numel = layout.buffer_range.size  # padding included
        self.params = params
        self.param_ranges = param_ranges  # of each param, in bucket coordinates
        self.param_data = param_data  # [bucket numel], padding included
        # [bucket numel]; None between steps with sharded grads (ddp/grad_pool.py)
        self.grad_data = grad_data
        shard = layout.shard_range(dp_rank)
        self.param_shard = param_data[shard.start : shard.end]  # [bucket numel / d]
        # [bucket numel / d]; sharded grads keep it apart from the transient grad_data
        self.grad_shard = grad_data[shard.start : shard.end] if grad_data is not None else None
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
        self._replica_due = False  # a first stage was launched whose second is not yet
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

    def wrote(self, param: nn.Parameter) -> bool:
        """Whether ``param`` got a grad since the last ``forget_grads``."""
        return param in self._written

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
        self._replica_due = False

    # ------------------------------------------------------------------ collectives

    def launch_reduction(self, *, replicate: bool = True) -> None:
        """Start averaging the bucket's grads over the group; ``wait_reduction`` finishes it.
        ``replicate``: follow it with the hierarchical second stage (sharded grads skip it
        under no_sync)."""
        self._zero_unwritten()
        if self.check_local_grads:  # now, before the reduction mixes every rank's grads
            self._local_finite = self._local_grads_finite()
        self._start_reduction(self.grad_shard, replicate=replicate)

    def _zero_unwritten(self) -> None:
        for param in self.params:
            if param not in self._written:
                param.main_grad.zero_()  # see [Note: grads written, not zeroed]

    def _local_grads_finite(self) -> torch.Tensor:
        return torch.stack([torch.isfinite(param.main_grad).all() for param in self.params])

    def _start_reduction(self, output: torch.Tensor | None, *, replicate: bool) -> None:
        if self.reduce_scatter:
            # Looked up at call time, so that wrappers installed later (tests, benchmarks)
            # see the call.
            reduce_scatter = (
                comm.reduce_scatter_avg_fp32_accum if self.fp32_accumulation
                else comm.reduce_scatter_avg
            )
            handle = reduce_scatter(
                output, self.grad_data, self.group, async_op=True, stats=self.stats
            )
        else:
            handle = comm.all_reduce_avg(
                self.grad_data, self.group, async_op=True, stats=self.stats
            )
        self._reduction = handle
        self.reduction_started = True
        self._replica_due = replicate and self.replicate_group is not None

    def advance_reduction(self, *, block: bool) -> bool:
        """Start the second stage of a hierarchical reduction once the first has finished:
        the average of this rank's reduced grads over the replicate group; see
        [Note: hierarchical data parallelism]. Without ``block`` it starts it only if the first
        stage is already done. True once nothing is left to start (always, when flat)."""
        if not self._replica_due:
            return True
        first = self._reduction
        if first is not None and not block and not first.is_completed():
            return False
        self.finish_first_stage()
        self._launch_replica()
        return True

    def _launch_replica(self) -> None:
        # See [Note: fp32-accumulated reduce-scatter]: the second stage sums in fp32 too.
        all_reduce = (
            comm.all_reduce_avg_fp32_accum if self.fp32_accumulation else comm.all_reduce_avg
        )
        self._replica_reduction = all_reduce(
            self.owned_grad, self.replicate_group, async_op=True, stats=self.stats,
            op="replicate_all_reduce",
        )
        self._replica_due = False

    def finish_first_stage(self) -> None:
        """Wait for the reduction over the shard group, if one is in flight."""
        handle, self._reduction = self._reduction, None
        if handle is not None:
            with comm.failures_named(self._reduction_op, self._describe_grads()):
                handle.wait()
            self._first_stage_done()

    def _first_stage_done(self) -> None:
        """What follows a waited first stage (sharded grads keep its result)."""

    def wait_reduction(self) -> None:
        """Wait for the bucket's whole reduction (both stages when hierarchical)."""
        self.advance_reduction(block=True)
        self.finish_first_stage()
        handle, self._replica_reduction = self._replica_reduction, None
        if handle is not None:
            with comm.failures_named("replicate_all_reduce", self._describe_grads()):
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

    # What a failed collective names; see [Note: a stuck rank] in comm/collectives.py.
    @property
    def _reduction_op(self) -> str:
        return "reduce_scatter" if self.reduce_scatter else "all_reduce"

    def _describe(self, data: torch.Tensor) -> str:
        return f"bucket {self.order} ({data.numel()} {data.dtype} elements)"

    def _describe_grads(self) -> str:
        dtype = self.owned_grad.dtype
        return f"bucket {self.order} ({self.numel} {dtype} elements)"

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
        base = self.owned_range.start
        for param, slot in zip(self.params, self.param_ranges, strict=True):
            owned = slot.intersect(self.owned_range)
            if owned is not None and not bool(
                torch.isfinite(self.owned_grad[owned.start - base : owned.end - base]).all()
            ):
                bad.append(param)
        return bad


class ShardedGradBucket(Bucket):
    """A bucket whose full grads live in a buffer of the ``GradPool`` only from its first grad
    of a backward until its reduction is waited for; between steps it keeps ``grad_shard``, this
    rank's reduced shard, alone. Every backward reduces and adds into it. See
    [Note: sharded grads] in ddp/grad_pool.py."""

    def __init__(
        self,
        layout: BucketLayout,
        params: list[nn.Parameter],
        param_ranges: list[Range],
        param_data: torch.Tensor,
        grad_shard: torch.Tensor,
        pool: GradPool,
        **options: Any,
    ) -> None:
        super().__init__(layout, params, param_ranges, param_data, None, **options)
        self.grad_shard = self.owned_grad = grad_shard  # [bucket numel / d], kept
        self.pool = pool
        self._local_shapes = [local_tensor(p).shape for p in params]
        # Bucket ranges no param covers (the padding): a reused buffer holds stale values there.
        self._gaps = _gaps(param_ranges, layout.buffer_range.size)
        self._pool_buffer: torch.Tensor | None = None  # what grad_data views, while held
        self._copy_next = True  # the next reduction replaces grad_shard (a new step)
        self._into_kept = False  # the reduction in flight writes grad_shard itself
        self._unreplicated = False  # grad_shard got a reduction no second stage followed

    # ------------------------------------------------------------------ transient grads

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if self.grad_data is None:
            self._take_buffer()
        super().add_grad(param, grad)

    def _take_buffer(self) -> None:
        self._pool_buffer = self.pool.acquire()
        self.grad_data = self._pool_buffer[: self.numel]
        self._written.clear()  # see [Note: grads written, not zeroed]
        for param, slot, shape in zip(self.params, self.param_ranges, self._local_shapes,
                                      strict=True):
            param.main_grad = self.grad_data[slot.start : slot.end].view(shape)

    def _give_buffer_back(self) -> None:
        if self.grad_data is None:
            return
        for param in self.params:
            param.main_grad = None
        self.pool.give_back(self._pool_buffer)
        self.grad_data = self._pool_buffer = None

    # ------------------------------------------------------------------ reductions

    def launch_reduction(self, *, replicate: bool = True) -> None:
        if self._reduction is not None or self._replica_reduction is not None:
            self.wait_reduction()  # an earlier backward's, still adding into grad_shard
        if self.grad_data is None:  # no grad this backward: it reduces zeros
            self._take_buffer()
        self._zero_unwritten()
        for gap in self._gaps:
            self.grad_data[gap.start : gap.end].zero_()
        if self.check_local_grads:  # every micro-batch of the step counts
            finite = self._local_grads_finite()
            self._local_finite = (
                finite if self._copy_next or self._local_finite is None
                else self._local_finite & finite
            )
        # A step's first reduction writes the kept shard directly; later ones are added to it.
        self._into_kept, self._copy_next = self._copy_next, False
        shard = self.owned_range
        output = self.grad_shard if self._into_kept else self.grad_data[shard.start : shard.end]
        self._start_reduction(output, replicate=replicate)
        self.pool.launched(self)

    def _first_stage_done(self) -> None:
        if not self._into_kept:
            shard = self.owned_range
            self.grad_shard.add_(self.grad_data[shard.start : shard.end])
        if self.replicate_group is not None and not self._replica_due:
            self._unreplicated = True
        self._give_buffer_back()

    def _launch_replica(self) -> None:
        super()._launch_replica()
        self._unreplicated = False

    def replicate_if_needed(self) -> None:
        """Start the second stage over the kept shard if some reduction added to it skipped
        its own (micro-batches under no_sync); averaging is linear, so once is enough."""
        if self._unreplicated:
            self._replica_due = True
            self.advance_reduction(block=True)

    @property
    def reduced_this_step(self) -> bool:
        """Whether a reduction since the last ``forget_grads`` wrote the kept shard."""
        return not self._copy_next

    @property
    def holds_buffer(self) -> bool:
        return self.grad_data is not None

    def end_backward(self) -> None:
        """The backward is over: expect every grad again, reductions still in flight."""
        self._pending = set(self.params)
        self.reduction_started = False

    def forget_grads(self) -> None:
        super().forget_grads()
        self._give_buffer_back()  # a backward that raised before its bucket was launched
        self._copy_next = True
        self._unreplicated = False


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
        grad_pool: GradPool | None = None,
    ) -> None:
        """``params`` in layout order, laid out by ``layout`` (from layout/model_layout.py). With a
        ``grad_pool`` the grads are sharded: no ``grad_data``, only ``grad_shards`` (this
        rank's reduced shard of every bucket) between steps; see [Note: sharded grads] in
        ddp/grad_pool.py."""
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
        sharded = grad_pool is not None
        self.grad_data = (
            None if sharded else torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        )
        # [sum of the buckets' shard sizes]: bucket by bucket, this rank's reduced grads.
        self.grad_shards = (
            torch.zeros(sum(b.shard_size for b in self.layout.buckets), dtype=grad_dtype,
                        device=device)
            if sharded else None
        )

        with torch.no_grad():
            for param, slot in zip(params, self.layout.params, strict=True):
                rng = slot.buffer_range
                # A DTensor param keeps its local shard here; see [Note: DTensor params].
                local = local_tensor(param)
                view = self.param_data[rng.start : rng.end].view_as(local)
                view.copy_(local.detach())
                alias_local(param, view)
                # With sharded grads a view of the transient grads, only during a reduction.
                param.main_grad = (
                    None if sharded else self.grad_data[rng.start : rng.end].view_as(local)
                )

        self.buckets: list[Bucket] = []
        kept_offset = 0
        for bucket_layout in self.layout.buckets:
            rng = bucket_layout.buffer_range
            indices = bucket_layout.param_indices
            args = (
                bucket_layout,
                [params[i] for i in indices],
                [self.layout.params[i].bucket_range for i in indices],
                self.param_data[rng.start : rng.end],
            )
            options = dict(
                dp_rank=dp_rank, group=group, reduce_scatter=reduce_scatter, stats=stats,
                replicate_group=replicate_group, fp32_accumulation=fp32_accumulation,
                check_local_grads=check_local_grads,
            )
            if grad_pool is None:
                bucket = Bucket(*args, self.grad_data[rng.start : rng.end], **options)
            else:
                size = bucket_layout.shard_size
                kept = self.grad_shards[kept_offset : kept_offset + size]
                kept_offset += size
                bucket = ShardedGradBucket(*args, kept, grad_pool, **options)
            self.buckets.append(bucket)

    def grad_storage(self) -> list[torch.Tensor]:
        """The grad tensors this buffer holds between steps: ``grad_data`` (every grad), or
        with sharded grads ``grad_shards`` (this rank's reduced shard of every bucket)."""
        return [self.grad_data if self.grad_shards is None else self.grad_shards]
