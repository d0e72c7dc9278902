"""The options of the DDP wrapper and of the optimizers, each validated and stored in one place.

``DistributedDataParallel`` and ``DistributedOptimizer`` take their options as arguments (the
public API) and build one of these frozen records from them, which checks every value once and
is then the only place the wrapper reads them from (``ddp.options``, ``opt.options``). A value
that is wrong raises here, on every rank, before any collective. A later option joins the
record it belongs to, with its check beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .sharding import POLICIES, GradPolicy, Sharding, resolve_sharding

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)
StateDtype = torch.dtype | Mapping[str, torch.dtype] | None
"""One dtype for every per-element optimizer state tensor, one per state key, or None (fp32);
see [Note: state precision] in optim/state_precision.py."""


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                torch.float8_e5m2)
"""fp16 and fp8 are held with block scales; see [Note: state precision]."""


def check_state_dtype(state_dtype: Any) -> None:
    """Raise unless ``state_dtype`` is None, a supported float dtype or a dict of them by key
    (what can be checked without the optimizer classes)."""
    if state_dtype is None:
        return
    items = state_dtype.items() if isinstance(state_dtype, Mapping) else [(None, state_dtype)]
    if isinstance(state_dtype, Mapping) and not state_dtype:
        raise ValueError("state_dtype={} names no state key; pass None for fp32 state")
    for key, dtype in items:
        where = "state_dtype" if key is None else f"state_dtype[{key!r}]"
        if key is not None and not isinstance(key, str):
            raise TypeError(f"state_dtype keys are state names such as 'exp_avg', got {key!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"{where} must be a torch.dtype (torch.bfloat16, torch.float16, "
                f"torch.float8_e4m3fn, torch.float8_e5m2 or torch.float32), got {dtype!r}"
            )
        if dtype not in STATE_DTYPES:
            kind = "not a float type" if not dtype.is_floating_point else "not supported"
            raise ValueError(
                f"{where}={dtype} is {kind}: distopt holds optimizer state in "
                "torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2 or "
                "torch.float32"
            )


STATE_ROUNDINGS = ("nearest", "stochastic")


def check_state_block_size(state_block_size: Any) -> None:
    """Raise unless ``state_block_size`` is None or a positive element count."""
    if state_block_size is None:
        return
    if isinstance(state_block_size, bool) or not isinstance(state_block_size, int):
        raise TypeError(f"state_block_size must be an int (elements per scale) or None, got "
                        f"{state_block_size!r}")
    if state_block_size < 1:
        raise ValueError(f"state_block_size must be a positive element count, got "
                         f"{state_block_size}")


# The rules that tie one option to dtypes, each written once: the library's records below,
# ``distopt train``'s config and ``distopt memory`` all call them, and each names the option
# in its own words (a keyword, or a flag) before the reason.

def remainders_problem(param_dtypes: Iterable[torch.dtype]) -> str | None:
    """Why ``store_param_remainders`` cannot complete params of these dtypes, or None."""
    others = sorted(str(d) for d in set(param_dtypes) - {torch.bfloat16})
    if not others:
        return None
    return ("needs bf16 params (the bf16 param is the high half of its fp32 master, the "
            f"remainder the low half), but there are {', '.join(others)} params")


def fp32_accumulation_problem(grad_dtypes: Iterable[torch.dtype]) -> str | None:
    """Why ``reduce_scatter_with_fp32_accumulation`` has nothing to do for grads of these
    dtypes (none bf16 or fp16: fp32 grads are summed in fp32 already), or None."""
    if set(grad_dtypes) & set(LOW_PRECISION):
        return None
    return "needs bf16 or fp16 grads (fp32 grads are summed in fp32 already)"


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
    average once; see [Note: fp32-accumulated reduce-scatter] in comm/collectives.py."""
    shard_grads: bool = False
    """Keep only this rank's reduced shard of the grads between steps, each bucket's full grads
    only while it is reduced; see [Note: sharded grads] in ddp/buffers/grad_pool.py."""
    shard_params: bool = False
    """Keep only this rank's shard of the params between uses (implies ``shard_grads``); see
    [Note: sharded params] in ddp/buffers/param_storage.py."""
    reshard_after_forward: bool = True
    """With sharded params: free a bucket's gathered params after the forward of the modules
    that use it (gathered again for their backward), or keep them until backward used them."""
    sharding: Sharding | str | None = None
    """How much each rank holds a shard of: "none", "optim" or "optim_grads"; None: what
    ``use_distributed_optimizer`` and ``shard_grads`` say. Resolved into a ``Sharding``, with
    the two older spellings set to agree; see [Note: sharding strategy] in sharding.py."""
    broadcast_buffers: bool = True
    """Broadcast the first ranks' module buffers (BatchNorm statistics) over the DP group
    before a forward, as torch DDP does; see [Note: buffer broadcasting] in
    ddp/module_buffers.py."""

    def __post_init__(self) -> None:
        sharding = resolve_sharding(self.sharding,
                                    use_distributed_optimizer=self.use_distributed_optimizer,
                                    shard_grads=self.shard_grads, shard_params=self.shard_params)
        object.__setattr__(self, "sharding", sharding)
        object.__setattr__(self, "use_distributed_optimizer", sharding is not Sharding.NONE)
        object.__setattr__(self, "shard_grads", sharding in (Sharding.OPTIM_GRADS,
                                                             Sharding.OPTIM_GRADS_PARAMS))
        object.__setattr__(self, "shard_params", sharding is Sharding.OPTIM_GRADS_PARAMS)
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got "
                             f"{self.reshard_after_forward!r}")
        if not isinstance(self.broadcast_buffers, bool):
            raise ValueError(
                f"broadcast_buffers must be True (the first ranks' module buffers are "
                f"broadcast before each forward, as torch DDP does) or False (each rank keeps "
                f"its own), got {self.broadcast_buffers!r}"
            )
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

    @property
    def grad_policy(self) -> GradPolicy:
        """What the sharding means for the grad sync (sharding.py)."""
        return POLICIES[self.sharding]

    def _check_fp32_accumulation(self) -> None:
        if not self.use_distributed_optimizer:
            raise ValueError(
                "reduce_scatter_with_fp32_accumulation=True needs reduce-scattered buckets; "
                "pass use_distributed_optimizer=True (DistributedOptimizer) or drop the option"
            )
        if self.grad_dtype is not None:
            self._refuse_fp32_grads({self.grad_dtype})

    def check_param_dtypes(self, param_dtypes: set[torch.dtype]) -> None:
        """The check that needs the model: with ``grad_dtype=None`` grads take the params' dtypes,
        and fp32 accumulation needs some of them to be bf16 or fp16."""
        if self.reduce_scatter_with_fp32_accumulation and self.grad_dtype is None:
            self._refuse_fp32_grads(param_dtypes)

    @staticmethod
    def _refuse_fp32_grads(grad_dtypes: set[torch.dtype]) -> None:
        problem = fp32_accumulation_problem(grad_dtypes)
        if problem:
            raise ValueError(
                f"reduce_scatter_with_fp32_accumulation=True {problem}, but the grads would be "
                "fp32; pass grad_dtype=torch.bfloat16 (or torch.float16), or drop the option"
            )

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
    clip_grad_value: float | None = None
    """Clamp each reduced grad element to [-v, v] (torch's ``clip_grad_value_``), or None."""
    log_grad_norms: bool = False
    """Give every step's result each param's reduced grad norm, by name."""
    overlap_param_gather: bool = False
    """All-gather updated params in the background; the next forward waits per bucket."""
    store_param_remainders: bool = False
    """Keep int16 remainders instead of fp32 main params (bf16 params only); see
    [Note: param remainders] in optim/remainders.py."""
    state_dtype: StateDtype = None
    """The dtype per-element optimizer state is held in between steps (one, or a dict per
    state key), expanded to fp32 one chunk at a time for the inner step; None: fp32. See
    [Note: state precision] in optim/state_precision.py."""
    state_block_size: int | None = None
    """Elements per scale of the state held in fp16 or fp8; None: 32. Refused where no
    state is held in those dtypes (bf16 and fp32 need no scales)."""
    state_rounding: str = "nearest"
    """How state is narrowed to ``state_dtype``: "nearest" (ties to even) or "stochastic"
    (up or down with probability by distance, so unbiased). Refused where all state is fp32."""
    offload_dir: str | None = None
    """A directory whose file keeps the main params and optimizer state between steps, one
    bucket's shard in memory at a time; see [Note: the offload tier] in optim/offload.py."""

    def __post_init__(self) -> None:
        check_state_dtype(self.state_dtype)
        check_state_block_size(self.state_block_size)
        if self.state_rounding not in STATE_ROUNDINGS:
            raise ValueError(f"state_rounding must be 'nearest' or 'stochastic', got "
                             f"{self.state_rounding!r}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(
                f"clip_grad must be a positive max norm or None, got {self.clip_grad}"
            )
        if self.clip_grad_value is not None and not self.clip_grad_value > 0:
            raise ValueError(f"clip_grad_value must be a positive bound or None, got "
                             f"{self.clip_grad_value}")

    def check_param_dtypes(self, param_dtypes: set[torch.dtype]) -> None:
        """The check that needs the model: remainders complete bf16 params only."""
        problem = remainders_problem(param_dtypes) if self.store_param_remainders else None
        if problem:
            raise ValueError(
                f"store_param_remainders=True {problem}; train in bf16 "
                "(model.to(torch.bfloat16)) or drop the option"
            )
