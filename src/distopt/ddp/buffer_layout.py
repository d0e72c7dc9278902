"""The buffers a DDP lays out and the grad sync over their buckets: the part of
``DistributedDataParallel`` that plans the layout (when the DDP is built, and once more when an
optimizer needs params owned whole before the first backward; see [Note: layout planned once]
in layout/model_layout.py), builds the buffers, the grad sync, and the param gathers or the
unsharder around them, and gives them to the optimizer and checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..layout.model_layout import ParamSpec, plan_model_layout
from ..parallel.dtensor import local_tensor
from ..parallel.experts import ExpertParams
from . import agreements
from .buffers.bucket import Bucket
from .buffers.buffer import ParamAndGradBuffer
from .buffers.grad_pool import GradPool, grad_pools_for
from .buffers.param_storage import ParamPool, param_pools_for
from .buffers.rebound_params import rebound_params_of
from .grads.grad_reads import GradReads
from .grads.grad_sync import GradSync
from .params.forward_check import ForwardCheck
from .params.param_gather import register_param_wait_hooks
from .params.param_unshard import ParamUnsharder
from .state import SyncState


def param_specs(params: list[nn.Parameter], whole_costs: dict[nn.Parameter, float], *,
                tied: Mapping[nn.Parameter, str], experts: ExpertParams | None,
                units: dict[nn.Parameter, int] | None) -> list[ParamSpec]:
    """What the layout is planned from, per param in order: its local shape and dtype, the
    cost of its owner with ``whole_costs``, whether it is tied or an expert's, and its gather
    unit (None without sharded params, -1 for a param in none)."""
    expert_params = frozenset() if experts is None else experts.params
    return [ParamSpec(tuple(local_tensor(p).shape), p.dtype, whole_costs.get(p),
                      alone=p in tied, expert=p in expert_params,
                      unit=None if units is None else units.get(p, -1))
            for p in params]


class BufferLayout:
    """Lays out the buffers of ``DistributedDataParallel`` and holds what it built."""

    def _param_specs(self, whole_costs: dict[nn.Parameter, float]) -> list[ParamSpec]:
        return param_specs(self.params, whole_costs, tied=self.tied_params,
                           experts=self.experts, units=self._unit_of)

    def _lay_out(self, whole_costs: dict[nn.Parameter, float]) -> None:
        """Lay the buffers out, each param in ``whole_costs`` owned whole by one rank (owners
        balancing the summed costs), every other param in element-wise shards, and build the
        grad sync over their buckets. Deterministic: every rank lays out the same buffers
        without communicating."""
        planned = plan_model_layout(
            self._param_specs(whole_costs), grad_dtype=self.options.grad_dtype,
            bucket_size=self.bucket_size, dp_size=self.dp_size,
            expert_dp_size=None if self.experts is None else self.experts.parallel.expert_dp_size,
        )
        policy = self.options.grad_policy
        overlaps = self.dp_size > 1 and self.options.overlap_grad_reduce
        self.grad_pools: dict[torch.dtype, GradPool] = (
            {} if policy.full_grads
            else grad_pools_for(planned.buffers, self._device, overlaps=overlaps,
                                blocking=self.experts is None))
        self.param_pools: dict[torch.dtype, ParamPool] = (
            {} if policy.full_params else param_pools_for(planned.buffers))
        self._whole_tensor_costs = dict(whole_costs)
        self._flat_buffers = [
            ParamAndGradBuffer(
                [self.params[i] for i in buf.param_indices],
                buf.layout,
                grad_dtype=buf.grad_dtype,
                **self._buffer_groups(buf.expert),
                replicate_group=(self.parallel.managed_replicas
                                 or self.parallel.replicate_group),
                reduce_scatter=policy.reduce_scatter,
                stats=self.comm_stats,
                fp32_accumulation=self.options.reduces_with_fp32_accumulation(buf.grad_dtype),
                check_local_grads=self.options.check_for_nan_in_grad,
                grad_pool=self.grad_pools.get(buf.grad_dtype),
                param_pool=self.param_pools.get(buf.param_dtype),
                device=self._device,
            )
            for buf in planned.buffers
        ]
        buckets = [self._flat_buffers[b].buckets[k] for b, k in planned.launch_order]
        for order, bucket in enumerate(buckets):
            bucket.order = order
        self._buffer_of = {p: buf for buf in self._flat_buffers for p in buf.params}
        self._rebound = rebound_params_of(self._flat_buffers, self.param_names)
        self._grad_sync = GradSync(buckets, self.params, self.param_names, self.options,
                                   self.parallel, self.grad_pools, self.comm_stats,
                                   self._dtensor_params, experts=self.experts,
                                   refused_reads=self._refused_reads(), device=self._device)
        self._grad_sync.model_name = f"the distopt DDP of {type(self.module).__name__}"
        for hook in self._param_wait_hooks:
            hook.remove()
        if self._unsharder is not None:
            self._unsharder.remove_hooks()
        if policy.full_params:
            self._param_wait_hooks = register_param_wait_hooks(
                self.module, self._grad_sync.bucket_of, lambda: self._gathers_in_flight)
        else:  # see [Note: sharded params] in ddp/buffers/param_storage.py
            self._unsharder = ParamUnsharder(
                self.module, self.gather_units, self._grad_sync.bucket_of, buckets,
                reshard_after_forward=self.options.reshard_after_forward,
                holding=lambda: self._grad_sync.hold_step,
                check=ForwardCheck(self.process_group, self._device,
                                   self._grad_sync.model_name, self.comm_stats)
                if agreements.enabled() else None)
        self._grad_sync.hold_step = self._hold_step

    def _refused_reads(self) -> dict[nn.Parameter, str]:
        """The params whose ``p.grad`` answers nothing, each with why; see [Note: p.grad
        under distopt] in ddp/grads/grad_marker.py."""
        use = ("; pass the optimizer clip_grad= (one norm over every rank, "
               "opt.step().grad_norm) or clip_grad_value= instead")
        refused = {p: ("is a tensor-parallel DTensor: torch's p.grad would be a DTensor, whose "
                       f"norm is a collective over the TP mesh, and distopt makes none{use}")
                   for p in self._dtensor_params}
        if self.experts is not None:
            refused.update({p: ("is an expert's: the ranks hold other experts under the same "
                                "names, so a norm over model.parameters() would differ by "
                                f"rank{use}") for p in self.experts.params})
        refused.update({p: ("is tied to a weight of another pipeline stage: the step sums its "
                            f"grad over the stages{use}") for p in self.tied_params})
        return refused

    def _buffer_groups(self, expert: bool) -> dict[str, Any]:
        """The group a buffer's buckets reduce and gather over, this rank's place in it, and
        the factor grads take first: the expert-DP group for experts' buffers (see
        [Note: expert parallelism] in parallel/experts.py), else the data-parallel group."""
        if expert and self.experts is not None:
            return self.experts.parallel.buffer_options()
        return dict(dp_rank=self.dp_rank, group=self.process_group)

    def lay_out_for(self, whole_tensor_costs: dict[nn.Parameter, float], *, by: str) -> None:
        """Make sure the buffers are laid out for these owners of whole tensors: the layout
        the DDP was built with, or (once, before the first backward) a new one. ``by`` names
        the caller in errors. See [Note: layout planned once] in layout/model_layout.py.

        Args:
            whole_tensor_costs: every param an optimizer steps whole, with the cost its
                owner's choice balances (what ``distopt.register_whole_tensor_optimizer``'s
                ``cost`` gives for its shape); params not named are sharded element by
                element. Each must be a trainable param of this model.
            by: who asks, e.g. "DistributedOptimizer", named in the error when the buffers
                are laid out for other owners already.
        """
        self._check_live()
        unknown = [p for p in whole_tensor_costs if p not in self._param_index]
        if unknown:
            raise ValueError(
                f"{by} named {len(unknown)} tensor(s) that are not trainable parameters of this "
                "model"
            )
        if whole_tensor_costs == self._whole_tensor_costs:
            self._owners_set_by = self._owners_set_by or by
            return
        if self._owners_set_by is not None or self._backward_seen:
            why = (f"by {self._owners_set_by}" if self._owners_set_by
                   else "element-wise, and a backward ran on it")
            raise ValueError(
                "the model's buffers are already laid out for other owners of whole tensors "
                f"({len(self._whole_tensor_costs)} params owned whole, {why}; {by} needs "
                f"{len(whole_tensor_costs)}): they are laid out once; build the optimizer "
                "right after distopt.DistributedDataParallel(...), before the first backward, "
                "one optimizer per DDP, or pass whole_tensor_params= to the DDP"
            )
        if self._unsharder is not None:  # the new buffers take the params' values
            self._params_own_storage()
        self._lay_out(whole_tensor_costs)  # the old buffers go once nothing views them
        self._owners_set_by = by

    @property
    def hold_step(self) -> bool:
        """With sharded grads or params: whether backwards under ``no_sync()`` keep the step's
        grads whole and its params gathered, for one reduction and one gather per step (a
        pipeline stage's micro-batches; ``distopt.pipelining.PipelineStage`` sets it). See
        [Note: a step held whole] in ddp/grads/grad_sync.py."""
        return self._hold_step

    @hold_step.setter
    def hold_step(self, value: bool) -> None:
        self._hold_step = bool(value)
        self._grad_sync.hold_step = self._hold_step

    @property
    def flat_buffers(self) -> list[ParamAndGradBuffer]:
        """One contiguous param and grad buffer per param dtype."""
        return self._flat_buffers

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket of every buffer, in launch order."""
        return self._grad_sync.buckets

    @property
    def buffer_of(self) -> dict[nn.Parameter, ParamAndGradBuffer]:
        """The buffer that holds each param."""
        return self._buffer_of

    @property
    def whole_tensor_costs(self) -> dict[nn.Parameter, float]:
        """The params owned whole by one rank, with the cost their owners balance."""
        return dict(self._whole_tensor_costs)

    @property
    def grad_reads(self) -> GradReads:
        """What ``p.grad`` of this model's params answers between backward and step: the
        reduced grads' norms, agreed over the ranks, and their scaling and clamping in place;
        see [Note: p.grad under distopt] in ddp/grads/grad_marker.py."""
        return self._grad_sync.reads

    @property
    def sync_state(self) -> SyncState:
        """Where the step's grad sync is; see [Note: step states] in ddp/state.py."""
        return self._grad_sync.state

    @property
    def unused_params(self) -> frozenset[nn.Parameter]:
        """With find_unused_parameters: the params no rank computed a grad for this step."""
        return self._grad_sync.unused_params

    def take_grad_writes(self) -> None:
        """At the step: ``p.grad`` set to None leaves its param out, a tensor assigned is its
        grad; see [Note: p.grad under distopt] in ddp/grads/grad_marker.py."""
        self._grad_sync.take_grad_writes()

    def adopt_rebound_params(self) -> None:
        """Take back into the buffers the values of params whose ``.data`` was rebound to
        other storage (``torch.nn.utils.vector_to_parameters``); the optimizer's step and
        state dicts do it first. See [Note: params rebound] in ddp/buffers/rebound_params.py."""
        if self._rebound is not None:
            self._rebound.take_up()
