"""The options of the DDP wrapper and of the optimizers, each validated and stored in one place.

``DistributedDataParallel`` and ``DistributedOptimizer`` take their options as arguments (the
public API) and build one of these frozen records from them, which checks every value once and
is then the only place the wrapper reads them from (``ddp.options``, ``opt.options``). A value
that is wrong raises here, on every rank, before any collective. A later option joins the
record it belongs to, with its check beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)
_FP32_GRADS_REFUSED = (
    "reduce_scatter_with_fp32_accumulation=True needs bf16 or fp16 grads (fp32 grads are summed "
    "in fp32 already), but the grads would be fp32; pass grad_dtype=torch.bfloat16 (or "
    "torch.float16), or drop the option"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class GradSyncOptions:
    """How ``DistributedDataParallel`` keeps grads and reduces them over the DP group."""

    grad_dtype: torch.dtype | None = torch.float32
    """dtype of the grad buffer and of the reduction; None: each parameter's own dtype."""
    bucket_size: int | None = None
    """Elements per bucket; None: ``layout.default_bucket_size`` for the model and group."""
    overlap_grad_reduce: bool = True
    """Start each bucket's reduction during backward, once its last grad is accumulated."""
    use_distributed_optimizer: bool = True
    """Reduce-scatter buckets (DistributedOptimizer); False all-reduces them (BasicOptimizer)."""
    find_unused_parameters: bool = False
    """Track which params got a grad on any rank; those that got none skip the step."""
    check_for_nan_in_grad: bool = False
    """After the reduction, raise on every rank naming the first param with a nan or inf."""
    reduce_scatter_with_fp32_accumulation: bool = False
    """Send bf16/fp16 grads as they are, but sum each shard's d chunks in fp32 and round the
    average once; see [Note: fp32-accumulated reduce-scatter] in collectives.py."""

    def __post_init__(self) -> None:
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(
                f"grad_dtype={self.grad_dtype} is not supported; use torch.float32, "
                "torch.bfloat16, torch.float16 or None (each parameter's own dtype)"
            )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(
                f"bucket_size must be a positive element count, got {self.bucket_size}"
            )
        if self.reduce_scatter_with_fp32_accumulation:
            self._check_fp32_accumulation()

    def _check_fp32_accumulation(self) -> None:
        if not self.use_distributed_optimizer:
            raise ValueError(
                "reduce_scatter_with_fp32_accumulation=True needs reduce-scattered buckets; "
                "pass use_distributed_optimizer=True (DistributedOptimizer) or drop the option"
            )
        if self.grad_dtype == torch.float32:
            raise ValueError(_FP32_GRADS_REFUSED)

    def check_param_dtypes(self, param_dtypes: set[torch.dtype]) -> None:
        """The check that needs the model: with ``grad_dtype=None`` grads take the params' dtypes,
        and fp32 accumulation needs some of them to be bf16 or fp16."""
        if (
            self.reduce_scatter_with_fp32_accumulation
            and self.grad_dtype is None
            and not param_dtypes & set(LOW_PRECISION)
        ):
            raise ValueError(_FP32_GRADS_REFUSED)

    def reduces_with_fp32_accumulation(self, grad_dtype: torch.dtype) -> bool:
        """Whether a buffer with grads of ``grad_dtype`` uses the fp32-accumulated
        reduce-scatter (fp32 grads are reduced in fp32 anyway)."""
        return self.reduce_scatter_with_fp32_accumulation and grad_dtype in LOW_PRECISION


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOptions:
    """What an optimizer's ``step()`` does around the inner ``torch.optim`` update."""

    clip_grad: float | None = None
    """Max global grad norm (one norm over every shard, bucket, dtype and TP rank), or None."""
    log_num_zeros: bool = False
    """Count the zero elements of the clipped grads in every step's result."""
    overlap_param_gather: bool = False
    """All-gather updated params in the background; the next forward waits per bucket."""
    store_param_remainders: bool = False
    """Keep int16 remainders instead of fp32 main params (bf16 params only); see
    [Note: param remainders] in optimizer.py."""

    def __post_init__(self) -> None:
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(
                f"clip_grad must be a positive max norm or None, got {self.clip_grad}"
            )

    def check_param_dtypes(self, param_dtypes: set[torch.dtype]) -> None:
        """The check that needs the model: remainders complete bf16 params only."""
        others = sorted(str(d) for d in param_dtypes - {torch.bfloat16})
        if self.store_param_remainders and others:
            raise ValueError(
                "store_param_remainders=True needs bf16 params (the bf16 param is the high half "
                f"of its fp32 master, the remainder the low half), but the model has {others} "
                "params; train in bf16 (model.to(torch.bfloat16)) or drop the option"
            )
