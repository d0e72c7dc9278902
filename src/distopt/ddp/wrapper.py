"""DistributedDataParallel: the public wrapper of the data-parallel runtime.

It builds what a step needs, in one direction, when it is constructed, in the stages of
ddp/construction.py: the inputs checked, the process groups, the layout planned and the model
checked across ranks, the buffers laid out (element-wise, or for the owners of whole tensors it
is told), the grad sync over their buckets (ddp/grads/grad_sync.py), and the hooks that feed it.
The optimizer then checks that layout and uses it ([Note: layout planned once] in
layout/model_layout.py). The wrapper itself runs the forward (module buffers, waits for param
gathers), ``no_sync``, the param gathers after a step, and ``release()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.experts import ExpertParallel
from ..parallel.process_groups import THIS_PROCESS
from ..parallel.tensor_parallel import TensorParallelMesh
from ..sharding import Sharding
from .buffer_layout import BufferLayout
from .construction import (
    adopt,
    build_buffers,
    check_inputs,
    materialize_meta,
    plan_and_agree,
    resolve_groups,
    take_over,
    wire_hooks,
)
from .params.gather_units import GatherUnitPolicy
from .params.whole_module import WholeModule
from .stage_methods import PipelineStageMethods
from .torch_compat.torch_ddp_methods import TorchDDPMethods
from .torch_compat.wrapper_copy import NotCopied

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..comm.collectives import CommStats
    from ..options import GradSyncOptions
    from ..parallel.experts import ExpertParams
    from ..parallel.process_groups import ParallelGroups
    from .params.gather_units import GatherUnit


class DistributedDataParallel(BufferLayout, TorchDDPMethods, WholeModule, PipelineStageMethods,
                              NotCopied, nn.Module):
    """Data parallelism over contiguous, bucketed param and grad buffers.

    Args:
        module: the model, already on its device and in its dtype.
        process_group: the data-parallel group; None means the default group (or a single
            process when torch.distributed is not initialized).
        grad_dtype: dtype of the grad buffer and of the reduction; None means each
            parameter's own dtype.
        bucket_size: elements per bucket; None picks ``default_bucket_size`` of
            layout/elementwise.py (about a quarter of the model, or half of it on gloo), and
            with ``shard_params`` at most a quarter of the largest gather unit: smaller buckets
            start reducing sooner and hold fewer bytes in flight.
        overlap_grad_reduce: start each bucket's reduction during backward, as soon as its
            last grad is accumulated, instead of in ``finish_grad_sync``.
        use_distributed_optimizer: reduce-scatter buckets (for DistributedOptimizer); False
            all-reduces them (for BasicOptimizer).
        find_unused_parameters: track which parameters got a grad on any rank; parameters
            that got none anywhere are left out of the optimizer step, as torch.optim skips
            parameters whose ``.grad`` is None. Costs one small all-reduce per step. When
            False, as in torch DDP, a parameter that got no grad in a step is an error at
            the step, before any parameter moves.
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
            see docs/tensor-parallel.md. A "pp" dimension makes the module one pipeline stage:
            grad statistics span the stages; see docs/pipeline.md.
        shard_grads: keep only this rank's shard of the reduced grads between steps, each
            bucket's full grads only from its first grad until its reduction is waited for,
            in a small pool of bucket-sized buffers (``grad_pools``). Every backward then
            reduces, inside ``no_sync()`` too. Needs the distributed optimizer. See
            [Note: sharded grads] in ddp/buffers/grad_pool.py.
        shard_params: keep only this rank's shard of the params too (ZeRO-3, FSDP's
            sharding): each gather unit's params are all-gathered before its forward and its
            backward and freed after them. Implies ``shard_grads``. A model built on the meta
            device is materialized into the shards here. See [Note: sharded params] in
            ddp/buffers/param_storage.py and [Note: meta-device models] in
            ddp/params/materialize.py.
        reshard_after_forward: with ``shard_params``, free a unit's params after its forward
            and gather them again for its backward (True, the default: least memory), or keep
            them gathered until their grads are in (False: one all-gather per step instead of
            two, and every unit's params held from its forward to its backward).
        gather_units: with ``shard_params``, which modules are gathered as one: None (the
            model's repeated blocks: children of an ``nn.ModuleList`` or ``nn.Sequential`` of
            at least a million elements), an ``nn.Module`` class or tuple of classes (every
            instance, as one ``fully_shard`` per block), or a callable ``(module) -> bool``.
            Other params are gathered around the modules that register them. See
            [Note: gather units] in ddp/params/gather_units.py.
        broadcast_buffers: as torch DDP's: before a forward, broadcast the module's buffers
            (BatchNorm's running statistics) from the first data-parallel rank to the others
            (over the replicas of a hierarchical mesh too, never across tensor-parallel
            ranks), one broadcast per buffer dtype; the forwards that broadcast are torch's:
            the first, and each one after a forward with grad enabled outside ``no_sync()``.
            False: no broadcast, not even at construction; each rank keeps its own buffers.
            ``nn.SyncBatchNorm`` layers without a ``process_group`` are given the
            data-parallel group either way. See [Note: buffer broadcasting] in
            ddp/module_buffers.py.
        sharding: how much each rank holds a shard of, in one word: "optim" (the default:
            optimizer state and fp32 main params), "optim_grads" (grads too: the same as
            ``shard_grads=True``) or "none" (nothing: all-reduced grads, the same as
            ``use_distributed_optimizer=False``). See [Note: sharding strategy] in sharding.py.
        whole_tensor_params: the params an optimizer will step whole (Muon, Adafactor), each
            with its optimizer class, so that the buffers are laid out for their owners now;
            without it an optimizer with such groups lays them out again before the first
            backward (a transient second param buffer). See [Note: layout planned once].
        tied_params: on a pipeline stage, ``{name: param}`` for its params that hold a weight
            of another stage too (embedding and head), named after it; see
            [Note: tied stage params] in optim/tied.py.
        experts: a mixture of experts' experts and their mesh,
            ``distopt.ExpertParallel(mesh, modules)``: their params go into buffers of their
            own, reduce-scattered and gathered over the expert-data-parallel group
            (``mesh["dp"]``) with grads averaged over every token of the batch; the dense params
            are data-parallel over every rank of the mesh. See "Experts" in docs/design.md
            and [Note: expert parallelism] in parallel/experts.py.
        ft_manager: a ``torchft.Manager`` over this rank's replica group, whose ranks are
            ``process_group`` (the shard group): the replica groups then average their grads
            over the Manager's process group, each step committed only where its quorum
            agrees, and a group that fails leaves the quorum while the others go on; one that
            comes back heals from a healthy group's same shard. Build the Manager with
            ``use_async_quorum=False`` and no state functions (the optimizer registers its
            own). See docs/fault-tolerance.md and [Note: fault-tolerant replicas] in
            parallel/managed_replicas.py.
        device_ids: torch DDP's devices of the module, with torch's rule for a module on one
            device: None (the default, right for any module) or, for a CUDA module, ``[its
            device]`` (an index or a ``torch.device``); a list for a CPU module, several
            devices, or a device other than the module's are refused. Keyword only: distopt's
            second positional argument is ``process_group``.
        output_device: torch DDP's device of the outputs: None or the module's device; the
            outputs stay where the module puts them.
        dim: torch DDP's dimension along which inputs are split over a process's devices:
            only 0, the default, since one process drives one device and nothing is split.
        init_sync: as torch DDP's: True (the default) broadcasts the first data-parallel
            rank's params, and with ``broadcast_buffers`` its buffers, at construction, so that
            every replica starts alike; False keeps each rank's own weights (already equal,
            e.g. from one seed or one checkpoint).
        bucket_cap_mb: torch DDP's bucket size, in MiB of grads: the buckets then hold
            ``bucket_cap_mb * 2**20`` bytes of grads in ``grad_dtype`` (of the widest param
            dtype with ``grad_dtype=None``); positive; give it or ``bucket_size``, not both.
            None: ``bucket_size`` decides.
        static_graph: accepted for torch scripts and kept as an attribute; it changes
            nothing, since distopt's hooks do not depend on the graph being the same each step.
        gradient_as_bucket_view: accepted for torch scripts and kept as an attribute; it
            changes nothing, since distopt's grads always live in the buckets (``p.grad`` is a
            marker, [Note: p.grad under distopt] in ddp/grads/grad_marker.py).
        check_reduction: accepted for torch scripts (deprecated in torch); it changes
            nothing.
        **torch_only: torch DDP's other keyword arguments: its experimental ones
            (``mixed_precision``, ``delay_all_reduce_named_params``,
            ``param_to_hook_all_reduce``, ``skip_all_reduce_unused_params``) are refused by
            name, naming distopt's way to the same end, and any other name is a TypeError.

    torch's ignore list (``_set_params_and_buffers_to_ignore_for_model``) leaves those params
    and buffers local to each rank, as torch DDP does. See [Note: torch DDP's spellings] in
    ddp/torch_compat/torch_spellings.py.
    """

    # What the stages of ddp/construction.py leave on the wrapper for distopt to read (adopt;
    # build_buffers and _lay_out in ddp/buffer_layout.py add the buffers and the grad sync).
    module: nn.Module
    options: GradSyncOptions
    parallel: ParallelGroups
    experts: ExpertParams | None
    comm_stats: CommStats
    params: list[nn.Parameter]  # registration order
    param_names: dict[nn.Parameter, str]
    tied_params: dict[nn.Parameter, str]
    bucket_size: int
    gather_units: list[GatherUnit]
    ignored_names: frozenset[str]

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
        shard_params: bool = False,
        reshard_after_forward: bool = True,
        gather_units: GatherUnitPolicy = None,
        broadcast_buffers: bool = True,
        sharding: str | Sharding | None = None,
        whole_tensor_params: Mapping[nn.Parameter, type[torch.optim.Optimizer]] | None = None,
        tied_params: Mapping[str, nn.Parameter] | None = None,
        experts: ExpertParallel | None = None,
        ft_manager: Any = None,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        init_sync: bool = True,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        check_reduction: bool = False,
        **torch_only: Any,
    ) -> None:
        super().__init__()
        # The stages of ddp/construction.py, in order; every refusal is raised on every rank
        # before the first collective, the model check at the end of plan_and_agree.
        wrapper = DistributedDataParallel
        inputs = check_inputs(
            module, process_group, torch_only, wrapper=wrapper, bucket_size=bucket_size,
            bucket_cap_mb=bucket_cap_mb, gather_units=gather_units, static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view, options=dict(
                grad_dtype=grad_dtype, overlap_grad_reduce=overlap_grad_reduce,
                use_distributed_optimizer=use_distributed_optimizer,
                find_unused_parameters=find_unused_parameters,
                check_for_nan_in_grad=check_for_nan_in_grad,
                reduce_scatter_with_fp32_accumulation=reduce_scatter_with_fp32_accumulation,
                shard_grads=shard_grads, shard_params=shard_params,
                reshard_after_forward=reshard_after_forward, sharding=sharding,
                broadcast_buffers=broadcast_buffers))
        groups = resolve_groups(
            module, inputs, wrapper=wrapper, process_group=process_group,
            device_mesh=device_mesh, experts=experts, ft_manager=ft_manager,
            device_ids=device_ids, output_device=output_device, dim=dim)
        plan = plan_and_agree(module, inputs, groups, tied_params=tied_params,
                              whole_tensor_params=whole_tensor_params, gather_units=gather_units)
        adopt(self, module, inputs, groups, plan)
        take_over(self, init_sync=init_sync)
        build_buffers(self, plan.whole_costs)
        materialize_meta(self, inputs.meta)
        wire_hooks(self, wrapper)

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
        """Run the module, broadcasting its buffers first as torch DDP does and, with sharded
        params, gathering each unit's params around its forward; return its output.

        Args:
            *args: the module's positional inputs, passed on unchanged (nothing is split or
                moved: each process feeds its own batch, on the module's device).
            **kwargs: the module's keyword inputs, passed on unchanged.
        """
        self._frozen_at_wrapping.check()  # see [Note: params frozen after wrapping]
        if self._unsharder is not None:  # see [Note: every rank runs every forward]
            self._unsharder.check_forward(self.training)
        elif self._rebound is not None:
            # See [Note: params rebound] in ddp/buffers/rebound_params.py.
            self._rebound.glance()
        # See [Note: buffer broadcasting] in ddp/module_buffers.py.
        self._buffer_broadcast.before_forward()
        if self._unsharder is not None:  # see [Note: where a param is used]
            output = self._unsharder.forward(lambda: self.module(*args, **kwargs))
        else:
            output = self.module(*args, **kwargs)
        self._buffer_broadcast.after_forward(grad_sync=self._grad_sync.sync_enabled)
        if self._gathers_in_flight:
            self.finish_param_sync()
        return output

    def _before_accumulate(self, param: nn.Parameter, _grad: torch.Tensor) -> None:
        # Tensor hook, before autograd accumulates into param.grad; see
        # [Note: p.grad under distopt] in ddp/grads/grad_marker.py.
        self._backward_seen = True
        self._grad_sync.before_accumulate(param)

    def _accumulate_grad(self, param: nn.Parameter) -> None:
        # Post-accumulate hook: move autograd's grad into the buffer and free it at once.
        self._grad_sync.accumulate(param)

    # ------------------------------------------------------------------ grad sync

    def finish_grad_sync(self) -> None:
        """Launch every bucket not launched yet, in order, and wait for all reductions.

        Afterwards each rank's shard of ``grad_data`` (all of it without the distributed
        optimizer; ``grad_shards`` with sharded grads) holds the grads averaged over the group.
        Calling it again before the next backward does nothing.
        """
        self._check_live()
        self._grad_sync.finish()

    def zero_grad_buffer(self, *, set_to_none: bool = True) -> None:
        """Start a new step's grads; call before its first backward.

        The next grad of each parameter replaces what the buffer holds, and a parameter that
        gets none counts as zero (see [Note: grads written, not zeroed] in ddp/grads/grad_sync.py).
        Not ``set_to_none``: each ``p.grad`` there reads zeros until the next backward.
        """
        self._check_live()
        self._grad_sync.zero_grad_buffer(set_to_none=set_to_none)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new step's grads, as ``optimizer.zero_grad()`` does (torch's module method
        alone would clear only ``p.grad``, which holds no grads under distopt).

        Args:
            set_to_none: as torch's module method: each ``p.grad`` is set to None (True, the
                default) or zeroed. For the params in the buffers either clears their markers
                ([Note: p.grad under distopt] in ddp/grads/grad_marker.py); for those of torch's
                ignore list it is their local grad. The buffers stay allocated either way.
        """
        self.zero_grad_buffer(set_to_none=set_to_none)
        super().zero_grad(set_to_none)

    @property
    def _device(self) -> torch.device:
        return self._target_device

    # ------------------------------------------------------------------ param gather

    def start_param_sync(self, *, overlap: bool) -> None:
        """All-gather every bucket's params from the shards the optimizer updated.

        With ``overlap`` the gathers run in the background, first layers first, and each module
        waits for its own buckets in a forward pre-hook; see [Note: param gather] in
        ddp/params/param_gather.py.
        """
        self._check_live()
        if self._unsharder is not None:
            # Gathered params are stale once the optimizer updated the shards; the next
            # forward gathers them again ([Note: sharded params]).
            self._unsharder.release_all()
            return
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
