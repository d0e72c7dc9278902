"""The stages that build a ``DistributedDataParallel``, in the order its constructor calls them.

    check_inputs      every argument checked on every rank, before any collective
    resolve_groups    the process groups, the TP mesh, the experts, this rank's device
    plan_and_agree    the params, their names and gather units, the bucket size; then the
                      one collective that checks every rank built the same (cross_rank/model.py)
    adopt             the wrapper keeps what the stages found, as the attributes distopt reads
    take_over         older wrappers of the params released; every replica starts alike
    build_buffers     the buffers, their buckets and the grad sync (ddp/buffer_layout.py)
    materialize_meta  a meta-device model initialized into this rank's shards
    wire_hooks        the params claimed; the state-dict and grad hooks registered

The first three return what the next needs as frozen bundles (``Inputs``, ``Groups``, ``Plan``);
from ``adopt`` on, each works on the wrapper being built (``ddp``), as torch's ``fully_shard``
works on its module's state. Every refusal of the arguments is raised in the first three, on
every rank alike and before the model check, the first collective, so that no rank waits in a
collective another has left; within ``plan_and_agree`` one pipeline stage's refusal is every
stage's ([Note: refusals across stages] in cross_rank/stages.py).
"""

from __future__ import annotations

import dataclasses
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
from ..host_memory import host_state_bytes, tune_heap
from ..layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO
from ..layout.model_layout import resolve_bucket_size
from ..options import GradSyncOptions
from ..parallel.dtensor import is_dtensor
from ..parallel.experts import ExpertParallel, ExpertParams
from ..parallel.managed_replicas import managed_replicas_for
from ..parallel.process_groups import ParallelGroups, resolve_dp_groups, resolve_group
from ..parallel.tensor_parallel import check_params
from . import param_owners
from .buffer_layout import param_specs
from .buffers.param_placeholder import name_params
from .module_buffers import BufferBroadcast, adopt_sync_batchnorm_group
from .module_params import broadcast_initial_weights, trainable_named_params
from .params.gather_units import (
    GatherUnit,
    GatherUnitPolicy,
    plan_gather_units,
    unit_bucket_size,
    unit_index_of,
)
from .params.materialize import (
    check_materializable,
    has_meta_tensors,
    materialize_shards,
    target_device,
)
from .params.module_hooks import ModuleHook
from .stage_methods import guard_torch_pipeline_stages
from .tied import resolve_tied_params
from .torch_compat import torch_dcp, torch_spellings
from .torch_compat.trainable import FrozenAtWrapping
from .whole_tensor_params import costs_of_classes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The arguments as ``check_inputs`` found them."""

    named: list[tuple[str, nn.Parameter]]  # the trainable params, in registration order
    ignored: frozenset[str]  # torch DDP's ignore list
    options: GradSyncOptions
    meta: bool  # a meta-device model, materialized into the shards
    static_graph: bool  # torch's; kept as attributes, nothing depends on them
    gradient_as_bucket_view: bool


@dataclasses.dataclass(frozen=True)
class Groups:
    """Where the wrapper runs, as ``resolve_groups`` found it."""

    parallel: ParallelGroups
    experts: ExpertParams | None
    device: torch.device  # where the buffers live
    stats: comm.CommStats  # counts every collective from the model check on


@dataclasses.dataclass(frozen=True)
class Plan:
    """The params and what the layout is planned from, as ``plan_and_agree`` found them (the
    same on every rank)."""

    params: list[nn.Parameter]  # registration order
    param_names: dict[nn.Parameter, str]  # a tied param by the tie's name
    frozen_at_wrapping: FrozenAtWrapping
    tied_params: dict[nn.Parameter, str]
    whole_costs: dict[nn.Parameter, float]  # the params owned whole, with their costs
    bucket_size: int
    gather_units: list[GatherUnit]
    unit_of: dict[nn.Parameter, int] | None  # sharded params' gather units


def check_inputs(
    module: nn.Module,
    process_group: Any,
    torch_only: Mapping[str, Any],
    *,
    wrapper: type[nn.Module],
    bucket_size: int | None,
    bucket_cap_mb: float | None,
    gather_units: GatherUnitPolicy,
    static_graph: bool,
    gradient_as_bucket_view: bool,
    options: Mapping[str, Any],
) -> Inputs:
    """Check the constructor's arguments, on every rank before any collective.

    ``options`` are ``GradSyncOptions``' arguments but its ``bucket_size``, which is resolved
    here from ``bucket_size`` or torch's ``bucket_cap_mb``; ``wrapper`` is the DDP class, whose
    instances are refused as modules."""
    # torch DDP's own arguments, each with torch's meaning or refused naming what works;
    # see [Note: torch DDP's spellings] in ddp/torch_compat/torch_spellings.py.
    torch_spellings.positional_device_ids(process_group)
    torch_spellings.check_refused(torch_only)
    ignored = torch_spellings.ignored_names(module)
    named = trainable_named_params(module, (wrapper, nn.parallel.DistributedDataParallel), ignored)
    dtypes = {p.dtype for _, p in named}
    resolved = GradSyncOptions(
        bucket_size=torch_spellings.bucket_size_of(bucket_size, bucket_cap_mb,
                                                   options["grad_dtype"], dtypes),
        **options)
    resolved.check_param_dtypes(dtypes)
    if gather_units is not None and resolved.grad_policy.full_params:
        raise ValueError(
            "gather_units= chooses which params are gathered together, which only sharded "
            "params do: pass shard_params=True with it, or leave gather_units out")
    # Checked on every rank before any collective; see [Note: meta-device models].
    meta = has_meta_tensors(module)
    if meta:
        check_materializable(module, resolved.shard_params)
    return Inputs(named, ignored, resolved, meta, static_graph, gradient_as_bucket_view)


def projected_host_state(named: Sequence[tuple[str, nn.Parameter]], options: GradSyncOptions,
                         dp_group: dist.ProcessGroup) -> int:
    """The state this host's ranks will hold ([Note: the heap at the edge of memory])."""
    numel = sum(p.numel() for _, p in named)
    param_itemsize = named[0][1].dtype.itemsize if named else 4
    grad_itemsize = (options.grad_dtype or named[0][1].dtype).itemsize if named else 4
    return host_state_bytes(numel, param_itemsize, grad_itemsize, comm.group_size(dp_group),
                            shard_grads=not options.grad_policy.full_grads,
                            shard_params=options.shard_params)


def resolve_groups(
    module: nn.Module,
    inputs: Inputs,
    *,
    wrapper: type[nn.Module],
    process_group: dist.ProcessGroup | None,
    device_mesh: DeviceMesh | None,
    experts: ExpertParallel | None,
    ft_manager: Any,
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    dim: int,
) -> Groups:
    """Resolve the data-parallel groups, the TP mesh of DTensor params, the replicas of a
    fault-tolerant Manager and the experts, and the device the buffers live on; each refusal
    raised on every rank before any collective. Gives ``nn.SyncBatchNorm`` layers the
    data-parallel group and guards torch's pipeline stages against the ``wrapper`` class."""
    named, options = inputs.named, inputs.options
    dp_group, replicate_group = resolve_dp_groups(process_group, device_mesh)
    dp_group = resolve_group(dp_group)
    # Checked on every rank before any collective: what the replicas of a Manager cover.
    managed = None if ft_manager is None else managed_replicas_for(
        ft_manager, replicate_group=replicate_group, mesh=device_mesh, experts=experts,
        options=options)
    # The TP mesh is None without DTensor params; check_params raises (on every rank, before
    # any collective) on a DTensor layout distopt cannot compose with. See
    # [Note: DTensor params].
    parallel = ParallelGroups.of(
        dp_group, check_params(named, dp_group), replicate_group, mesh=device_mesh,
        managed_replicas=managed,
    )
    # Raises, on every rank alike and before any collective, where experts cannot compose.
    expert_params = None if experts is None else experts.resolve(
        module, named, dp_group, replicated=comm.group_size(replicate_group) > 1,
        tensor_parallel=parallel.tp is not None,
        reduce_scatter=options.grad_policy.reduce_scatter)
    stats = comm.CommStats()
    device = target_device(parallel.dp_group) if inputs.meta else named[0][1].device
    torch_spellings.check_devices(device_ids, output_device, dim, device)
    if device.type == "cpu":
        # glibc's heap kept from faulting each step's blocks afresh, or, for sharded grads or
        # params where memory is tight, from stranding them: [Note: the heap at the edge of
        # memory].
        tune_heap(projected_host_state(named, options, parallel.dp_group),
                  sharded=not options.grad_policy.full_grads)
    # Raises, on every rank alike, where no one group spans the DP ranks.
    adopt_sync_batchnorm_group(module, parallel)
    if parallel.pp_group is not None or "torch.distributed.pipelining" in sys.modules:
        guard_torch_pipeline_stages(wrapper)
    return Groups(parallel, expert_params, device, stats)


def plan_and_agree(
    module: nn.Module,
    inputs: Inputs,
    groups: Groups,
    *,
    tied_params: Mapping[str, nn.Parameter] | None,
    whole_tensor_params: Mapping[nn.Parameter, type[torch.optim.Optimizer]] | None,
    gather_units: GatherUnitPolicy,
) -> Plan:
    """Name the params, resolve the tied ones and the owners of whole tensors, plan the gather
    units and the bucket size; then check, in the first collective, that every rank holds the
    same model and plans the same buckets ([Note: one model on every rank] in
    cross_rank/model.py)."""
    named, options = inputs.named, inputs.options
    parallel, experts = groups.parallel, groups.experts
    param_names: dict[nn.Parameter, str] = {p: n for n, p in named}
    name_params(param_names)  # what a read between uses names them by
    params = [p for _, p in named]
    index = {p: i for i, p in enumerate(params)}
    # Made trainable, they are refused: [Note: params frozen after wrapping].
    frozen = FrozenAtWrapping(
        [(n, p) for n, p in module.named_parameters()
         if p.numel() > 0 and n not in inputs.ignored and p not in index])
    # One stage's refusal is every stage's: [Note: refusals across stages].
    with stages_agree(parallel.pp_group):
        # Known by the tie's name from here on; see [Note: tied stage params].
        tied = resolve_tied_params(tied_params, param_names, parallel)
        param_names.update(tied)
        whole_costs = costs_of_classes(whole_tensor_params or {}, param_names)
        target = TARGET_BUCKETS_GLOO if comm.is_gloo(parallel.dp_group) else TARGET_BUCKETS
        bucket_size = resolve_bucket_size(
            options.bucket_size,
            param_specs(params, {}, tied=tied, experts=experts, units=None),
            parallel.dp_size, target,
        )
        # See [Note: gather units] in ddp/params/gather_units.py.
        units: list[GatherUnit] = (
            [] if options.grad_policy.full_params
            else plan_gather_units(module, params, gather_units))
        unit_of = unit_index_of(units) if units else None
        if options.bucket_size is None:
            bucket_size = unit_bucket_size(bucket_size, units, parallel.dp_size)
        # Every rank must hold the same model and plan the same buckets before the first
        # collective; see [Note: one model on every rank] in cross_rank/model.py.
        check_same_model(module, named, options, bucket_size=bucket_size, parallel=parallel,
                         stats=groups.stats, experts=experts, units=unit_of)
    return Plan(params, param_names, frozen, tied, whole_costs, bucket_size, units, unit_of)


def adopt(ddp: Any, module: nn.Module, inputs: Inputs, groups: Groups, plan: Plan) -> None:
    """Have ``ddp``, the wrapper being built, keep what the stages found, as the attributes
    the rest of distopt reads."""
    ddp.static_graph = inputs.static_graph  # nothing depends on it; kept for torch's readers
    ddp.gradient_as_bucket_view = inputs.gradient_as_bucket_view
    ddp.ignored_names = inputs.ignored
    ddp.options = inputs.options
    ddp.module = module
    ddp.parallel = groups.parallel
    ddp.experts = groups.experts
    ddp.comm_stats = groups.stats
    ddp._target_device = groups.device
    ddp.param_names = plan.param_names
    ddp.params = plan.params
    ddp._param_index = {p: i for i, p in enumerate(plan.params)}
    ddp._frozen_at_wrapping = plan.frozen_at_wrapping
    ddp.tied_params = plan.tied_params
    ddp.bucket_size = plan.bucket_size
    ddp.gather_units = plan.gather_units
    ddp._unit_of = plan.unit_of


def take_over(ddp: Any, *, init_sync: bool) -> None:
    """Release the older wrappers of ``ddp``'s params and, with ``init_sync`` (torch DDP's),
    start every replica from the first rank's params and buffers; set up the broadcast of the
    module's buffers before forwards ([Note: buffer broadcasting] in ddp/module_buffers.py)."""
    # A module wrapped before is taken over, its old wrapper released first (its gathers
    # may still write into the params); see [Note: one wrapper per param] in
    # ddp/param_owners.py.
    ddp._released = None  # why this wrapper let go of its module
    for older, param in param_owners.other_owners(ddp.params, ddp):
        older._release(
            f"a newer distopt.DistributedDataParallel wrapped its parameter "
            f"'{older.param_names[param]}'"
        )
    broadcast_buffers = ddp.options.broadcast_buffers
    if init_sync:  # torch DDP's init_sync: every replica starts from the first rank's
        broadcast_initial_weights(ddp.module, ddp.parallel, ddp.experts, broadcast_buffers,
                                  ddp.ignored_names)
    ddp._buffer_broadcast = BufferBroadcast(ddp.module, ddp.parallel, ddp.comm_stats,
                                            enabled=broadcast_buffers, ignored=ddp.ignored_names)


def build_buffers(ddp: Any, whole_costs: dict[nn.Parameter, float]) -> None:
    """Start ``ddp``'s step state and lay its buffers out, each param in ``whole_costs`` owned
    whole; see ``_lay_out`` in ddp/buffer_layout.py."""
    # Only these params need their DTensor grads turned into local ones in the hook.
    ddp._dtensor_params = frozenset(p for p in ddp.params if is_dtensor(p))
    ddp._gathers_in_flight = False
    ddp._param_wait_hooks = []
    ddp._unsharder = None
    ddp._hold_step = False  # see [Note: a step held whole] in ddp/grads/grad_sync.py
    ddp._backward_seen = False  # a layout may change only before the first backward
    ddp._owners_set_by = "the DDP" if whole_costs else None
    ddp._lay_out(whole_costs)


def materialize_meta(ddp: Any, meta: bool) -> None:
    """Initialize a meta-device model one module at a time into this rank's shards
    ([Note: meta-device models] in ddp/params/materialize.py); nothing for a model on its device."""
    if meta:
        materialize_shards(ddp.module, ddp._flat_buffers, ddp.parallel, ddp._target_device)
        ddp._grad_sync.rebuild_markers()  # on device


def wire_hooks(ddp: Any, wrapper: type[nn.Module]) -> None:
    """Claim ``ddp``'s params, teach torch's DCP the ``wrapper`` class, and register the
    module's state-dict hooks (sharded params) and every param's grad hooks."""
    # After materializing: the registry's weak references would forbid swapping tensors.
    param_owners.claim(ddp.params, ddp)
    torch_dcp.install(wrapper)  # [Note: torch's DCP state dicts]
    module = ddp.module
    # ``module.load_state_dict`` writes the shards of sharded params (whole_module.py).
    loads_shards = ddp._unsharder is not None and ddp.parallel.tp is None
    ddp._module_state_hooks = [
        module.register_load_state_dict_pre_hook(ModuleHook(ddp._load_into_shards)),
        module.register_load_state_dict_post_hook(ModuleHook(ddp._forget_loaded_keys)),
    ] if loads_shards else []
    if ddp._unsharder is not None:  # no state dict of placeholders (whole_module.py)
        trainable = set(ddp.params)
        ddp._module_state_hooks += [
            owner.register_state_dict_pre_hook(ModuleHook(
                ddp._refuse_placeholders,
                on_copy=functools.partial(ddp._refuse_placeholders, owner, "", False,
                                          reader="copy.deepcopy()")))
            for owner in module.modules()
            if any(p in trainable for p in owner.parameters(recurse=False))]
    # The grad sync of the current layout runs them; see ddp/grads/grad_sync.py.
    ddp._grad_hooks = [
        hook for p in ddp.params for hook in (
            p.register_hook(functools.partial(ddp._before_accumulate, p)),
            p.register_post_accumulate_grad_hook(ddp._accumulate_grad),
        )
    ]
