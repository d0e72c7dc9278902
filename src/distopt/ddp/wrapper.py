"""DistributedDataParallel: the public wrapper of the data-parallel runtime.

It builds what a step needs, in one direction, when it is constructed: the process groups, the
cross-rank check of the model, the buffers laid out (element-wise, or for the owners of whole
tensors it is told), the grad sync over their buckets (ddp/grad_sync.py), and the hooks that
feed it. The optimizer then checks that layout and uses it ([Note: layout planned once] in
layout/model_layout.py). The wrapper itself runs the forward (module buffers, waits for param
gathers), ``no_sync``, the param gathers after a step, and ``release()``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..cross_rank.model import check_same_model
from ..cross_rank.stages import stages_agree
from ..host_memory import keep_heap_from_stranding
from ..layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO
from ..layout.model_layout import resolve_bucket_size
from ..options import GradSyncOptions
from ..parallel.dtensor import is_dtensor
from ..parallel.experts import ExpertParallel, ExpertParams
from ..parallel.managed_replicas import managed_replicas_for
from ..parallel.process_groups import THIS_PROCESS, ParallelGroups, resolve_dp_groups, resolve_group
from ..parallel.tensor_parallel import TensorParallelMesh, check_params
from ..sharding import Sharding
from . import param_owners, torch_dcp, torch_spellings
from .buffer_layout import BufferLayout
from .gather_units import (
    GatherUnit,
    GatherUnitPolicy,
    plan_gather_units,
    unit_bucket_size,
    unit_index_of,
)
from .materialize import check_materializable, has_meta_tensors, materialize_shards, target_device
from .module_buffers import BufferBroadcast, adopt_sync_batchnorm_group
from .module_hooks import ModuleHook
from .module_params import broadcast_initial_weights, trainable_named_params
from .param_placeholder import name_params
from .param_unshard import ParamUnsharder
from .stage_methods import PipelineStageMethods, guard_torch_pipeline_stages
from .tied import resolve_tied_params
from .torch_ddp_methods import TorchDDPMethods
from .trainable import FrozenAtWrapping
from .whole_module import WholeModule
from .whole_tensor_params import costs_of_classes
from .wrapper_copy import NotCopied

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
            [Note: sharded grads] in ddp/grad_pool.py.
        shard_params: keep only this rank's shard of the params too (ZeRO-3, FSDP's
            sharding): each gather unit's params are all-gathered before its forward and its
            backward and freed after them. Implies ``shard_grads``. A model built on the meta
            device is materialized into the shards here. See [Note: sharded params] in
            ddp/param_storage.py and [Note: meta-device models] in ddp/materialize.py.
        reshard_after_forward: with ``shard_params``, free a unit's params after its forward
            and gather them again for its backward (True, the default: least memory), or keep
            them gathered until their grads are in (False: one all-gather per step instead of
            two, and every unit's params held from its forward to its backward).
        gather_units: with ``shard_params``, which modules are gathered as one: None (the
            model's repeated blocks: children of an ``nn.ModuleList`` or ``nn.Sequential`` of
            at least a million elements), an ``nn.Module`` class or tuple of classes (every
            instance, as one ``fully_shard`` per block), or a callable ``(module) -> bool``.
            Other params are gathered around the modules that register them. See
            [Note: gather units] in ddp/gather_units.py.
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
            marker, [Note: p.grad under distopt] in ddp/grad_marker.py).
        check_reduction: accepted for torch scripts (deprecated in torch); it changes
            nothing.
        **torch_only: torch DDP's other keyword arguments: its experimental ones
            (``mixed_precision``, ``delay_all_reduce_named_params``,
            ``param_to_hook_all_reduce``, ``skip_all_reduce_unused_params``) are refused by
            name, naming distopt's way to the same end, and any other name is a TypeError.

    torch's ignore list (``_set_params_and_buffers_to_ignore_for_model``) leaves those params
    and buffers local to each rank, as torch DDP does. See [Note: torch DDP's spellings] in
    ddp/torch_spellings.py.
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
        # torch DDP's own arguments, each with torch's meaning or refused naming what works;
        # see [Note: torch DDP's spellings] in ddp/torch_spellings.py.
        torch_spellings.positional_device_ids(process_group)
        torch_spellings.check_refused(torch_only)
        self.static_graph = static_graph  # nothing depends on it; kept for torch's readers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        ignored = torch_spellings.ignored_names(module)
        named = trainable_named_params(
            module, (DistributedDataParallel, nn.parallel.DistributedDataParallel), ignored)
        self.ignored_names = ignored
        bucket_size = torch_spellings.bucket_size_of(bucket_size, bucket_cap_mb, grad_dtype,
                                                     {p.dtype for _, p in named})
        self.options = GradSyncOptions(
            grad_dtype=grad_dtype,
            bucket_size=bucket_size,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
            find_unused_parameters=find_unused_parameters,
            check_for_nan_in_grad=check_for_nan_in_grad,
            reduce_scatter_with_fp32_accumulation=reduce_scatter_with_fp32_accumulation,
            shard_grads=shard_grads,
            shard_params=shard_params,
            reshard_after_forward=reshard_after_forward,
            sharding=sharding,
            broadcast_buffers=broadcast_buffers,
        )
        self.options.check_param_dtypes({p.dtype for _, p in named})
        if gather_units is not None and self.options.grad_policy.full_params:
            raise ValueError(
                "gather_units= chooses which params are gathered together, which only sharded "
                "params do: pass shard_params=True with it, or leave gather_units out")
        # Checked on every rank before any collective; see [Note: meta-device models].
        meta = has_meta_tensors(module)
        if meta:
            check_materializable(module, self.options.shard_params)

        self.module = module
        dp_group, replicate_group = resolve_dp_groups(process_group, device_mesh)
        dp_group = resolve_group(dp_group)
        # Checked on every rank before any collective: what the replicas of a Manager cover.
        managed = None if ft_manager is None else managed_replicas_for(
            ft_manager, replicate_group=replicate_group, mesh=device_mesh, experts=experts,
            options=self.options)
        # The TP mesh is None without DTensor params; check_params raises (on every rank, before
        # any collective) on a DTensor layout distopt cannot compose with. See
        # [Note: DTensor params].
        self.parallel = ParallelGroups.of(
            dp_group, check_params(named, dp_group), replicate_group, mesh=device_mesh,
            managed_replicas=managed,
        )
        # Raises, on every rank alike and before any collective, where experts cannot compose.
        self.experts: ExpertParams | None = None if experts is None else experts.resolve(
            module, named, dp_group, replicated=comm.group_size(replicate_group) > 1,
            tensor_parallel=self.parallel.tp is not None,
            reduce_scatter=self.options.grad_policy.reduce_scatter)
        self.comm_stats = comm.CommStats()
        self._target_device = (target_device(self.process_group) if meta
                               else named[0][1].device)
        torch_spellings.check_devices(device_ids, output_device, dim, self._target_device)
        if self._target_device.type == "cpu" and not self.options.grad_policy.full_grads:
            # Sharded grads or params on the host: [Note: the heap at the edge of memory].
            keep_heap_from_stranding()
        # Raises, on every rank alike, where no one group spans the DP ranks.
        adopt_sync_batchnorm_group(module, self.parallel)
        if self.parallel.pp_group is not None or "torch.distributed.pipelining" in sys.modules:
            guard_torch_pipeline_stages(DistributedDataParallel)

        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
        name_params(self.param_names)  # what a read between uses names them by
        self.params: list[nn.Parameter] = [p for _, p in named]  # registration order
        self._param_index = {p: i for i, p in enumerate(self.params)}
        self._unit_of: dict[nn.Parameter, int] | None = None  # sharded params' gather units
        # Made trainable, they are refused: [Note: params frozen after wrapping].
        self._frozen_at_wrapping = FrozenAtWrapping(
            [(n, p) for n, p in module.named_parameters()
             if p.numel() > 0 and n not in ignored and p not in self._param_index])
        # One stage's refusal is every stage's: [Note: refusals across stages].
        with stages_agree(self.parallel.pp_group):
            # Known by the tie's name from here on; see [Note: tied stage params].
            self.tied_params = resolve_tied_params(tied_params, self.param_names, self.parallel)
            self.param_names.update(self.tied_params)
            whole_costs = costs_of_classes(whole_tensor_params or {}, self.param_names)
            target = TARGET_BUCKETS_GLOO if comm.is_gloo(self.process_group) else TARGET_BUCKETS
            self.bucket_size = resolve_bucket_size(
                self.options.bucket_size, self._param_specs({}), self.dp_size, target
            )
            # See [Note: gather units] in ddp/gather_units.py.
            self.gather_units: list[GatherUnit] = (
                [] if self.options.grad_policy.full_params
                else plan_gather_units(module, self.params, gather_units))
            self._unit_of = unit_index_of(self.gather_units) if self.gather_units else None
            if self.options.bucket_size is None:
                self.bucket_size = unit_bucket_size(self.bucket_size, self.gather_units,
                                                    self.dp_size)
            # Every rank must hold the same model and plan the same buckets before the first
            # collective; see [Note: one model on every rank] in cross_rank/model.py.
            check_same_model(module, named, self.options, bucket_size=self.bucket_size,
                             parallel=self.parallel, stats=self.comm_stats,
                             experts=self.experts, units=self._unit_of)
        # A module wrapped before is taken over, its old wrapper released first (its gathers
        # may still write into the params); see [Note: one wrapper per param] in
        # ddp/param_owners.py.
        self._released: str | None = None  # why this wrapper let go of its module
        for older, param in param_owners.other_owners(self.params, self):
            older._release(
                f"a newer distopt.DistributedDataParallel wrapped its parameter "
                f"'{older.param_names[param]}'"
            )
        if init_sync:  # torch DDP's init_sync: every replica starts from the first rank's
            broadcast_initial_weights(module, self.parallel, self.experts, broadcast_buffers,
                                      ignored)
        self._buffer_broadcast = BufferBroadcast(module, self.parallel, self.comm_stats,
                                                 enabled=broadcast_buffers, ignored=ignored)

        # Only these params need their DTensor grads turned into local ones in the hook.
        self._dtensor_params = frozenset(p for p in self.params if is_dtensor(p))
        self._gathers_in_flight = False
        self._param_wait_hooks: list[Any] = []
        self._unsharder: ParamUnsharder | None = None
        self._hold_step = False  # see [Note: a step held whole] in ddp/grad_sync.py
        self._backward_seen = False  # a layout may change only before the first backward
        self._owners_set_by: str | None = "the DDP" if whole_costs else None
        self._lay_out(whole_costs)
        if meta:  # one module at a time into this rank's shards
            materialize_shards(module, self._flat_buffers, self.parallel, self._target_device)
            self._grad_sync.rebuild_markers()  # on device
        # After materializing: the registry's weak references would forbid swapping tensors.
        param_owners.claim(self.params, self)
        torch_dcp.install(DistributedDataParallel)  # [Note: torch's DCP state dicts]
        # ``module.load_state_dict`` writes the shards of sharded params (whole_module.py).
        loads_shards = self._unsharder is not None and self.parallel.tp is None
        self._module_state_hooks = [
            module.register_load_state_dict_pre_hook(ModuleHook(self._load_into_shards)),
            module.register_load_state_dict_post_hook(ModuleHook(self._forget_loaded_keys)),
        ] if loads_shards else []
        if self._unsharder is not None:  # no state dict of placeholders (whole_module.py)
            trainable = set(self.params)
            self._module_state_hooks += [
                owner.register_state_dict_pre_hook(ModuleHook(
                    self._refuse_placeholders,
                    on_copy=functools.partial(self._refuse_placeholders, owner, "", False,
                                              reader="copy.deepcopy()")))
                for owner in module.modules()
                if any(p in trainable for p in owner.parameters(recurse=False))]
        # The grad sync of the current layout runs them; see ddp/grad_sync.py.
        self._grad_hooks = [
            hook for p in self.params for hook in (
                p.register_hook(functools.partial(self._before_accumulate, p)),
                p.register_post_accumulate_grad_hook(self._accumulate_grad),
            )
        ]

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
        elif self._rebound is not None:  # see [Note: params rebound] in ddp/rebound_params.py
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
        # [Note: p.grad under distopt] in ddp/grad_marker.py.
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
        gets none counts as zero (see [Note: grads written, not zeroed] in ddp/grad_sync.py).
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
                ([Note: p.grad under distopt] in ddp/grad_marker.py); for those of torch's
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
        ddp/param_gather.py.
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
