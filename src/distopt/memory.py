"""What training state costs per parameter: the theory (DESIGN.md's table) and a measurement.

The measurement walks the tensors a rank really holds and adds up the bytes of their storages,
each storage once, so views (main params that alias the param buffer, main grads that alias
the grad buffer) cost nothing extra, exactly as in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from .dtensor import local_tensor

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _element_size(dtype: torch.dtype) -> int:
    if dtype not in _BYTES:
        raise ValueError(f"unsupported dtype {dtype}; use torch.float32, bfloat16 or float16")
    return _BYTES[dtype]


def theoretical_bytes_per_param(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype | None,
    dp_size: int,
    *,
    distributed: bool = True,
    optimizer_state_bytes: int = 8,
) -> float:
    """Bytes per parameter of params, grads, fp32 main params/grads and optimizer state.

    ``optimizer_state_bytes`` is 8 for Adam's two fp32 moments, 4 for SGD with momentum.
    ``distributed=False`` gives the replicated (DDP + torch optimizer) figure.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    grad_dtype = grad_dtype or param_dtype
    model = _element_size(param_dtype) + _element_size(grad_dtype)
    main_params = 4 if param_dtype != torch.float32 else 0
    main_grads = 4 if grad_dtype != torch.float32 else 0
    sharded = main_params + main_grads + optimizer_state_bytes
    return model + sharded / (dp_size if distributed else 1)


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes one rank holds, by role; ``num_params`` counts the model's trainable elements."""

    num_params: int
    params: int
    grads: int
    main_params: int
    main_grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main_params + self.main_grads + self.optimizer_state

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.num_params

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total, "bytes_per_param": self.bytes_per_param}


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (which it extends):
    each storage counts once, so views cost nothing. DTensors count their local shard."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def measure_state_bytes(optimizer) -> MemoryReport:
    """Measure what this rank holds for the models and the distopt optimizer given."""
    seen: set[int] = set()

    def counted(tensors) -> int:
        return storage_bytes(tensors, seen)

    buffers = [buf for model in optimizer.models for buf in model.flat_buffers]
    params = counted(buf.param_data for buf in buffers)
    grads = counted(buf.grad_data for buf in buffers)
    main_params = counted(optimizer.main_params)
    main_grads = counted(m.grad for m in optimizer.main_params)
    # Step counters are one scalar per tensor, not per element: bookkeeping, not state.
    state = counted(
        v for s in optimizer.state.values() for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    return MemoryReport(
        # Local elements: a tensor-parallel param's other shards live on other ranks.
        num_params=sum(local_tensor(p).numel() for model in optimizer.models for p in model.params),
        params=params,
        grads=grads,
        main_params=main_params,
        main_grads=main_grads,
        optimizer_state=state,
    )
