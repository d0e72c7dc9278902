"""DistributedDataParallel: contiguous buffers, gradient hooks and bucket collectives.

[Note: bucket launch order]
Collectives on one process group must be issued in the same order on every rank. Buckets are
therefore launched strictly in one fixed order (the layout order, which follows backward): when
a bucket's last grad arrives, it is launched only if every bucket before it has been, and then
every following bucket that is ready goes with it. A bucket holding a parameter that got no
grad in this backward (unused on this rank, or used only on others) simply waits for
``finish_grad_sync``, which launches whatever is left. Nothing depends on which parameters each
rank happened to use, so nothing can hang or mismatch.

[Note: param gather]
After the optimizer updated its shard, each bucket's ``param_data`` is all-gathered from the
shards. With ``overlap_param_gather`` the gathers are started asynchronously (the first layers'
buckets first) and each module waits, in a forward pre-hook, only for the buckets of its own
parameters. Anything still in flight when the wrapped forward returns is waited for, so a
parameter read outside a module's own forward (a tied head) is never stale afterwards.

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
and grads simply accumulate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from . import collectives as comm
from .buckets import Bucket, ParamAndGradBuffer
from .dtensor import is_dtensor, local_grad, local_tensor
from .layout import TARGET_BUCKETS, TARGET_BUCKETS_GLOO, default_bucket_size
from .options import GradSyncOptions
from .parallel import ParallelLayout, resolve_dp_groups
from .tensor_parallel import TensorParallelMesh, check_params, stat_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_THIS_PROCESS = object()  # process_group of for_this_process(): no group, even under dist


def _resolve_group(process_group: Any) -> dist.ProcessGroup | None:
    if process_group is _THIS_PROCESS:
        return None
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class DistributedDataParallel(nn.Module):
    """Data parallelism over contiguous, bucketed param and grad buffers.

    Args:
        module: the model, already on its device and in its dtype.
        process_group: the data-parallel group; None means the default group (or a single
            process when torch.distributed is not initialized).
        grad_dtype: dtype of the grad buffer and of the reduction; None means each
            parameter's own dtype.
        bucket_size: elements per bucket; None picks ``layout.default_bucket_size`` (about a
            quarter of the model, or half of it on gloo).
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
            [Note: fp32-accumulated reduce-scatter] in collectives.py.
        device_mesh: the data-parallel group as a mesh instead of ``process_group`` (give at
            most one): a 1-D mesh, or a mesh with a dimension named "dp". Params may be DTensors
            on the tensor-parallel submesh (``parallelize_module(module, mesh["tp"], plan)``);
            see docs/tensor-parallel.md.
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
    ) -> None:
        super().__init__()
        named = _trainable_named_params(module)
        self.options = GradSyncOptions(
            grad_dtype=grad_dtype,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            find_unused_parameters=find_unused_parameters,
            check_for_nan_in_grad=check_for_nan_in_grad,
            reduce_scatter_with_fp32_accumulation=reduce_scatter_with_fp32_accumulation,
        )
        self.options.check_param_dtypes({p.dtype for _, p in named})

        self.module = module
        dp_group, replicate_group = resolve_dp_groups(process_group, device_mesh)
        dp_group = _resolve_group(dp_group)
        # The TP mesh is None without DTensor params; check_params raises (on every rank, before
        # any collective) on a DTensor layout distopt cannot compose with. See
        # [Note: DTensor params].
        self.parallel = ParallelLayout.of(
            dp_group, check_params(named, dp_group), replicate_group
        )
        # Over the TP groups too, so that every rank of the mesh raises, or none does.
        self._nan_check_groups = [self.process_group, *stat_groups(self.tp_mesh)]
        self.comm_stats = comm.CommStats()

        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        self.params: list[nn.Parameter] = [p for _, p in named]  # registration order
        self._param_index = {p: i for i, p in enumerate(self.params)}
        total = sum(local_tensor(p).numel() for p in self.params)
        target = TARGET_BUCKETS_GLOO if comm.is_gloo(self.process_group) else TARGET_BUCKETS
        self.bucket_size = self.options.bucket_size or default_bucket_size(
            self.dp_size, total, target_buckets=target
        )

        # Torch DDP semantics: every replica starts from rank 0's weights.
        self._broadcast_from_first_rank(module)

        self._whole_tensor_costs: dict[nn.Parameter, float] = {}
        self._param_wait_hooks: list[Any] = []
        self._build_buffers()
        # Only these params need their DTensor grads turned into local ones in the hook.
        self._dtensor_params = frozenset(p for p in self.params if is_dtensor(p))

        self._sync_enabled = True
        self._grad_sync_done = False
        self._next_launch = 0  # the first bucket of the launch order not launched yet
        self._next_replica = 0  # the first bucket whose second stage is not started yet
        self._used = bytearray(len(self.params))  # with find_unused_parameters
        self.unused_params: frozenset[nn.Parameter] = frozenset()
        self._gathers_in_flight = False
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate_grad) for p in self.params
        ]

    def _build_buffers(self) -> None:
        """(Re)build the buffers, buckets and launch order for ``_whole_tensor_costs``."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in reversed(self.params):  # reverse registration ~ the order backward runs
            by_dtype.setdefault(p.dtype, []).append(p)
        self.flat_buffers: list[ParamAndGradBuffer] = [
            self._make_buffer(plist, self.options.grad_dtype or dtype)
            for dtype, plist in by_dtype.items()
        ]
        self.buffer_of: dict[nn.Parameter, ParamAndGradBuffer] = {
            p: buf for buf in self.flat_buffers for p in buf.params
        }
        # One launch order over the buckets of all dtypes: by the backward position of the
        # param that completes each bucket (its last), then of its first. See
        # [Note: bucket launch order].
        reverse_position = {p: i for i, p in enumerate(reversed(self.params))}
        self.buckets: list[Bucket] = sorted(
            (b for buf in self.flat_buffers for b in buf.buckets),
            key=lambda b: (reverse_position[b.params[-1]], reverse_position[b.params[0]]),
        )
        for order, bucket in enumerate(self.buckets):
            bucket.order = order
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for hook in self._param_wait_hooks:
            hook.remove()
        self._param_wait_hooks = self._register_param_wait_hooks(self.module)

    def own_whole(self, costs: dict[nn.Parameter, float]) -> None:
        """Lay the buffers out so that each param in ``costs`` is owned whole by one
        data-parallel rank, the owners balancing the summed costs; every other param keeps
        element-wise shards. See [Note: whole-tensor layout] in whole_layout.py.

        ``DistributedOptimizer`` calls this for the params of its whole-tensor optimizers
        (Muon, Adafactor; see [Note: optimizer kinds]); it is deterministic, so every rank
        lays out the same buffers without communicating. The params keep their values; call
        it before the first backward (grads already in the buffers would be lost).
        """
        unknown = [p for p in costs if p not in self._param_index]
        if unknown:
            raise ValueError(
                f"own_whole got {len(unknown)} tensor(s) that are not trainable parameters of "
                "this model"
            )
        if costs == self._whole_tensor_costs:
            return
        if any(bucket.has_grads for bucket in self.buckets):
            raise RuntimeError(
                "the grad buffers already hold this step's grads, which a new layout would "
                "lose: build the optimizer before the first backward, or call "
                "optimizer.zero_grad() (or ddp.zero_grad_buffer()) first"
            )
        self.finish_param_sync()
        for bucket in self.buckets:
            bucket.wait_reduction()
        self._whole_tensor_costs = dict(costs)
        self._build_buffers()
        self._reset_reductions()

    @property
    def whole_tensor_costs(self) -> dict[nn.Parameter, float]:
        """The params owned whole by one rank, with the cost their owners balance."""
        return dict(self._whole_tensor_costs)

    def _make_buffer(
        self, params: list[nn.Parameter], grad_dtype: torch.dtype
    ) -> ParamAndGradBuffer:
        whole = self._whole_tensor_costs
        return ParamAndGradBuffer(
            params,
            whole_costs=[whole.get(p) for p in params] if whole else None,
            grad_dtype=grad_dtype,
            bucket_size=self.bucket_size,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            group=self.process_group,
            replicate_group=self.parallel.replicate_group,
            reduce_scatter=self.options.use_distributed_optimizer,
            stats=self.comm_stats,
            fp32_accumulation=self.options.reduces_with_fp32_accumulation(grad_dtype),
        )

    # The options as read-only attributes; ``self.options`` holds them.
    overlap_grad_reduce = property(lambda self: self.options.overlap_grad_reduce)
    use_distributed_optimizer = property(lambda self: self.options.use_distributed_optimizer)
    find_unused_parameters = property(lambda self: self.options.find_unused_parameters)
    check_for_nan_in_grad = property(lambda self: self.options.check_for_nan_in_grad)

    @classmethod
    def for_this_process(cls, module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
        """Wrap ``module`` for training on this process alone, without communication, even
        when torch.distributed is initialized (``BasicOptimizer`` over a plain module).
        ``kwargs`` are the other options of the constructor."""
        return cls(module, process_group=_THIS_PROCESS, **kwargs)

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
    def tp_mesh(self) -> TensorParallelMesh | None:
        """The mesh of the DTensor params, None without them; see [Note: DTensor params]."""
        return self.parallel.tp

    # ------------------------------------------------------------------ forward / backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        if self._gathers_in_flight:
            self.finish_param_sync()
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads in the buffer without any communication (micro-batches)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _accumulate_grad(self, param: nn.Parameter) -> None:
        # Post-accumulate hook: move autograd's grad into the buffer and free it at once.
        grad = param.grad
        if grad is None:
            return
        bucket = self._bucket_of[param]
        if self.dp_size > 1 and self._reduction_started(bucket):
            param.grad = None  # so that the next backward, after zero_grad(), starts clean
            self._raise_late_grad(param)
        if param in self._dtensor_params:
            grad = local_grad(param, grad)
        bucket.add_grad(param, grad)
        param.grad = None
        self._grad_sync_done = False
        if self.options.find_unused_parameters:
            self._used[self._param_index[param]] = 1
        if self._sync_enabled and self.options.overlap_grad_reduce and bucket.mark_ready(param):
            self._launch_ready_buckets()

    def _reduction_started(self, bucket: Bucket) -> bool:
        # See [Note: grads after the reduction]. A reduced bucket stays reduced until
        # zero_grad_buffer; only the all-reduce path may reduce it again, after a finished sync.
        if self._grad_sync_done:
            return self.options.use_distributed_optimizer
        return bucket.reduction_started

    def _raise_late_grad(self, param: nn.Parameter) -> None:
        raise RuntimeError(
            f"parameter '{self.param_names[param]}' got a gradient after its bucket's "
            "data-parallel reduction had started, so it would be left out of the reduced "
            "gradient; accumulate micro-batches inside ddp.no_sync() (all but the last), call "
            "optimizer.zero_grad() before the next step's first backward, and run each "
            "parameter's backward once per step (no reentrant activation checkpointing across "
            "a bucket)"
        )

    def _launch_ready_buckets(self) -> None:
        # Strictly in launch order; see [Note: bucket launch order].
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch_next()
        # Second stages too, in the same order, as far as first stages have finished.
        while self._next_replica < self._next_launch and self.buckets[
            self._next_replica
        ].advance_reduction(block=False):
            self._next_replica += 1

    def _launch_next(self) -> None:
        self.buckets[self._next_launch].launch_reduction()
        self._next_launch += 1

    def _reset_reductions(self) -> None:
        for bucket in self.buckets:
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
        optimizer) holds the grads averaged over the group. Calling it again before the next
        backward does nothing.
        """
        if self._grad_sync_done:
            return
        while self._next_launch < len(self.buckets):
            self._launch_next()
        for bucket in self.buckets:
            bucket.wait_reduction()
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
            self._raise_on_nonfinite_grad()

    def zero_grad_buffer(self) -> None:
        """Start a new step's grads; call before its first backward.

        The next grad of each parameter replaces what the buffer holds, and a parameter that
        gets none counts as zero (see [Note: grads written, not zeroed]).
        """
        # Reductions launched but never waited for (a backward that raised before the step)
        # still write into the buffer and own their receive buffers: finish them first.
        for bucket in self.buckets:
            bucket.wait_reduction()
            bucket.forget_grads()
        self._reset_reductions()
        self._grad_sync_done = False

    @property
    def _device(self) -> torch.device:
        return self.params[0].device

    def _raise_on_nonfinite_grad(self) -> None:
        first_bad = len(self.params)
        for bucket in self.buckets:
            for param in bucket.nonfinite_params():
                first_bad = min(first_bad, self._param_index[param])
        flag = torch.tensor([first_bad], dtype=torch.int64, device=self._device)
        comm.all_reduce_small(flag, dist.ReduceOp.MIN, self._nan_check_groups, self.comm_stats)
        index = int(flag.item())
        if index < len(self.params):
            name = self.param_names[self.params[index]]
            raise FloatingPointError(
                f"nan or inf in the gradient of parameter '{name}' after the data-parallel "
                "reduction; lower the learning rate, check the inputs, or use fp16 with a loss "
                "scaler (which skips such steps) instead of check_for_nan_in_grad"
            )

    # ------------------------------------------------------------------ param gather

    def start_param_sync(self, *, overlap: bool) -> None:
        """All-gather every bucket's params from the shards the optimizer updated.

        With ``overlap`` the gathers run in the background, first layers first, and each module
        waits for its own buckets in a forward pre-hook; see [Note: param gather].
        """
        self.finish_param_sync()
        # Always started together: without overlap one wait for all of them costs one round
        # trip instead of one per bucket (see [Note: collectives on gloo]).
        for bucket in reversed(self.buckets):
            bucket.start_gather(async_op=True)
        self._gathers_in_flight = True
        if not overlap:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every param gather still in flight."""
        self._gathers_in_flight = False
        for bucket in self.buckets:
            bucket.wait_gather()

    @property
    def param_gathers_in_flight(self) -> int:
        """How many buckets' param gathers are started and not yet waited for."""
        return sum(bucket.gather_in_flight for bucket in self.buckets)

    def _register_param_wait_hooks(self, module: nn.Module) -> list[Any]:
        hooks = []
        for submodule in module.modules():
            buckets = sorted(
                {self._bucket_of[p] for p in submodule.parameters(recurse=False)
                 if p in self._bucket_of},
                key=lambda b: b.order,
            )
            if buckets:
                hooks.append(submodule.register_forward_pre_hook(self._make_wait_hook(buckets)))
        return hooks

    def _make_wait_hook(self, buckets: list[Bucket]):
        def wait_for_params(_module: nn.Module, _args: Any) -> None:
            if self._gathers_in_flight:
                for bucket in buckets:
                    bucket.wait_gather()

        return wait_for_params

    def _broadcast_from_first_rank(self, module: nn.Module) -> None:
        # Replicate group first, then shard group: every rank ends with the values of the rank
        # at coordinate 0 of both.
        tensors = list(module.parameters()) + list(module.buffers())
        for group in reversed(self.parallel.data_parallel_groups):
            if comm.group_size(group) == 1:
                continue
            src = dist.get_global_rank(group, 0)
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(local_tensor(tensor.data), src=src, group=group)


def _trainable_named_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Validate the module and return its trainable params (shared ones once)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(
            f"the module is already wrapped in {type(module).__module__}."
            f"{type(module).__name__}; pass the bare module to distopt.DistributedDataParallel"
        )
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the module has no trainable parameters (all are frozen or absent)")
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices ({', '.join(devices)}); distopt keeps one "
            "contiguous buffer per dtype, so move the whole module to one device first "
            "(module.to(device))"
        )
    for name, p in named:
        if type(local_tensor(p.data)) is not torch.Tensor or p.is_sparse:
            raise TypeError(
                f"parameter '{name}' is a {type(p.data).__name__}; distopt buffers hold dense "
                "local tensors only"
            )
        if not p.is_floating_point():
            raise TypeError(f"parameter '{name}' has non-floating dtype {p.dtype}")
    return named
