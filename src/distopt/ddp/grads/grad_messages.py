"""What a refused use of ``p.grad`` says: the param, why, and what works instead. See
[Note: p.grad under distopt] in ddp/grads/grad_marker.py.
"""

from __future__ import annotations

from typing import Any

from .grad_reads import NORMS

WHAT_WORKS = (
    "What torch scripts do with p.grad works: torch.nn.utils.clip_grad_norm_, clip_grad_value_ "
    f"and get_total_norm, p.grad.norm() and torch.linalg.vector_norm(p.grad) ({NORMS} with "
    "no communication), p.grad is None, p.grad = None or a tensor of the param's shape, "
    "element-wise ops in place or with out=p.grad (operands of the param's shape or "
    "broadcasting to it), and sum, mean, amax, amin and norms of any order, whole or along "
    "dims (one collective: on every rank). For the rest pass the optimizer "
    "(distopt.DistributedOptimizer or BasicOptimizer) what you read p.grad for: clip_grad= "
    "(the global norm is opt.step().grad_norm), clip_grad_value=, log_grad_norms=True (each "
    "param's norm in opt.step().grad_norms). See docs/from-torch-ddp.md"
)


def refusal(name: str, func: Any, why: str = "") -> str:
    """Why ``func`` cannot use ``p.grad`` of parameter ``name``, and what works."""
    return (
        f"p.grad of parameter '{name}' cannot be used by {func} under distopt: "
        "it needs the whole reduced gradient, and each rank holds its own shard of it only "
        f"(distopt moves each gradient into its data-parallel buffers){why}. {WHAT_WORKS}"
    )


OUT_OF_PLACE = (
    ": an element-wise op out of place makes a new tensor of the whole gradient; write into "
    "p.grad in place or with out=p.grad, or read a reduction of it (p.grad.abs().sum() is "
    "p.grad.norm(1), p.grad.abs().max() is p.grad.norm(float('inf')))"
)
