"""DistributedDataParallel: contiguous buffers, gradient hooks and bucket collectives.

[Note: bucket launch order]
Collectives on one process group must be issued in the same order on every rank. Buckets are
therefore launched strictly in one fixed order (the layout order, which follows backward): when
a bucket's last grad arrives, it is launched only if every bucket before it has been, and then
every following bucket that is ready goes with it. A bucket holding a parameter that got no
grad in this backward (unused on this rank, or used only on others) simply waits for
``finish_grad_sync``, which launches whatever is left. Nothing depends on which parameters each
rank happened to use, so nothing can hang or mismatch.

[Note: grads written, not zeroed]
``zero_grad_buffer`` does not clear the grad buffer: it only forgets which parameters have a
grad. The first grad a parameter gets after it is copied into the buffer, later ones (more
micro-batches) are added; a parameter that got none by the time its bucket is reduced has its
slot zeroed then. This spares a write of the whole buffer every step (for a model that fits in
cache it is as costly as the reduction's own pass over the buffer), and the reduced result is
the same as with a cleared buffer. Padding between parameters is never written by anything but
the reduction of zeros, so it stays zero.

[Note: grads after the reduction]
Once a bucket's reduction has started, a grad that arrives for one of its parameters cannot
join it: with overlap the bucket is already on the wire, and after a reduce-scatter each rank's
buffer holds the average only in its own chunk and its local grads elsewhere, so reducing the
buffer again would mix the two. Such a grad comes from a second backward without ``no_sync``
or ``zero_grad`` in between, or from a parameter whose grad is accumulated twice in one
backward (reentrant activation checkpointing); on several ranks it raises in the grad hook,
rather than give a silently wrong step. The one case that stays correct is kept: with
all-reduced buckets and a finished sync, every rank holds the same average, and a further
backward adds to it and reduces again, as torch DDP does. On one process nothing is reduced
and grads simply accumulate. With sharded grads every backward reduces and adds to the kept
shard, so only a grad for a bucket launched in the same backward raises, on one process too
([Note: sharded grads] in ddp/grad_pool.py). The error names the case it sees: a backward after
the step's sync without ``zero_grad``; a parameter that already had a grad this step (a second
micro-batch outside ``no_sync``, or a grad accumulated twice in one backward); anything else. A
second wrapper over the same params, which used to end here too (the first wrapper's hooks took
the grads), now releases the first ([Note: one wrapper per param] in ddp/param_owners.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..cross_rank.model import check_same_model
from ..layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO
from ..layout.model_layout import ParamSpec, plan_model_layout, resolve_bucket_size
from ..options import GradSyncOptions
from ..parallel.dtensor import alias_local, is_dtensor, local_grad, local_tensor
from ..parallel.process_groups import THIS_PROCESS, ParallelGroups, resolve_dp_groups, resolve_group
from ..parallel.tensor_parallel import TensorParallelMesh, check_params
from . import param_owners
from .buckets import Bucket, ParamAndGradBuffer, ShardedGradBucket
from .grad_marker import GradInBuffer
from .grad_pool import GradPool, grad_pools_for
from .module_buffers import BufferBroadcast, adopt_sync_batchnorm_group
from .module_params import trainable_named_params
from .nan_check import raise_on_nonfinite_grad
from .param_gather import register_param_wait_hooks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

class DistributedDataParallel(nn.Module):
    """Data parallelism over contiguous, bucketed param and grad buffers.

    Args:
        module: the model, already on its device and in its dtype.
        process_group: the data-parallel group; None means the default group (or a single
            process when torch.distributed is not initialized).
        grad_dtype: dtype of the grad buffer and of the reduction; None means each
            parameter's own dtype.
        bucket_size: elements per bucket; None picks ``default_bucket_size`` of
            layout/elementwise.py (about a quarter of the model, or half of it on gloo).
        overlap_grad_reduce: start each bucket's reduction during backward, as soon as its
            last grad is accumulated, instead of in ``finish_grad_sync``.
        use_distributed_optimizer: reduce-scatter buckets (for DistributedOptimizer); False
            all-reduces them (for BasicOptimizer).
        find_unused_parameters: track which parameters got a grad on any rank; parameters
            that got none anywhere are left out of the optimizer step, as torch.optim skips
            parameters whose ``.grad`` is None. Costs one small all-reduce per step. When
            False an unused parameter's grad is zero and the optimizer still steps it.
        check_for_nan_in_grad: after the reduction, raise on every rank, naming the first
            parameter (in registration order) whose grad holds a nan or inf.
        reduce_scatter_with_fp32_accumulation: with bf16 or fp16 grads, send them in their own
            dtype but have each rank add the d copies of its shard in fp32 and round the
            average once, so its error does not grow with d (same bytes; a transient receive
            buffer and fp32 accumulator per bucket in flight). Needs the distributed optimizer
            and low-precision grads; buffers whose grads are fp32 reduce as before. See
            [Note: fp32-accumulated reduce-scatter] in comm/collectives.py.
        device_mesh: the data-parallel group as a mesh instead of ``process_group`` (give at
            most one): a 1-D mesh, or a mesh with a dimension named "dp". Params may be DTensors
            on the tensor-parallel submesh (``parallelize_module(module, mesh["tp"], plan)``);
            see docs/tensor-parallel.md.
        shard_grads: keep only this rank's shard of the reduced grads between steps, each
            bucket's full grads only from its first grad until its reduction is waited for,
            in a small pool of bucket-sized buffers (``grad_pools``). Every backward then
            reduces, inside ``no_sync()`` too. Needs the distributed optimizer. See
            [Note: sharded grads] in ddp/grad_pool.py.
        broadcast_buffers: as torch DDP's: before a forward, broadcast the module's buffers
            (BatchNorm's running statistics) from the first data-parallel rank to the others
            (over the replicas of a hierarchical mesh too, never across tensor-parallel
            ranks), one broadcast per buffer dtype; the forwards that broadcast are torch's:
            the first, and each one after a forward with grad enabled outside ``no_sync()``.
            False: no broadcast, not even at construction; each rank keeps its own buffers.
            ``nn.SyncBatchNorm`` layers without a ``process_group`` are given the
            data-parallel group either way. See [Note: buffer broadcasting] in
            ddp/module_buffers.py.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        grad_dtype: torch.dtype | None = torch.float32,
        bucket_size: int | None = None,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = True,
        *,
        find_unused_parameters: bool = False,
        check_for_nan_in_grad: bool = False,
        reduce_scatter_with_fp32_accumulation: bool = False,
        device_mesh: DeviceMesh | None = None,
        shard_grads: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        named = trainable_named_params(
            module, (DistributedDataParallel, nn.parallel.DistributedDataParallel))
        self.options = GradSyncOptions(
            grad_dtype=grad_dtype,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            find_unused_parameters=find_unused_parameters,
            check_for_nan_in_grad=check_for_nan_in_grad,
            reduce_scatter_with_fp32_accumulation=reduce_scatter_with_fp32_accumulation,
            shard_grads=shard_grads,
            broadcast_buffers=broadcast_buffers,
        )
        self.options.check_param_dtypes({p.dtype for _, p in named})

        self.module = module
        dp_group, replicate_group = resolve_dp_groups(process_group, device_mesh)
        dp_group = resolve_group(dp_group)
        # The TP mesh is None without DTensor params; check_params raises (on every rank, before
        # any collective) on a DTensor layout distopt cannot compose with. See
        # [Note: DTensor params].
        self.parallel = ParallelGroups.of(
            dp_group, check_params(named, dp_group), replicate_group
        )
        # Over the replicas and TP groups too, so that every rank of the mesh raises, or none
        # does, and each learns which rank produced the nan.
        self._nan_check_groups = self.parallel.verdict_groups(replicas=True)
        self.comm_stats = comm.CommStats()
        # Raises, on every rank alike, where no one group spans the DP ranks.
        adopt_sync_batchnorm_group(module, self.parallel)

        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        self.params: list[nn.Parameter] = [p for _, p in named]  # registration order
        self._param_index = {p: i for i, p in enumerate(self.params)}
        target = TARGET_BUCKETS_GLOO if comm.is_gloo(self.process_group) else TARGET_BUCKETS
        self.bucket_size = resolve_bucket_size(
            self.options.bucket_size, self._param_specs({}), self.dp_size, target
        )

        # Every rank must hold the same model and plan the same buckets before the first
        # collective; see [Note: one model on every rank] in cross_rank/model.py.
        check_same_model(module, named, self.options, bucket_size=self.bucket_size,
                         parallel=self.parallel, stats=self.comm_stats)
        # A module wrapped before is taken over, its old wrapper released first (its gathers
        # may still write into the params); see [Note: one wrapper per param] in
        # ddp/param_owners.py.
        self._released: str | None = None  # why this wrapper let go of its module
        for older, param in param_owners.other_owners(self.params, self):
            older._release(
                f"a newer distopt.DistributedDataParallel wrapped its parameter "
                f"'{older.param_names[param]}'"
            )
        param_owners.claim(self.params, self)
        # Torch DDP semantics: every replica starts from rank 0's weights (and buffers, unless
        # broadcast_buffers=False).
        synced = (*module.parameters(), *(module.buffers() if broadcast_buffers else ()))
        comm.broadcast_from_first_ranks([local_tensor(t.data) for t in synced],
                                        self.parallel.data_parallel_groups)
        self._buffer_broadcast = BufferBroadcast(module, self.parallel, self.comm_stats,
                                                 enabled=broadcast_buffers)

        # Laid out once, when first needed; see [Note: layout planned once] in
        # layout/model_layout.py.
        self._whole_tensor_costs: dict[nn.Parameter, float] = {}
        self._flat_buffers: list[ParamAndGradBuffer] | None = None
        self._buckets: list[Bucket] = []  # in launch order; empty until laid out
        # Only these params need their DTensor grads turned into local ones in the hook.
        self._dtensor_params = frozenset(p for p in self.params if is_dtensor(p))

        self._sync_enabled = True
        self._grad_sync_done = False
        self._next_launch = 0  # the first bucket of the launch order not launched yet
        self._next_replica = 0  # the first bucket whose second stage is not started yet
        self._used = bytearray(len(self.params))  # with find_unused_parameters
        self.unused_params: frozenset[nn.Parameter] = frozenset()
        self._gathers_in_flight = False
        # With shard_grads: one pool per grad dtype, and whether this backward queued its end.
        self.grad_pools: dict[torch.dtype, GradPool] = {}
        self._in_backward = False
        # What p.grad holds once its grad is in the buffers, and the params holding it now;
        # see [Note: p.grad under distopt] in ddp/grad_marker.py.
        self._markers = {p: GradInBuffer(p, self.param_names[p]) for p in self.params}
        self._marked: set[nn.Parameter] = set()
        self._grad_hooks = [
            hook for p in self.params for hook in (
                p.register_hook(functools.partial(self._before_accumulate, p)),
                p.register_post_accumulate_grad_hook(self._accumulate_grad),
            )
        ]
        self._param_wait_hooks: list[Any] = []  # forward pre-hooks, once laid out

    def _param_specs(self, whole_costs: dict[nn.Parameter, float]) -> list[ParamSpec]:
        return [ParamSpec(tuple(local_tensor(p).shape), p.dtype, whole_costs.get(p))
                for p in self.params]

    def build_buffers(self, whole_tensor_costs: dict[nn.Parameter, float]) -> None:
        """Lay the buffers out, each param in ``whole_tensor_costs`` owned whole by one
        data-parallel rank (the owners balancing the summed costs), every other param in
        element-wise shards. The optimizer calls this with its whole-tensor params; it is
        deterministic, so every rank lays out the same buffers without communicating. Done
        once: see [Note: layout planned once] in layout/model_layout.py."""
        self._check_live()
        unknown = [p for p in whole_tensor_costs if p not in self._param_index]
        if unknown:
            raise ValueError(
                f"build_buffers got {len(unknown)} tensor(s) that are not trainable parameters "
                "of this model"
            )
        if self._flat_buffers is not None:
            if whole_tensor_costs != self._whole_tensor_costs:
                raise ValueError(
                    "the model's buffers are already laid out for other owners of whole "
                    f"tensors ({len(self._whole_tensor_costs)} params owned whole, the "
                    f"optimizer needs {len(whole_tensor_costs)}): they are laid out once, by "
                    "the first optimizer, backward or read of ddp.flat_buffers; build the "
                    "optimizer right after distopt.DistributedDataParallel(...), before the "
                    "first backward, and one optimizer per DDP"
                )
            return
        self._whole_tensor_costs = dict(whole_tensor_costs)
        planned = plan_model_layout(
            self._param_specs(self._whole_tensor_costs), grad_dtype=self.options.grad_dtype,
            bucket_size=self.bucket_size, dp_size=self.dp_size,
        )
        if self.options.shard_grads:
            overlaps = self.dp_size > 1 and self.options.overlap_grad_reduce
            self.grad_pools = grad_pools_for(planned.buffers, self._device, overlaps=overlaps)
        self._flat_buffers = [
            ParamAndGradBuffer(
                [self.params[i] for i in buf.param_indices],
                buf.layout,
                grad_dtype=buf.grad_dtype,
                dp_rank=self.dp_rank,
                group=self.process_group,
                replicate_group=self.parallel.replicate_group,
                reduce_scatter=self.options.use_distributed_optimizer,
                stats=self.comm_stats,
                fp32_accumulation=self.options.reduces_with_fp32_accumulation(buf.grad_dtype),
                check_local_grads=self.options.check_for_nan_in_grad,
                grad_pool=self.grad_pools.get(buf.grad_dtype),
            )
            for buf in planned.buffers
        ]
        self._buckets = [self._flat_buffers[b].buckets[k] for b, k in planned.launch_order]
        for order, bucket in enumerate(self._buckets):
            bucket.order = order
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._buffer_of = {p: buf for buf in self._flat_buffers for p in buf.params}
        self._param_wait_hooks = register_param_wait_hooks(
            self.module, self._bucket_of, lambda: self._gathers_in_flight)

    def _laid_out(self) -> list[ParamAndGradBuffer]:
        if self._flat_buffers is None:
            self.build_buffers({})
        assert self._flat_buffers is not None
        return self._flat_buffers

    @property
    def flat_buffers(self) -> list[ParamAndGradBuffer]:
        """One contiguous param and grad buffer per param dtype (lays them out if not yet)."""
        return self._laid_out()

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket of every buffer, in launch order (lays the buffers out if not yet)."""
        self._laid_out()
        return self._buckets

    @property
    def buffer_of(self) -> dict[nn.Parameter, ParamAndGradBuffer]:
        """The buffer that holds each param (lays the buffers out if not yet)."""
        self._laid_out()
        return self._buffer_of

    @property
    def whole_tensor_costs(self) -> dict[nn.Parameter, float]:
        """The params owned whole by one rank, with the cost their owners balance."""
        return dict(self._whole_tensor_costs)

    @classmethod
    def for_this_process(cls, module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """Wrap ``module`` for training on this process alone, without communication, even
        when torch.distributed is initialized (``BasicOptimizer`` over a plain module).
        ``kwargs`` are the other options of the constructor."""
        return cls(module, process_group=THIS_PROCESS, **kwargs)

    # ------------------------------------------------------------------ parallel layout

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (None for a single process)."""
        return self.parallel.dp_group

    @property
    def dp_size(self) -> int:
        return self.parallel.dp_size

    @property
    def dp_rank(self) -> int:
        return self.parallel.dp_rank

    @property
    def broadcast_buffers(self) -> bool:
        """Whether the first ranks' module buffers are broadcast before forwards, as torch DDP's
        attribute of that name says; see [Note: buffer broadcasting] in ddp/module_buffers.py."""
        return self.options.broadcast_buffers

    @property
    def tp_mesh(self) -> TensorParallelMesh | None:
        """The mesh of the DTensor params, None without them; see [Note: DTensor params]."""
        return self.parallel.tp

    # ------------------------------------------------------------------ forward / backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # See [Note: buffer broadcasting] in ddp/module_buffers.py.
        self._buffer_broadcast.before_forward()
        output = self.module(*args, **kwargs)
        self._buffer_broadcast.after_forward(grad_sync=self._sync_enabled)
        if self._gathers_in_flight:
            self.finish_param_sync()
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads in the buffer without reducing them (micro-batches). As with torch
        DDP, a forward inside may still broadcast module buffers (the first micro-batch's) and
        the forward after one run inside does not; see [Note: buffer broadcasting]."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _before_accumulate(self, param: nn.Parameter, _grad: torch.Tensor) -> None:
        # Tensor hook, before autograd accumulates into param.grad: the marker goes, so the
        # new grad is written as into an empty .grad; see [Note: p.grad under distopt].
        if not self._in_backward:
            self._start_backward()
        param.grad = None

    def _accumulate_grad(self, param: nn.Parameter) -> None:
        # Post-accumulate hook: move autograd's grad into the buffer and free it at once.
        grad = param.grad
        if grad is None:
            return
        if self._flat_buffers is None:  # a backward before any optimizer: element-wise layout
            self.build_buffers({})
        shard_grads = self.options.shard_grads
        bucket = self._bucket_of[param]
        if (self.dp_size > 1 or shard_grads) and self._reduction_started(bucket):
            param.grad = None  # so that the next backward, after zero_grad(), starts clean
            self._marked.discard(param)
            self._raise_late_grad(param, bucket)
        if param in self._dtensor_params:
            grad = local_grad(param, grad)
        bucket.add_grad(param, grad)
        marker = self._markers[param]
        marker.zeroed = False
        param.grad = marker
        self._marked.add(param)
        self._grad_sync_done = False
        if self.options.find_unused_parameters:
            self._used[self._param_index[param]] = 1
        # With sharded grads every backward reduces; see [Note: sharded grads].
        launches = self._sync_enabled or shard_grads
        if launches and self.options.overlap_grad_reduce and bucket.mark_ready(param):
            self._launch_ready_buckets()

    def _reduction_started(self, bucket: Bucket) -> bool:
        # See [Note: grads after the reduction]. A reduced bucket stays reduced until
        # zero_grad_buffer; only the all-reduce path may reduce it again, after a finished sync.
        # Sharded grads reduce each backward and add: only this backward's launches count.
        if self._grad_sync_done and not self.options.shard_grads:
            return self.options.use_distributed_optimizer
        return bucket.reduction_started

    def _raise_late_grad(self, param: nn.Parameter, bucket: Bucket) -> None:
        # Says which of the ways to get here this one is; see [Note: grads after the reduction].
        name = self.param_names[param]
        if self._grad_sync_done and not self.options.shard_grads:
            why = (
                "this step's grads were already reduced (optimizer.step() or "
                "ddp.finish_grad_sync() ran) and optimizer.zero_grad() was not called since: "
                "call optimizer.zero_grad() before the next step's first backward"
            )
        elif bucket.wrote(param) and self.options.shard_grads:
            why = (
                "its grad was accumulated twice in one backward, the second time after its "
                "bucket was reduced: run each parameter's backward once per backward (no "
                "reentrant activation checkpointing across a bucket: use_reentrant=False)"
            )
        elif bucket.wrote(param):
            why = (
                "it already had a grad this step, and its bucket was reduced since: accumulate "
                "micro-batches inside ddp.no_sync() (all but the last), and run each "
                "parameter's backward once per backward (no reentrant activation "
                "checkpointing across a bucket: use_reentrant=False)"
            )
        else:
            why = (
                "accumulate micro-batches inside ddp.no_sync() (all but the last), call "
                "optimizer.zero_grad() before the next step's first backward, and run each "
                "parameter's backward once per step (no reentrant activation checkpointing "
                "across a bucket)"
            )
        raise RuntimeError(
            f"parameter '{name}' got a gradient after its bucket's data-parallel reduction had "
            f"started, so it would be left out of the reduced gradient: {why}"
        )

    def _launch_ready_buckets(self) -> None:
        # Strictly in launch order; see [Note: bucket launch order].
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].ready:
            self._launch_next()
        # Second stages too, in the same order, as far as first stages have finished.
        while self._next_replica < self._next_launch and self._buckets[
            self._next_replica
        ].advance_reduction(block=False):
            self._next_replica += 1

    def _launch_next(self) -> None:
        # Sharded grads under no_sync skip the second stage; see [Note: sharded grads].
        self._buckets[self._next_launch].launch_reduction(replicate=self._sync_enabled)
        self._next_launch += 1

    def _start_backward(self) -> None:
        # The first grad of a backward. Grads cleared outside distopt (a zero_grad of the
        # wrapped module) start a new step; with sharded grads an earlier backward's reductions
        # finish first (their second stages keep the launch order on every rank). The end of
        # this backward is queued on the autograd engine.
        self._zero_if_cleared()
        self._in_backward = True
        if self.options.shard_grads:
            for bucket in self._buckets:
                bucket.wait_reduction()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _zero_if_cleared(self) -> None:
        # See [Note: p.grad under distopt]: torch's zero_grad on the module clears p.grad only.
        cleared = [p for p in self._marked
                   if p.grad is not self._markers[p] or self._markers[p].zeroed]
        if not cleared:
            return
        if len(cleared) == len(self._marked):
            self.zero_grad_buffer()
            return
        raise RuntimeError(
            f"the gradient of parameter '{self.param_names[cleared[0]]}' was cleared (p.grad "
            f"set to None or zeroed) but those of {len(self._marked) - len(cleared)} other "
            "parameters were not: distopt zeroes a step's gradients as a whole; call "
            "optimizer.zero_grad() (or zero_grad() of the whole model) before the step's first "
            "backward"
        )

    def _end_backward(self) -> None:
        self._in_backward = False
        if self.options.shard_grads:
            self._end_sharded_backward()

    def _end_sharded_backward(self) -> None:
        # See [Note: sharded grads]: every bucket reduces, and the next backward starts fresh.
        self._launch_ready_buckets()
        while self._next_launch < len(self._buckets):
            self._launch_next()
        for bucket in self._sharded_buckets:
            bucket.end_backward()
        self._next_launch = 0
        self._next_replica = 0

    @property
    def _sharded_buckets(self) -> list[ShardedGradBucket]:
        return [b for b in self._buckets if isinstance(b, ShardedGradBucket)]

    def _reset_reductions(self) -> None:
        for bucket in self._buckets:
            bucket.reset_reduction()
        self._next_launch = 0
        self._next_replica = 0  # the first bucket whose second stage is not started yet
        if self.options.find_unused_parameters:
            self._used = bytearray(len(self.params))
        self.unused_params = frozenset()

    # ------------------------------------------------------------------ grad sync

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet, in order, and wait for all reductions.

        Afterwards each rank's shard of ``grad_data`` (all of it without the distributed
        optimizer; ``grad_shards`` with sharded grads) holds the grads averaged over the group.
        Calling it again before the next backward does nothing.
        """
        self._check_live()
        if self._grad_sync_done:
            return
        if self.options.shard_grads and not self._in_backward:
            # Each backward launched every bucket at its end: only a step without one is left.
            for bucket in self._sharded_buckets:
                if not bucket.reduced_this_step:
                    bucket.launch_reduction()
        else:
            while self._next_launch < len(self._buckets):
                self._launch_next()
        for bucket in self._buckets:
            bucket.wait_reduction()
        if self.options.shard_grads:
            # Micro-batches reduced under no_sync only: their second stage, once, now.
            for bucket in self._sharded_buckets:
                bucket.replicate_if_needed()
            for bucket in self._buckets:
                bucket.wait_reduction()
            self._release_grad_pools()
        unused: frozenset[nn.Parameter] = frozenset()
        if self.options.find_unused_parameters:
            used = torch.tensor(list(self._used), dtype=torch.int32, device=self._device)
            # Over every data-parallel rank: replicas train on other data than their peers.
            comm.all_reduce_small(
                used, dist.ReduceOp.MAX, self.parallel.data_parallel_groups, self.comm_stats
            )
            unused = frozenset(p for p, u in zip(self.params, used.tolist(), strict=True) if not u)
        self._reset_reductions()
        self.unused_params = unused
        self._grad_sync_done = True
        if self.options.check_for_nan_in_grad:
            raise_on_nonfinite_grad(self._buckets, self.params, self.param_names,
                                    self._nan_check_groups, self.comm_stats)

    def zero_grad_buffer(self) -> None:
        """Start a new step's grads; call before its first backward.

        The next grad of each parameter replaces what the buffer holds, and a parameter that
        gets none counts as zero (see [Note: grads written, not zeroed]).
        """
        self._check_live()
        # Reductions launched but never waited for (a backward that raised before the step)
        # still write into the buffer and own their receive buffers: finish them first.
        for bucket in self._buckets:
            bucket.wait_reduction()
            bucket.forget_grads()
        for param in self._marked:
            param.grad = None
        self._marked.clear()
        self._reset_reductions()
        self._grad_sync_done = False
        self._in_backward = False  # a backward that raised never reached its end
        self._release_grad_pools()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new step's grads, as ``optimizer.zero_grad()`` does (torch's module method
        alone would clear only ``p.grad``, which holds no grads under distopt)."""
        self.zero_grad_buffer()
        super().zero_grad(set_to_none)

    def _release_grad_pools(self) -> None:
        # Nothing transient between steps; see [Note: sharded grads].
        for pool in self.grad_pools.values():
            pool.release()

    @property
    def _device(self) -> torch.device:
        return self.params[0].device

    # ------------------------------------------------------------------ param gather

    def start_param_sync(self, *, overlap: bool) -> None:
        """All-gather every bucket's params from the shards the optimizer updated.

        With ``overlap`` the gathers run in the background, first layers first, and each module
        waits for its own buckets in a forward pre-hook; see [Note: param gather] in
        ddp/param_gather.py.
        """
        self._check_live()
        self.finish_param_sync()
        # Always started together: without overlap one wait for all of them costs one round
        # trip instead of one per bucket (see [Note: collectives on gloo]).
        for bucket in reversed(self._buckets):
            bucket.start_gather(async_op=True)
        self._gathers_in_flight = True
        if not overlap:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every param gather still in flight."""
        self._gathers_in_flight = False
        for bucket in self._buckets:
            bucket.wait_gather()

    @property
    def param_gathers_in_flight(self) -> int:
        """How many buckets' param gathers are started and not yet waited for."""
        return sum(bucket.gather_in_flight for bucket in self._buckets)

    # ------------------------------------------------------------------ release

    def release(self) -> nn.Module:
        """Give the module back as a plain module holding its current values; return it.

        Waits for the collectives in flight, removes every hook this wrapper put on the module
        (each param's grad hook, the forward pre-hooks that wait for gathers), gives each param
        storage of its own (a copy of its current values, out of the param buffer) and drops
        its ``main_grad``; grads not yet reduced are dropped too. The module then trains like
        any other (under torch's DDP, a plain optimizer or a new distopt wrapper). This wrapper
        and its optimizer refuse to train afterwards, but still read: a checkpoint saved after
        the release holds the run as it ended. It communicates only to finish what is in
        flight, so ranks with reductions or gathers in flight release together; otherwise each
        rank may release on its own. Calling it again does nothing.

        Wrapping the module in a new ``DistributedDataParallel`` releases this one first; ``with
        DistributedDataParallel(module) as ddp:`` releases it when the block ends. See
        [Note: one wrapper per param] in ddp/param_owners.py.
        """
        self._release("ddp.release() was called")
        return self.module

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is None:
            self.release()
            return
        with contextlib.suppress(Exception):  # the error that ended the block is the one to see
            self.release()

    @property
    def released(self) -> bool:
        """Whether this wrapper let go of its module (``release``, or a newer wrapper)."""
        return self._released is not None

    def _release(self, reason: str) -> None:
        if self._released is not None:
            return
        # Nothing may still write into the buffers once the params stop being their views.
        for bucket in self._buckets:
            bucket.wait_reduction()
            bucket.wait_gather()
            bucket.forget_grads()
        self._gathers_in_flight = False
        self._reset_reductions()
        self._release_grad_pools()
        for handle in (*self._grad_hooks, *self._param_wait_hooks):
            handle.remove()
        self._grad_hooks, self._param_wait_hooks = [], []
        for param in self._marked:  # plain autograd would add the next grad to the marker
            param.grad = None
        self._marked.clear()
        laid_out = self._flat_buffers is not None
        with torch.no_grad():
            for param in self.params:
                if laid_out:  # the params are views into param_data
                    alias_local(param, local_tensor(param).detach().clone())
                if "main_grad" in param.__dict__:
                    del param.main_grad
        param_owners.disown(self.params, self)
        self._released = reason

    def _check_live(self) -> None:
        if self._released is not None:
            raise RuntimeError(
                f"this distopt.DistributedDataParallel no longer holds its module ({self._released}"
                "): it and its optimizer cannot train it any more; train with the wrapper that "
                "holds the module now, or wrap the module in a new DistributedDataParallel and "
                "build a new optimizer over it"
            )
