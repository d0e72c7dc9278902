"""How a ``BufferOptimizer`` is built, stage by stage: the arguments checked, the param groups
resolved, the DDP's buffers laid out for the owners of whole tensors, the offload tier, the fp32
main params of this rank's part, one inner torch optimizer per class, and the step pipeline
(see docs/design.md, "Who calls whom"). A mixin of ``BufferOptimizer`` (optim/base.py), whose
``__init__`` runs ``_construct`` on every rank inside the stages' agreement.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cross_rank.agree import agree_on_refusal
from ..cross_rank.optimizer import check_same_optimizer, describe_optimizer
from ..ddp.wrapper import DistributedDataParallel
from ..layout.elementwise import ShardPiece
from ..options import StepOptions
from ..parallel.process_groups import ParallelGroups, common_groups
from ..parallel.tensor_parallel import counted_grads
from .kinds import check_optimizer_cls
from .local_params import LocalParams
from .loss_scalers import ConstantLossScaler, DynamicLossScaler, LossScaler
from .main_params import ShardMainParams
from .offload import OffloadError, OffloadTier, region_bytes
from .param_groups import (
    build_inner_optimizers,
    group_class,
    ignored_params,
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
from .torch_state import TorchState


class OptimizerConstruction:
    """The construction stages of ``BufferOptimizer``; see the module's docstring."""

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
        # torch DDP's ignore list: [Note: ignored params stepped locally] in
        # optim/local_params.py.
        self.local_params = (
            LocalParams(self._local_per_group, inner_groups, group_classes, optimizer_cls,
                        optimizer_kwargs, self._device, ignored_params(self.models))
            if any(self._local_per_group) else None)
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
        param_groups, self._local_per_group = normalize_param_groups(params, self.models)
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
            local=self.local_params,
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
