"""The optimizer class that DistributedOptimizer and BasicOptimizer share.

Construction wires the parts (see docs/design.md, "Who calls whom"): the param groups and one
inner torch optimizer per class (optim/param_groups.py), the DDP's buffers laid out for the
owners of whole tensors (layout/model_layout.py), the fp32 main params of this rank's part
(optim/main_params.py), the groups that grad statistics reduce over (with tensor parallelism,
parallel/tensor_parallel.py) and the step pipeline (optim/step.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cross_rank.agree import agree_on_refusal
from ..cross_rank.optimizer import check_same_optimizer, describe_optimizer
from ..cross_rank.stages import stages_agree
from ..ddp import torch_dcp
from ..ddp.wrapper import DistributedDataParallel
from ..host_memory import release_freed_host_memory
from ..layout.elementwise import ShardPiece
from ..options import StepOptions
from ..parallel.process_groups import ParallelGroups, common_groups
from ..parallel.tensor_parallel import counted_grads
from . import grad_stats
from .amp import AFTER_STEP, TorchGradScaler, hand_unscale_to, refuse_attribute_protocol
from .fault_tolerance import FaultTolerantSteps
from .kinds import check_optimizer_cls
from .loss_scalers import ConstantLossScaler, DynamicLossScaler, LossScaler
from .main_params import ShardMainParams
from .offload import OffloadError, OffloadTier, region_bytes
from .param_groups import (
    build_inner_optimizers,
    group_class,
    normalize_param_groups,
    whole_tensor_costs,
)
from .state_precision import (
    StatePrecision,
    check_rounding,
    resolve_block_size,
    resolve_state_dtypes,
)
from .step import BucketByBucket, GradNormLog, StepPipeline, StepResult, WholeShard
from .tied import tied_grads
from .torch_state import ParamScalars, TorchState, scalar_entries


class BufferOptimizer(torch.optim.Optimizer):
    """What DistributedOptimizer and BasicOptimizer share: main params over a DDP's buffers,
    the inner torch optimizers and the step. Not constructed directly; see
    distopt.optim.optimizers."""

    _sharded: bool
    # torch.amp.GradScaler.step(opt) calls step(grad_scaler=scaler); see [Note: torch's
    # GradScaler] in optim/amp.py.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        models: Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None,
        options: StepOptions,
        loss_scaler: LossScaler | None,
        model_parallel_group: dist.ProcessGroup | None,
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        # One pipeline stage's refusal is every stage's: [Note: refusals across stages] in
        # cross_rank/stages.py.
        pp_group = models[0].parallel.pp_group
        with stages_agree(pp_group):
            self._construct(models, optimizer_cls, params, options, loss_scaler,
                            model_parallel_group, optimizer_kwargs)
        torch_dcp.register_optimizer(self)  # [Note: torch's DCP state dicts] in ddp/torch_dcp.py
        hand_unscale_to(BufferOptimizer)  # [Note: torch's GradScaler]
        # After the agreement, so that every stage reaches its collectives; see
        # [Note: tied stage params] in optim/tied.py.
        self._tied = tied_grads(self.models, pp_group) if pp_group is not None else None
        replicas = self.models[0].parallel.managed_replicas
        self._fault_tolerance = (None if replicas is None
                                 else FaultTolerantSteps(replicas, self))
        if self._tied is not None:
            for main in [m for m in self._pipeline.counted
                         if self.piece_info(m)[0] in self._tied.copies]:
                del self._pipeline.counted[main]

    def _construct(
        self,
        models: Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None,
        options: StepOptions,
        loss_scaler: LossScaler | None,
        model_parallel_group: dist.ProcessGroup | None,
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        # Construction runs in stages, each checking its inputs on every rank before the
        # next (and before any collective): see docs/design.md, "Construction, one way".
        self._check_arguments(models, optimizer_cls, loss_scaler, model_parallel_group)
        self.models = list(models)
        self._first_step_done = False
        self._consolidated: dict[str, Any] | None = None  # see consolidate_state_dict
        self.last_step_result: StepResult | None = None  # see [Note: step(closure)]
        self.options = options
        self.loss_scaler = loss_scaler
        self.model_parallel_group = model_parallel_group
        self._device = self.models[0].params[0].device
        param_groups, group_classes = self._resolve_groups(params, optimizer_cls)
        state_dtypes = resolve_state_dtypes(options.state_dtype, group_classes)
        block_size = resolve_block_size(options.state_block_size, state_dtypes)
        check_rounding(options.state_rounding, state_dtypes)
        names = {p: m.param_names[p] for m in self.models for p in m.params}
        whole_costs = whole_tensor_costs(param_groups, group_classes, names)
        self._use_layout(whole_costs)
        self._offload = self._build_offload_tier(
            param_groups, group_classes, optimizer_cls, optimizer_kwargs,
            frozenset(whole_costs), state_dtypes, block_size)
        self._build_main_params(frozenset(whole_costs))
        inner_groups = self._build_inner_optimizers(param_groups, group_classes, optimizer_cls,
                                                    optimizer_kwargs)
        self._build_pipeline(inner_groups, state_dtypes, block_size)
        # Before any collective of the optimizer's; see [Note: one optimizer on every rank].
        check_same_optimizer(
            describe_optimizer(inner_groups, group_classes, self.model_param_groups, names,
                               options),
            self.parallel, self._device)
        self._alias_torch_optimizer(inner_groups)

    def _check_arguments(self, models: Sequence[DistributedDataParallel],
                         optimizer_cls: type[torch.optim.Optimizer],
                         loss_scaler: LossScaler | None,
                         model_parallel_group: dist.ProcessGroup | None) -> None:
        check_optimizer_cls(optimizer_cls)
        if loss_scaler is not None and not isinstance(
            loss_scaler, (ConstantLossScaler, DynamicLossScaler)
        ):
            raise TypeError(
                "loss_scaler must be distopt.DynamicLossScaler() or distopt.ConstantLossScaler(s)"
            )
        # The DP group and TP mesh every model chunk shares, checked once.
        self.parallel: ParallelGroups = common_groups([m.parallel for m in models])
        _check_model_parallel_group(model_parallel_group, self.parallel.dp_group)
        if len(models) > 1 and any(m.experts is not None for m in models):
            raise ValueError(  # checkpoints name experts by one model's global names
                "a model with experts= takes an optimizer of its own: pass one DDP, not "
                "several model chunks, when one holds experts"
            )
        if self.parallel.tp is not None and model_parallel_group is not None:
            raise ValueError(
                "the model has DTensor (tensor-parallel) params, whose mesh already gives the "
                "groups that grad statistics reduce over; drop model_parallel_group (passing the "
                "TP group too would count every element twice)"
            )
        if isinstance(loss_scaler, DynamicLossScaler):
            checked = [m for m in models if m.options.check_for_nan_in_grad]
            if checked:
                raise ValueError(
                    "a DynamicLossScaler skips the steps whose grads overflow, but the model was "
                    "built with check_for_nan_in_grad=True, which raises on them instead: drop "
                    "one of the two (check_for_nan_in_grad is meant for bf16/fp32 training)"
                )
        # Groups over which the inf flag, the grad norm and the zero count are reduced: the
        # DDP's verdict groups (the DP group when each rank owns a shard, the TP groups), then
        # the model-parallel group, whose ranks hold other parts of the model. Each grad
        # element must be owned by exactly one rank of all.
        self._reduce_groups = self.parallel.verdict_groups(sharded=self._sharded)
        if model_parallel_group is not None:
            self._reduce_groups.append(model_parallel_group)

    def _resolve_groups(self, params: Iterable[Any] | None,
                        optimizer_cls: type[torch.optim.Optimizer]
                        ) -> tuple[list[dict[str, Any]], list[type[torch.optim.Optimizer]]]:
        """The torch-style param groups over the model's params, and each group's class."""
        param_groups = normalize_param_groups(params, self.models)
        # The model params of each group as given: checkpoints name the groups by them, since
        # the inner groups hold only this rank's pieces.
        self.model_param_groups: list[list[nn.Parameter]] = [g["params"] for g in param_groups]
        self.default_param_groups = params is None
        self.options.check_param_dtypes({p.dtype for m in self.models for p in m.params})
        return param_groups, [group_class(g, optimizer_cls) for g in param_groups]

    def _use_layout(self, whole_costs: dict[nn.Parameter, float]) -> None:
        # The DDP laid its buffers out when built; this checks them against the owners of
        # whole tensors, or lays them out for them before the first backward. See
        # [Note: layout planned once] in layout/model_layout.py.
        for model in self.models:
            model.lay_out_for(
                {p: c for p, c in whole_costs.items() if p in model.param_names}
                if self._sharded else {}, by="the optimizer")

    def _build_offload_tier(self, param_groups: list[dict[str, Any]],
                            group_classes: list[type[torch.optim.Optimizer]],
                            optimizer_cls: type[torch.optim.Optimizer],
                            optimizer_kwargs: dict[str, Any],
                            whole_params: frozenset[nn.Parameter],
                            state_dtypes: dict[str, torch.dtype],
                            block_size: int) -> OffloadTier | None:
        """The file the masters and state rest in between steps, with ``offload_dir``; its
        refusals (no directory, no room) agreed on every rank before any collective. See
        [Note: the offload tier] in optim/offload.py."""
        directory = self.options.offload_dir
        if directory is None:
            return None
        stepped_by = {}
        for group, cls in zip(param_groups, group_classes, strict=True):
            # optimizer_kwargs belong to optimizer_cls alone, as the inner optimizers take them.
            given = optimizer_kwargs if cls is optimizer_cls else {}
            options = {**given, **{k: v for k, v in group.items() if k != "params"}}
            stepped_by.update(dict.fromkeys(group["params"], (cls, options)))
        tier, message = None, None
        try:
            sizes = region_bytes(
                [buf for model in self.models for buf in model.flat_buffers],
                sharded=self._sharded, store_remainders=self.options.store_param_remainders,
                stepped_by=stepped_by, whole_params=whole_params, state_dtypes=state_dtypes,
                block_size=block_size)
            tier = OffloadTier(directory, f"distopt-offload-rank{dist.get_rank()}-"
                               f"{os.getpid()}-{id(self)}.bin", sizes, self._device)
        except OffloadError as error:
            message = str(error)
        message = agree_on_refusal(message, self.parallel, self._device,
                                   self.models[0].comm_stats)
        if message is not None:
            if tier is not None:
                tier.close()
            raise OffloadError(message)
        return tier

    def _build_main_params(self, whole_params: frozenset[nn.Parameter]) -> None:
        """The fp32 main params of this rank's part of every buffer, one per piece."""
        self._owned, first = [], 0
        for model in self.models:
            for buf in model.flat_buffers:
                allocate = None
                if self._offload is not None:
                    tier, base = self._offload, first

                    def allocate(bucket: int, numel: int, dtype: torch.dtype,
                                 tier: OffloadTier = tier, base: int = base) -> torch.Tensor:
                        return tier.allocate(base + bucket, (numel,), dtype)
                self._owned.append(ShardMainParams(
                    buf, sharded=self._sharded,
                    store_remainders=self.options.store_param_remainders,
                    whole_params=whole_params, allocate=allocate))
                first += len(buf.buckets)
        if self._offload is not None:
            self._offload.release()  # the masters copied in at construction
        self._mains_of: dict[nn.Parameter, list[nn.Parameter]] = {}
        self._piece_owner: dict[nn.Parameter, tuple[ShardMainParams, ShardPiece]] = {}
        for owned in self._owned:
            for piece, main in zip(owned.pieces, owned.main_params, strict=True):
                self._mains_of.setdefault(owned.model_param(piece), []).append(main)
                self._piece_owner[main] = (owned, piece)

    def _build_inner_optimizers(self, param_groups: list[dict[str, Any]],
                                group_classes: list[type[torch.optim.Optimizer]],
                                optimizer_cls: type[torch.optim.Optimizer],
                                optimizer_kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """One inner torch optimizer per class over the main params, the groups in the user's
        order; see [Note: one optimizer, several classes] in optim/param_groups.py."""
        inner_groups = []
        for group in param_groups:
            inner = {k: v for k, v in group.items() if k != "params"}
            inner["params"] = [m for p in group["params"] for m in self._mains_of.get(p, [])]
            inner_groups.append(inner)
        self.optimizers, self.optimizer = build_inner_optimizers(
            inner_groups, group_classes, optimizer_cls, optimizer_kwargs, self._device
        )
        # One state for all inner optimizers: their params are disjoint, and checkpoints and
        # users read it in one place, as torch.optim's. It answers a model param too:
        # [Note: opt.state by model param] in optim/torch_state.py.
        state = TorchState(self._model_param_scalars)
        for inner in self.optimizers:
            inner.state = state
        return inner_groups

    def _build_pipeline(self, inner_groups: list[dict[str, Any]], state_dtypes: Any,
                        block_size: int | None) -> None:
        options = self.options
        mains = [m for g in inner_groups for m in g["params"]]
        # Tensor parallelism leaves TP-replicated grads out of the sums on all but one TP rank;
        # see [Note: TP grad statistics].
        counted = counted_grads(self.parallel.tp, [self.piece_info(m)[0] for m in mains], mains)
        # See [Note: state precision] in optim/state_precision.py.
        self.state_precision = StatePrecision(self.optimizer.state, state_dtypes, block_size,
                                              stochastic=options.state_rounding == "stochastic")
        # Sharded grads and params are for models at the edge of memory: one bucket's shard a
        # step keeps the inner optimizer's temporaries (AdamW's foreach step: one fp32 tensor
        # the size of what it steps) to a bucket's, not the whole shard's; the same numbers.
        sharded = any(not model.options.grad_policy.full_grads for model in self.models)
        source = (BucketByBucket(self._owned) if options.store_param_remainders
                  else WholeShard(self._owned, mains, by_bucket=bool(state_dtypes) or sharded,
                                  out_by_bucket=self._offload is not None))
        self._pipeline = StepPipeline(
            source=source, optimizers=self.optimizers, param_groups=inner_groups,
            counted=dict.fromkeys(counted), reduce_groups=self._reduce_groups,
            device=self._device, stats=self.models[0].comm_stats,
            clip_grad=options.clip_grad, log_num_zeros=options.log_num_zeros,
            clip_grad_value=options.clip_grad_value,
            grad_norm_log=self._grad_norm_log(counted) if options.log_grad_norms else None,
            state_precision=self.state_precision if state_dtypes else None,
            offload=self._offload,
        )

    def _grad_norm_log(self, counted: list[nn.Parameter]) -> GradNormLog:
        """What ``log_grad_norms`` sums; refused with experts, whose ranks hold other experts
        under the same names."""
        if any(model.experts is not None for model in self.models):
            raise ValueError(
                "log_grad_norms=True sums each name's norm over the data-parallel ranks, whose "
                "experts differ under the same names: drop it with experts, or log the global "
                "norm (clip_grad=..., StepResult.grad_norm)"
            )
        names = {p: n for model in self.models for p, n in model.param_names.items()}
        groups = [g for g in self._reduce_groups if g is not self.parallel.pp_group]
        return GradNormLog([names[self.piece_info(m)[0]] for m in counted],
                           sorted(set(names.values())), groups)

    def _alias_torch_optimizer(self, inner_groups: list[dict[str, Any]]) -> None:
        # Not Optimizer.__init__: the inner optimizer owns the groups and the state, and these
        # aliases make torch's LR schedulers and step hooks act on it directly.
        self.defaults = self.optimizer.defaults
        self.param_groups = inner_groups
        self.state = self.optimizer.state  # shared by the inner optimizers
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # ------------------------------------------------------------------ training API

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: ``loss`` multiplied by the loss scale, if any (the
        loss itself without a ``loss_scaler``), so that small fp16 grads do not underflow; the
        step divides the grads by the same scale."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers (the buffers stay allocated whatever ``set_to_none`` says);
        not ``set_to_none``, each ``p.grad`` there reads zeros until the next backward."""
        for model in self.models:
            model.zero_grad_buffer(set_to_none=set_to_none)
        if self._fault_tolerance is not None:  # [Note: fault-tolerant replicas]
            self._fault_tolerance.begin_step()

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Any:
        """Finish the grad sync, then unscale, clip and step this rank's shard, and gather the
        params. Returns the step's ``StepResult``, or with a ``closure`` what the closure
        returned, as torch.optim does (the ``StepResult`` is then ``last_step_result``).

        Args:
            closure: torch.optim's loss closure, or None: called once, with grad enabled,
                before the step; it runs forward and backward on every rank (and usually
                ``zero_grad()`` first), as under torch DDP. See [Note: step(closure)].
            grad_scaler: passed by ``torch.amp.GradScaler.step(opt)``, whose scale and inf/nan
                verdict the step then uses instead of a ``loss_scaler`` (the optimizer may not
                have both); None when called directly. See [Note: torch's GradScaler] in
                optim/amp.py.
        """
        if closure is None:
            return self._step(grad_scaler)
        # [Note: step(closure)]
        # As torch.optim's: the closure (forward and backward, on every rank) runs once under
        # enable_grad, the step follows as after a backward in the loop, and what the closure
        # returned is returned untouched; the StepResult is kept in last_step_result.
        with torch.enable_grad():
            loss = closure()
        self._step(grad_scaler)
        return loss

    def _step(self, grad_scaler: torch.amp.GradScaler | None) -> StepResult:
        loss_scaler = self._loss_scaler_for(grad_scaler)
        for model in self.models:
            model.finish_grad_sync()
            model.take_grad_writes()
            model.finish_param_sync()
        self.adopt_param_writes()
        if self._tied is not None:  # see [Note: tied stage params] in optim/tied.py
            self._tied.sum_(self.models[0].comm_stats)
        unused = {main for model in self.models for param in model.unused_params
                  for main in self._mains_of.get(param, ())}
        try:
            # A step that failed on some replica group changes nothing anywhere in this group;
            # see [Note: fault-tolerant replicas] in parallel/managed_replicas.py.
            if self._fault_tolerance is not None and not self._fault_tolerance.commit():
                result = StepResult(updated=False)
            else:
                result = self._pipeline.run(loss_scaler, unused)
        finally:
            for model in self.models:  # see [Note: p.grad under distopt] in ddp/grad_marker.py
                model.grad_reads.reset(AFTER_STEP)
        if result.updated and not self._first_step_done:
            # The state was just created between the step's temporaries; see
            # [Note: stranded host memory] in host_memory.py.
            self._first_step_done = True
            release_freed_host_memory()
        if result.updated:
            self.state.made = True  # on every rank alike: [Note: opt.state by model param]
            self._gather_params()
        for owned in self._owned:
            owned.note_params_written()
        if self._offload is not None:  # anything read outside the chunks' window, dropped
            self._offload.release()
        self.last_step_result = result
        return result

    @property
    def offload_tier(self) -> OffloadTier | None:
        """Where the masters and state rest between steps (``offload_dir``), or None."""
        return self._offload

    def settle_offloaded(self) -> None:
        """With ``offload_dir``: state made or loaded outside a step moved into the tier,
        and the tier's pages dropped from the process (after a load or a save)."""
        tier = self._offload
        if tier is None:
            return
        chunk = 0
        for owned in self._owned:
            for bucket in range(owned.num_buckets):
                tier.place_state(chunk, owned.bucket_main_params(bucket), self.optimizer.state)
                chunk += 1
        tier.release()

    def _unscaled_by(self, grad_scaler: torch.amp.GradScaler) -> None:
        """``grad_scaler.unscale_(self)`` ran: from now until the step, ``p.grad`` of the
        models' params reads the unscaled grads ([Note: torch's GradScaler] in optim/amp.py).
        """
        inverse = float(grad_stats.inverse_scale(1.0 / grad_scaler.get_scale(), self._device))
        for model in self.models:
            model.grad_reads.unscale = inverse

    def _loss_scaler_for(self, grad_scaler: torch.amp.GradScaler | None) -> Any:
        # Checked on every rank before the grad sync's collectives.
        if grad_scaler is None:
            if hasattr(self, "grad_scale") or hasattr(self, "found_inf"):
                refuse_attribute_protocol()
            return self.loss_scaler
        if self.loss_scaler is not None:
            raise ValueError(
                "the optimizer has a loss_scaler and torch.amp.GradScaler steps it too, so the "
                "grads would be unscaled by one scale and the loss scaled by the other: use "
                "one of the two (drop loss_scaler=, or call opt.step() instead of "
                "scaler.step(opt))"
            )
        return TorchGradScaler(grad_scaler, self, self._device)

    def _gather_params(self) -> None:
        """Bring every rank's model params up to date (nothing to do when replicated)."""

    def sync_model_params(self) -> None:
        """Make every rank's model params the cast of the fp32 main params (after loading them).

        Collective over the data-parallel group when the state is sharded.
        """
        for model in self.models:
            model.finish_param_sync()
        for owned in self._owned:
            owned.copy_params_out()
        if self._sharded:
            for model in self.models:
                model.start_param_sync(overlap=False)
        for owned in self._owned:
            owned.note_params_written()
        self.settle_offloaded()

    def held_params(self) -> list[torch.Tensor]:
        """The model params this rank holds between steps, buffer by buffer: each buffer's
        whole ``param_data``, or with sharded params this rank's ``param_shards``."""
        return [t for model in self.models for buf in model.flat_buffers
                for t in buf.param_storage()]

    def load_held_params(self, values: list[torch.Tensor]) -> None:
        """Copy ``values`` (``held_params()`` of a rank built alike) into the params this rank
        holds, as distopt's own write (not one the next step adopts into the main params)."""
        for model in self.models:
            model.finish_param_sync()
        with torch.no_grad():
            for held, value in zip(self.held_params(), values, strict=True):
                held.copy_(value)
        for owned in self._owned:
            owned.note_params_written()

    def _model_param_scalars(self, param: Any) -> ParamScalars | None:
        """``opt.state[param]`` for a model param of this optimizer; None for any other key."""
        groups = [mps for mps in self.model_param_groups if any(p is param for p in mps)]
        if not groups or param in self._piece_owner:
            return None
        names = {p: n for model in self.models for p, n in model.param_names.items()}
        same_group = {id(p) for p in groups[0]}
        best = None
        for main in self.main_params:
            owner = self.piece_info(main)[0]
            if main in self.state and id(owner) in same_group:
                if owner is param:
                    best = main
                    break
                best = main if best is None else best
        scalars = {} if best is None else scalar_entries(dict.__getitem__(self.state, best))
        return ParamScalars(names.get(param, "?"), scalars)

    def adopt_param_writes(self) -> None:
        """Make the fp32 main params follow whatever was written into the model's params since
        distopt last wrote them (a load into the module, ``p.copy_``); each step and each
        state dict does it first. See [Note: writes into the params] in optim/main_params.py;
        params whose ``.data`` was rebound (``vector_to_parameters``) are taken back into the
        buffers first ([Note: params rebound] in ddp/rebound_params.py)."""
        for model in self.models:
            model.adopt_rebound_params()
        for owned in self._owned:
            owned.adopt_param_writes()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the buffers are laid out, and the shards dealt, for the param groups given
        at construction.

        Args:
            param_group: torch.optim's new group; pass it in ``params=[...]`` when building
                the optimizer instead.
        """
        raise NotImplementedError(
            "distopt optimizers fix their param groups at construction: pass every group in "
            "params=[...] when building the optimizer"
        )

    @property
    def main_params(self) -> list[nn.Parameter]:
        """The fp32 pieces the inner optimizer updates, in param-group order."""
        return [m for g in self.param_groups for m in g["params"]]

    def main_grad(self, main: nn.Parameter) -> torch.Tensor | None:
        """The fp32 grad the step gives the main param ``main`` as its ``.grad`` (a view of
        the reduced grads, or their fp32 copy; None where the step makes one per bucket):
        readable after the grad sync, though ``main.grad`` is None outside the step."""
        return self._main_grads[main]

    def piece_info(self, main: nn.Parameter) -> tuple[nn.Parameter, ShardPiece]:
        """The model param the piece ``main`` (one of ``main_params``, of this rank) belongs
        to, and where the piece lies in it."""
        owned, piece = self._piece_owner[main]
        return owned.model_param(piece), piece

    # ------------------------------------------------------------------ for checkpoints
    # The interface checkpoint/format.py's ``Optimizer`` protocol names, and nothing else.

    @property
    def tied_copies(self) -> frozenset[nn.Parameter]:
        """Params tied across pipeline stages whose elements another stage counts and saves
        (this rank's copies of them); see [Note: tied stage params] in optim/tied.py."""
        return frozenset() if self._tied is None else self._tied.copies

    @property
    def sharded(self) -> bool:
        """Whether each rank owns a shard of the main params and the state (ZeRO), rather than
        all of them."""
        return self._sharded

    def pieces(self) -> list[tuple[nn.Parameter, ShardPiece, nn.Parameter]]:
        """``(model param, piece, fp32 main param)`` of every piece this rank owns, in
        param-group order (with ``store_param_remainders`` the main params hold their values
        only inside ``main_params_materialized()``)."""
        return [(*self.piece_info(main), main) for main in self.main_params]

    @contextlib.contextmanager
    def main_params_materialized(self) -> Iterator[None]:
        """Inside the block every main param holds its fp32 master values, to be read or
        written (checkpoints do both). With ``store_param_remainders`` they are rebuilt for
        the block (a transient of this rank's whole shard) and split back into this rank's
        shard of the params and the remainders after it; see [Note: param remainders]."""
        if not self.options.store_param_remainders:
            yield
            return
        # Splitting the masters back writes the params: a write of distopt's own, after any
        # the user made is taken up ([Note: writes into the params] in optim/main_params.py).
        self.adopt_param_writes()
        with contextlib.ExitStack() as stack:
            for owned in self._owned:
                for bucket in range(owned.num_buckets):
                    stack.enter_context(owned.bucket_masters(bucket))
            yield
        for owned in self._owned:
            owned.note_params_written()

    def main_param_values(self) -> list[torch.Tensor]:
        """The fp32 master values of every main param, in ``main_params`` order: the main
        params themselves, or, with ``store_param_remainders``, rebuilt from the bf16 params
        and the remainders (new tensors)."""
        values = []
        for main in self.main_params:
            owned, piece = self._piece_owner[main]
            values.append(owned.main_value(main, piece))
        return values

    def main_param_storage(self) -> list[torch.Tensor]:
        """The tensors that keep the main params between steps (what memory counts): the
        main params, or the int16 remainders."""
        if self.options.store_param_remainders:
            return [t for owned in self._owned for t in owned.master_storage()]
        return self.main_params

    def param_group_of(self, main: nn.Parameter) -> dict[str, Any]:
        """The param group (of ``param_groups``) that holds the main param ``main``."""
        return self._group_by_main[main]

    @functools.cached_property
    def _main_grads(self) -> dict[nn.Parameter, torch.Tensor | None]:
        return {main: grad for owned in self._owned
                for main, grad in zip(owned.main_params, owned.main_grads, strict=True)}

    @functools.cached_property
    def _group_by_main(self) -> dict[nn.Parameter, dict[str, Any]]:
        # The groups are fixed at construction (add_param_group raises), so this never changes.
        return {main: group for group in self.param_groups for main in group["params"]}


def as_model_list(model: Any, who: str) -> list[DistributedDataParallel]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise ValueError(f"{who} needs at least one model")
    for m in models:
        if not isinstance(m, DistributedDataParallel):
            raise TypeError(
                f"{who} takes distopt.DistributedDataParallel models, got {type(m).__name__}: "
                "wrap the module first, ddp = distopt.DistributedDataParallel(module)"
            )
    return models


def _check_model_parallel_group(group: Any, dp_group: dist.ProcessGroup | None) -> None:
    if group is None:
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "model_parallel_group must be None or a torch.distributed.ProcessGroup that this "
            f"rank belongs to (from dist.new_group), got {group!r}"
        )
    # A data-parallel group and a model-parallel group through this rank meet only in it;
    # any other shared rank would hold the same grads twice and be counted twice.
    mp_ranks = set(dist.get_process_group_ranks(group))
    dp_ranks = set(dist.get_process_group_ranks(dp_group)) if dp_group is not None else set()
    shared = sorted((mp_ranks & dp_ranks) - {dist.get_rank()})
    if shared:
        raise ValueError(
            f"model_parallel_group shares ranks {shared} with the data-parallel group; the two "
            "must cross only at this rank (data-parallel replicas hold the same grads, which "
            "would be counted once per replica): pass the group of ranks that hold the other "
            "parts of the model"
        )
