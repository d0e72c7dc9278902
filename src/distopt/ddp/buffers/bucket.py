"""A bucket: a range of both buffers, its step state, and its collectives.

A ``Bucket`` owns its step: its ``BucketState`` ([Note: step states] in ddp/state.py), which of
its grads have been written and which are still to come, its reduction and its gather in
flight, and the region of grads this rank holds reduced. Where its grads live between steps is
its storage's to say (ddp/buffers/grad_storage.py, read here and nowhere else). The grad sync
(ddp/grads/grad_sync.py) decides when each bucket acts ([Note: bucket launch order]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from ...layout.elementwise import BucketLayout, Range
from ...parallel.managed_replicas import ManagedReplicas
from ..state import BUCKET_TRANSITIONS, BucketState, advance
from .grad_intake import write_grad
from .grad_storage import FullGrads, ShardedGrads
from .param_storage import SAME_MODULES, FullParams, ShardedParams

_LAUNCHED = (BucketState.REDUCING, BucketState.REDUCED)


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
        params_store: FullParams | ShardedParams,
        storage: FullGrads | ShardedGrads,
        *,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        reduce_scatter: bool,
        stats: comm.CommStats | None,
        replicate_group: dist.ProcessGroup | ManagedReplicas | None = None,
        fp32_accumulation: bool = False,
        check_local_grads: bool = False,
        grad_scale: float = 1.0,
    ) -> None:
        self.layout = layout
        self.dp_rank = dp_rank
        self.numel = layout.buffer_range.size  # padding included
        self.params = params
        self.param_ranges = param_ranges  # of each param, in bucket coordinates
        shard = layout.shard_range(dp_rank)
        # Where its params live ([Note: sharded params] in ddp/buffers/param_storage.py) and its
        # grads (ddp/buffers/grad_storage.py): the two places a bucket depends on the sharding.
        self.params_store = params_store
        self.storage = storage
        self.group = group
        # A torchft Manager's groups are fault tolerant: [Note: fault-tolerant replicas].
        self.replicate_group = (
            replicate_group if isinstance(replicate_group, ManagedReplicas)
            or comm.group_size(replicate_group) > 1 else None
        )
        self.reduce_scatter = reduce_scatter
        self.fp32_accumulation = fp32_accumulation
        self.stats = stats
        # What the grads are multiplied by before their average over the group: 1/ep for an
        # expert's; see [Note: expert parallelism] in parallel/experts.py.
        self.grad_scale = grad_scale
        # The grads this rank holds reduced once the reduction is waited for, in bucket
        # coordinates.
        self.owned_range = shard if reduce_scatter else Range(0, layout.buffer_range.size)
        self.order = -1  # position in the DDP's global launch order, set by the DDP
        self.state = BucketState.EMPTY
        self.launched_round = -1  # the grad sync's round in which it was last launched

        self._written: set[nn.Parameter] = set()  # see [Note: grads written, not zeroed]
        self._pending: set[nn.Parameter] = set(params)  # grads still to come before a launch
        self._reduction: Any = None  # handle of the reduction in flight (in the shard group)
        self._replica_reduction: Any = None  # handle of its second stage (replicate group)
        self.replica_due = False  # a first stage was launched whose second is not yet
        self._gather: Any = None  # handle of the gather in flight
        # Per param, whether this rank's own grads were finite when the reduction was launched
        # (only with ``check_local_grads``: the nan check names the rank that produced one).
        self.check_local_grads = check_local_grads
        self._local_finite: torch.Tensor | None = None

    def _advance(self, new: BucketState) -> None:
        self.state = advance(self.state, new, BUCKET_TRANSITIONS, f"bucket {self.order}")

    # ------------------------------------------------------------------ views

    @property
    def param_data(self) -> torch.Tensor | None:
        """[bucket numel]: every param of the bucket (None while sharded params are not
        gathered)."""
        return self.params_store.param_data

    @property
    def param_shard(self) -> torch.Tensor:
        """[bucket numel / d]: this rank's shard of the params, which the optimizer updates."""
        return self.params_store.param_shard

    @property
    def grad_data(self) -> torch.Tensor | None:
        """[bucket numel]: every grad of the bucket (None between steps with sharded grads)."""
        return self.storage.grad_data

    @property
    def grad_shard(self) -> torch.Tensor:
        """[bucket numel / d]: this rank's shard of the grads, reduced once waited for."""
        return self.storage.grad_shard

    @property
    def owned_grad(self) -> torch.Tensor:
        """The grads this rank holds reduced: its shard, or the whole bucket when all-reduced."""
        return self.grad_shard if self.reduce_scatter else self.storage.grad_data

    @property
    def holds_buffer(self) -> bool:
        """Whether its full grads are held now (always, unless grads are sharded)."""
        return self.storage.holds_buffer

    # ------------------------------------------------------------------ grads

    @property
    def launched(self) -> bool:
        """Whether its reduction was launched and not forgotten since."""
        return self.state in _LAUNCHED

    def add_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Write (first grad of the step) or add (later ones) ``grad`` into ``main_grad``."""
        if self.state in _LAUNCHED:  # adds to a reduced bucket: every grad is due again
            self.wait_reduction()
            self.storage.reopen(self)  # see [Note: several backwards per step]
            self._pending = set(self.params)
            self._advance(BucketState.FILLING)
        elif self.state is BucketState.EMPTY:
            self._advance(BucketState.FILLING)
        self.storage.begin_grads(self)
        if grad.requires_grad or grad.is_sparse:  # [Note: grads as torch DDP takes them]
            write_grad(param.main_grad, grad, add=param in self._written)
            self._written.add(param)
        elif param in self._written:
            param.main_grad.add_(grad)
        else:  # see [Note: grads written, not zeroed]
            param.main_grad.copy_(grad)
            self._written.add(param)

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Note that ``param``'s last grad of the backward arrived; True once all of them have."""
        self._pending.discard(param)
        if not self._pending and self.state is BucketState.FILLING:
            self._advance(BucketState.READY)
        return not self._pending

    @property
    def ready(self) -> bool:
        return not self._pending

    def wrote(self, param: nn.Parameter) -> bool:
        """Whether ``param`` got a grad since the last ``forget_grads``."""
        return param in self._written

    def forget_written(self) -> None:
        """The next grad of each param is written, not added (a fresh grad buffer)."""
        self._written.clear()

    def forget_grads(self) -> None:
        """A new step: the next grad of each param replaces the buffer's contents."""
        self.wait_reduction()
        self._written.clear()
        self._pending = set(self.params)
        self.replica_due = False
        self.storage.forget(self)
        self._advance(BucketState.EMPTY)

    def expect_every_grad(self) -> None:
        """The next backward's grads are all due again (its reduction may still run)."""
        self._pending = set(self.params)

    # ------------------------------------------------------------------ collectives

    def launch_reduction(self, round_: int, *, replicate: bool = True) -> None:
        """Start averaging the bucket's grads over the group; ``wait_reduction`` finishes it.
        ``round_``: the grad sync's round; ``replicate``: follow it with the hierarchical second
        stage (sharded grads skip it under no_sync)."""
        self.storage.prepare_launch(self)
        self._zero_unwritten()
        if self.check_local_grads:  # now, before the reduction mixes every rank's grads
            finite = self._local_grads_finite()
            # Sharded grads reduce each micro-batch: every one of the step counts.
            first = self.storage.copy_next or self._local_finite is None
            self._local_finite = finite if first else self._local_finite & finite
        if self.grad_scale != 1.0:
            self.grad_data.mul_(self.grad_scale)
        output = self.storage.reduction_output(self)
        self._start_reduction(output, replicate=replicate)
        self.launched_round = round_
        self._advance(BucketState.REDUCING)
        self.storage.launched(self)

    def _zero_unwritten(self) -> None:
        for param in self.params:
            if param not in self._written:
                param.main_grad.zero_()  # see [Note: grads written, not zeroed]

    def _local_grads_finite(self) -> torch.Tensor:
        return torch.stack([torch.isfinite(param.main_grad).all() for param in self.params])

    def _start_reduction(self, output: torch.Tensor, *, replicate: bool) -> None:
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
        self.replica_due = replicate and self.replicate_group is not None

    def advance_reduction(self, *, block: bool) -> bool:
        """Start the second stage of a hierarchical reduction once the first has finished:
        the average of this rank's reduced grads over the replicate group; see
        [Note: hierarchical data parallelism]. Without ``block`` it starts it only if the first
        stage is already done. True once nothing is left to start (always, when flat)."""
        if not self.replica_due:
            return True
        first = self._reduction
        if first is not None and not block and not first.is_completed():
            return False
        self.finish_first_stage()
        self._launch_replica()
        return True

    def _launch_replica(self) -> None:
        if isinstance(self.replicate_group, ManagedReplicas):
            self._replica_reduction = self.replicate_group.all_reduce_avg(self.owned_grad)
            self.replica_due = False
            self.storage.replica_started()
            return
        # See [Note: fp32-accumulated reduce-scatter]: the second stage sums in fp32 too.
        all_reduce = (
            comm.all_reduce_avg_fp32_accum if self.fp32_accumulation else comm.all_reduce_avg
        )
        self._replica_reduction = all_reduce(
            self.owned_grad, self.replicate_group, async_op=True, stats=self.stats,
            op="replicate_all_reduce",
        )
        self.replica_due = False
        self.storage.replica_started()

    def replicate_if_needed(self) -> None:
        """Start the second stage over the kept shard if some reduction added to it skipped
        its own (sharded grads' micro-batches under no_sync); averaging is linear, so once is
        enough."""
        if self.storage.unreplicated:
            self.replica_due = True
            self.advance_reduction(block=True)

    @property
    def reduction_completed(self) -> bool:
        """Whether no reduction over the shard group is in flight, or it has completed."""
        return self._reduction is None or self._reduction.is_completed()

    def finish_first_stage(self) -> None:
        """Wait for the reduction over the shard group, if one is in flight."""
        handle, self._reduction = self._reduction, None
        if handle is not None:
            with comm.failures_named(self._reduction_op, self._describe_grads(),
                                     SAME_MODULES if self.params_store.sharded else ""):
                handle.wait()
            self.storage.first_stage_done(self)

    def wait_reduction(self) -> None:
        """Wait for the bucket's whole reduction (both stages when hierarchical)."""
        self.advance_reduction(block=True)
        self.finish_first_stage()
        handle, self._replica_reduction = self._replica_reduction, None
        if handle is not None:
            with comm.failures_named("replicate_all_reduce", self._describe_grads()):
                handle.wait()
        if self.state is BucketState.REDUCING:
            self._advance(BucketState.REDUCED)

    def start_gather(self, *, async_op: bool) -> None:
        """All-gather ``param_data`` from every rank's ``param_shard`` (whole params: after the
        optimizer's update; sharded params gather around each use instead)."""
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

    # ------------------------------------------------------------------ sharded params

    def gather_params(self) -> None:
        """Sharded params: start gathering the bucket's params (if not gathered yet)."""
        self.params_store.start_gather(self.group, self.stats, self._describe_params())

    def use_params(self) -> None:
        """Sharded params: the bucket's full params, now (gathered and waited for)."""
        store = self.params_store
        store.start_gather(self.group, self.stats, self._describe_params())
        store.wait(self._describe_params())

    def release_params(self, *, placeholders: bool = True, autograd_reads: bool = False) -> None:
        """Sharded params: back to this rank's shard alone (``placeholders=False``: the params
        were given storage of their own and keep it; ``autograd_reads``: a backward will read
        views of them, [Note: views that outlive a gather] in ddp/buffers/gathered_views.py)."""
        self.params_store.release(self._describe_params(), placeholders=placeholders,
                                  autograd_reads=autograd_reads)

    def keep_param_writes(self) -> None:
        """Sharded params: what was written into the gathered params since they were
        gathered, into this rank's shard; see [Note: writes into the params] in
        optim/main_params.py."""
        self.params_store.keep_writes(self.dp_rank)

    def _describe_params(self) -> str:
        return f"bucket {self.order}'s params ({self.numel} {self.param_shard.dtype} elements)"

    # What a failed collective names; see [Note: a stuck rank] in comm/errors.py.
    @property
    def _reduction_op(self) -> str:
        return "reduce_scatter" if self.reduce_scatter else "all_reduce"

    def _describe(self, data: torch.Tensor) -> str:
        return f"bucket {self.order} ({data.numel()} {data.dtype} elements)"

    def _describe_grads(self) -> str:
        dtype = self.grad_shard.dtype
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
