"""DistributedOptimizer (ZeRO-1/2) and BasicOptimizer (replicated), over distopt DDP buffers.

Data flow of one step, for one buffer of d ranks (docs/design.md has the memory table and the
map of who calls whom)::

    grad_data  [N]      grads accumulated by the DDP hooks (dtype grad_dtype)
      | reduce-scatter (average), bucket by bucket, overlapped with backward
    grad_shard [N/d]    this rank's chunk of every bucket, now reduced
      | fp32 grads: used in place;  else copied once per bucket into grad_fp32 [N/d]
      | (with store_param_remainders: into a transient of one bucket, during its step)
    pieces              one fp32 main param per (param, shard) overlap, a view into
                        param_data's shard (fp32 params) or into shard_fp32 [N/d] (otherwise);
                        its .grad a view into the shard of the reduced grads
      | unscale + inf check (fp16), global norm + clip, inner torch.optim step on the pieces
    param_shard [N/d]   updated in place (fp32), or cast from shard_fp32 once per bucket
      | all-gather, bucket by bucket, optionally overlapped with the next forward
    param_data [N]      every rank's model params are up to date

The inner optimizer is an ordinary ``torch.optim`` optimizer whose params are the pieces, so
its state (Adam's moments) exists only for the 1/d of the elements this rank owns. Every memory
cost beyond model params and grads is therefore 1/d of the model, padding aside; nothing is
allocated per step but the inner optimizer's own temporaries, except with
``store_param_remainders``, whose fp32 masters and (for bf16/fp16 grads) fp32 main grads
exist only during the step, one bucket's shard at a time (see [Note: param remainders] in
optim/remainders.py and [Note: step chunks] in optim/step.py).
BasicOptimizer
is the same pipeline with every rank owning whole buckets, all-reduced grads and no gather.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..ddp.wrapper import DistributedDataParallel
from ..options import StateDtype, StepOptions
from .base import BufferOptimizer, as_model_list
from .loss_scalers import LossScaler
from .step import StepResult

__all__ = ["BasicOptimizer", "DistributedOptimizer", "StepResult"]


class StateDictFunctions(Protocol):
    """The functions of checkpoint/state_dict.py, which do the state-dict methods' work."""

    def state_dict(self, opt: BufferOptimizer) -> dict[str, Any]: ...

    def own_state_dict(self, opt: BufferOptimizer) -> dict[str, Any]: ...

    def rank_part(self, opt: BufferOptimizer) -> dict[str, Any]: ...

    def load_state_dict(self, opt: BufferOptimizer, state_dict: dict[str, Any]) -> None: ...

    def consolidated_state_dict(self, opt: BufferOptimizer, to: int) -> dict[str, Any] | None:
        ...

    def heal_state(self, opt: BufferOptimizer) -> dict[str, Any]: ...

    def load_heal_state(self, opt: BufferOptimizer, state: dict[str, Any]) -> None: ...


# The checkpoint package builds on this layer, so it hands its functions down when it is
# imported (``import distopt`` imports it, before any optimizer can be built); see
# [Note: one-way imports] in checkpoint/__init__.py.
_functions: StateDictFunctions | None = None


def use_state_dict_functions(functions: StateDictFunctions) -> None:
    """Take checkpoint/state_dict.py's functions; that module calls this when it is imported."""
    global _functions
    _functions = functions


def _state_dict_functions() -> StateDictFunctions:
    if _functions is None:
        raise RuntimeError("an optimizer's state dict needs distopt.checkpoint, which was not "
                           "imported")
    return _functions


class _CheckpointedOptimizer(BufferOptimizer):
    """A BufferOptimizer whose state dict is distopt's DP-size independent format."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state, keyed by parameter name ([Note: DP-size independent state] in
        distopt/checkpoint/format.py): whole on one process or replicated; sharded over
        several ranks, the one ``consolidate_state_dict`` gathered to this rank, else this
        rank's part, as FSDP2's optimizer state dict holds each rank's shards, marked with
        the rank it belongs to ([Note: torch's way of saving the optimizer] in
        checkpoint/state_dict.py)."""
        if not self._state_is_sharded():
            return _state_dict_functions().own_state_dict(self)
        if self._consolidated is not None:
            return self._consolidated
        return _state_dict_functions().rank_part(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state (a shard of each param it owns), in
        ``state_dict()``'s format: one file per rank, or merged with the others' (a load takes
        any shards that cover its own pieces)."""
        return _state_dict_functions().state_dict(self)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state to data-parallel rank ``to``, whose
        ``state_dict()`` is then the whole state, as torch's ``ZeroRedundancyOptimizer``
        does; collective over the data-parallel group. Refused with tensor or pipeline
        parallelism or experts, whose ranks hold other params: use distopt.save_checkpoint."""
        if (self.parallel.tp is not None or self.parallel.pp_group is not None
                or any(m.experts is not None for m in self.models)):
            raise ValueError(
                "consolidate_state_dict() gathers the data-parallel ranks' shards; with tensor "
                "or pipeline parallelism or experts other ranks hold other params: save with "
                "distopt.save_checkpoint(path, ddp, opt), which writes one checkpoint of the "
                "whole model"
            )
        self._consolidated = _state_dict_functions().consolidated_state_dict(self, to)

    def heal_state(self) -> dict[str, Any]:
        """This rank's state for the same rank of a torchft replica group that heals from it
        (its pieces of the state and the model params it holds); see docs/fault-tolerance.md.
        """
        return _state_dict_functions().heal_state(self)

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Load ``heal_state()`` of the same rank of a group built alike; on this rank alone.

        Args:
            state: what ``heal_state()`` returned on the healthy rank.
        """
        _state_dict_functions().load_heal_state(self, state)

    def _state_is_sharded(self) -> bool:
        return self.sharded and self.parallel.dp_size > 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of ``state_dict()``'s format, written at any DP size; collective.

        Args:
            state_dict: the whole state (``state_dict()`` of a replicated optimizer, or of
                the rank a sharded one was consolidated to), or shards that cover this rank's
                pieces: its own ``state_dict()`` or ``sharded_state_dict()`` at the same DP
                size (a part ``state_dict()`` marked as another rank's is refused), or every
                rank's merged with ``distopt.checkpoint.merge_state_dicts`` at another. Every
                rank checks it against the model, the optimizer class, the groups and the loss
                scaler before any rank loads, then takes the pieces it owns and the groups'
                options (a changed ``lr`` is a warm restart, as with torch.optim).
        """
        _state_dict_functions().load_state_dict(self, state_dict)


class DistributedOptimizer(_CheckpointedOptimizer):
    """ZeRO-1/2: fp32 main params and optimizer state sharded over the data-parallel ranks.

    Args:
        model: a distopt DistributedDataParallel built with ``use_distributed_optimizer=True``,
            or a list of them (model chunks sharing one data-parallel group).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass: element-wise (AdamW, SGD, ...,
            or one declared with ``distopt.register_elementwise_optimizer``), whose state is
            sharded element by element, or any other (``torch.optim.Muon``,
            ``torch.optim.Adafactor``, a repository's own LARS), whose params are each owned
            whole by one rank; LBFGS and SparseAdam are refused. See [Note: optimizer kinds]
            in optim/kinds.py.
        params: optional torch-style param groups over the module's params (a list of params
            or of ``(name, param)`` pairs such as ``model.named_parameters()``, or of dicts
            with ``params`` and per-group options; named params put ``param_names`` in each
            group, as torch.optim does). None: one group with all trainable params. A group
            may name its own class under ``"optimizer"`` (Muon for the hidden matrices,
            ``"optimizer": torch.optim.AdamW`` for the rest); its options then come from the
            group and that class's defaults, not ``optimizer_kwargs``. See
            [Note: one optimizer, several classes].
        clip_grad: max global grad norm (one norm over every shard, bucket and dtype, and over
            the tensor-parallel ranks of DTensor params), or None.
        loss_scaler: ``DynamicLossScaler()`` or ``ConstantLossScaler(s)`` for fp16, or None.
        overlap_param_gather: all-gather the updated params in the background and let the next
            forward wait for each bucket just before its first use.
        log_num_zeros: count the zero elements of the clipped grads in every step's result.
        clip_grad_value: clamp every element of the reduced grads to [-v, v] before the step
            (torch's ``clip_grad_value_``, which ``p.grad`` cannot take under distopt), before
            ``clip_grad``'s norm; None: no clamp.
        log_grad_norms: each step's result carries ``grad_norms``, every param's reduced grad
            norm by name (after unscaling and ``clip_grad_value``, before ``clip_grad``): the
            per-layer norms torch users log from ``p.grad``; one small all-reduce per step.
        model_parallel_group: the ranks that hold the other parts of the model (tensor or
            pipeline parallel), or None. The inf/nan verdict is agreed over it and the grad
            norm and zero count are summed over it, besides the data-parallel group; each
            grad element must belong to exactly one of its ranks.
        store_param_remainders: keep int16 remainders instead of fp32 main params (bf16
            params only); see [Note: param remainders] in optim/remainders.py.
        state_dtype: hold every per-element state tensor of the inner optimizer (Adam's
            moments, momentum buffers) in this dtype between steps, e.g. ``torch.bfloat16``,
            or per state key (``{"exp_avg": torch.float16, "exp_avg_sq": torch.bfloat16}``);
            each chunk's state is expanded to fp32 for the inner step and rounded back. None:
            fp32. fp16 and fp8 (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) are held
            with one power-of-two scale per block of elements. See [Note: state precision]
            in optim/state_precision.py.
        state_block_size: elements per scale of the state held in fp16 or fp8 (None: 32);
            refused where no state is held in those dtypes.
        state_rounding: "nearest" (ties to even) or "stochastic" (unbiased: up or down with
            probability by distance), how state is narrowed to ``state_dtype``.
        offload_dir: a directory (on a local disk, NVMe for speed) whose file keeps this
            rank's fp32 main params (or remainders) and optimizer state between steps; the
            step reads each bucket's shard from it, steps it and writes it back, the next
            bucket's read overlapped, so that RAM holds a bounded window of buckets rather
            than the whole state. The same numbers as in memory; CPU only. See [Note: the
            offload tier] in optim/offload.py.
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr=..., betas=..., weight_decay=...).

    The DDP's buffers are laid out when the optimizer is built, for the owners of its
    whole-tensor groups ([Note: layout planned once] in layout/model_layout.py): build it before
    the first backward.
    """

    _sharded = True

    def __init__(
        self,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        clip_grad: float | None = None,
        loss_scaler: LossScaler | None = None,
        overlap_param_gather: bool = False,
        *,
        log_num_zeros: bool = False,
        clip_grad_value: float | None = None,
        log_grad_norms: bool = False,
        model_parallel_group: dist.ProcessGroup | None = None,
        store_param_remainders: bool = False,
        state_dtype: StateDtype = None,
        state_block_size: int | None = None,
        state_rounding: str = "nearest",
        offload_dir: str | os.PathLike[str] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        models = as_model_list(model, "DistributedOptimizer")
        for m in models:
            if not m.options.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs a DistributedDataParallel built with "
                    "use_distributed_optimizer=True (it reduce-scatters grads); this one "
                    "all-reduces them: rebuild it, or use distopt.BasicOptimizer"
                )
        options = StepOptions(clip_grad=clip_grad, log_num_zeros=log_num_zeros,
                              clip_grad_value=clip_grad_value, log_grad_norms=log_grad_norms,
                              overlap_param_gather=overlap_param_gather,
                              store_param_remainders=store_param_remainders,
                              state_dtype=state_dtype, state_block_size=state_block_size,
                              state_rounding=state_rounding,
                              offload_dir=None if offload_dir is None else os.fspath(offload_dir))
        super().__init__(
            models, optimizer_cls, params, options, loss_scaler, model_parallel_group,
            optimizer_kwargs,
        )

    def _gather_params(self) -> None:
        for model in self.models:
            model.start_param_sync(overlap=self.options.overlap_param_gather)


class BasicOptimizer(_CheckpointedOptimizer):
    """The replicated counterpart of DistributedOptimizer, with the same interface.

    Every rank keeps full fp32 main params and optimizer state and steps all of them, from
    all-reduced grads: the baseline distopt's sharding is measured against, and the optimizer
    of a model trained on one process.

    Args:
        model: a distopt DistributedDataParallel built with ``use_distributed_optimizer=False``
            (one that reduce-scatters is refused, unless it spans a single rank), a list of
            them (model chunks sharing one data-parallel group), or a plain ``nn.Module``
            trained on one process, which is given the same buffers and hooks here (a param
            that gets no grad is then left out of the step, as torch.optim leaves it).
        optimizer_cls: the inner ``torch.optim.Optimizer`` subclass (AdamW, SGD, Muon, ...),
            as for DistributedOptimizer.
        params: optional torch-style param groups over the module's params (named or not),
            as for DistributedOptimizer; None: one group with all trainable params.
        clip_grad: max global grad norm (one norm over every bucket and dtype, and over the
            tensor-parallel ranks of DTensor params), or None.
        loss_scaler: ``DynamicLossScaler()`` or ``ConstantLossScaler(s)`` for fp16, or None.
        log_num_zeros: count the zero elements of the clipped grads in every step's result.
        clip_grad_value: clamp every element of the reduced grads to [-v, v] before the step
            and before ``clip_grad``'s norm, as for DistributedOptimizer; None: no clamp.
        log_grad_norms: each step's result carries ``grad_norms``, every param's reduced grad
            norm by name, as for DistributedOptimizer.
        grad_dtype: the dtype of the grad buffer a plain ``nn.Module`` is given (None: each
            param's own dtype); a DistributedDataParallel keeps its own ``grad_dtype``.
        model_parallel_group: the ranks that hold the other parts of the model (tensor or
            pipeline parallel), or None, as for DistributedOptimizer.
        state_dtype: the dtype the inner optimizer's per-element state is held in between
            steps (None: fp32), as for DistributedOptimizer.
        state_block_size: elements per scale of the state held in fp16 or fp8 (None: 32), as
            for DistributedOptimizer.
        state_rounding: "nearest" or "stochastic", how state is narrowed to ``state_dtype``, as
            for DistributedOptimizer.
        **optimizer_kwargs: passed to ``optimizer_cls`` (lr=..., betas=..., weight_decay=...).
    """

    _sharded = False

    def __init__(
        self,
        model: DistributedDataParallel | nn.Module | Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        clip_grad: float | None = None,
        loss_scaler: LossScaler | None = None,
        *,
        log_num_zeros: bool = False,
        clip_grad_value: float | None = None,
        log_grad_norms: bool = False,
        grad_dtype: torch.dtype | None = torch.float32,
        model_parallel_group: dist.ProcessGroup | None = None,
        state_dtype: StateDtype = None,
        state_block_size: int | None = None,
        state_rounding: str = "nearest",
        **optimizer_kwargs: Any,
    ) -> None:
        if isinstance(model, nn.Module) and not isinstance(model, DistributedDataParallel):
            # A plain module: the same buffers and hooks, on this process alone; as with
            # torch.optim, a param that got no grad is left out of the step.
            model = DistributedDataParallel.for_this_process(
                model, grad_dtype=grad_dtype, use_distributed_optimizer=False,
                find_unused_parameters=True,
            )
        models = as_model_list(model, "BasicOptimizer")
        for m in models:
            if m.options.use_distributed_optimizer and m.dp_size > 1:
                raise ValueError(
                    "BasicOptimizer needs all-reduced grads, but this DistributedDataParallel "
                    "reduce-scatters them: build it with use_distributed_optimizer=False, or "
                    "use distopt.DistributedOptimizer"
                )
        options = StepOptions(clip_grad=clip_grad, log_num_zeros=log_num_zeros,
                              clip_grad_value=clip_grad_value, log_grad_norms=log_grad_norms,
                              state_dtype=state_dtype, state_block_size=state_block_size,
                              state_rounding=state_rounding)
        super().__init__(
            models, optimizer_cls, params, options, loss_scaler, model_parallel_group,
            optimizer_kwargs,
        )
