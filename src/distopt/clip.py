"""Global gradient statistics over sharded grads: norm, clipping, zeros, inf/nan.

Every function takes the grads this rank owns (disjoint across ranks, so each element is
counted exactly once) and the groups over which the partial results must be summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import CommStats, all_reduce_small

Groups = list[dist.ProcessGroup | None]


def _scalar(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def global_grad_norm(
    grads: list[torch.Tensor], groups: Groups, device: torch.device, stats: CommStats | None = None
) -> torch.Tensor:
    """L2 norm of all grads on all ranks, as a 1-element fp32 tensor."""
    total_sq = _scalar(device)
    if grads:
        norms = torch._foreach_norm(grads, 2.0)
        total_sq += torch.stack(norms).float().square().sum()
    all_reduce_small(total_sq, dist.ReduceOp.SUM, groups, stats)
    return total_sq.sqrt_()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale grads by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (torch's rule)."""
    if grads:
        coef = (max_norm / (total_norm + 1e-6)).clamp_(max=1.0).reshape(())
        torch._foreach_mul_(grads, coef)


def count_zeros(
    grads: list[torch.Tensor], groups: Groups, device: torch.device, stats: CommStats | None = None
) -> int:
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)
    all_reduce_small(total, dist.ReduceOp.SUM, groups, stats)
    return int(total.item())


def unscale_and_check_(
    grads: list[torch.Tensor],
    inv_scale: float,
    groups: Groups,
    device: torch.device,
    stats: CommStats | None = None,
) -> bool:
    """Multiply grads by ``inv_scale``; True when any rank saw an inf or nan."""
    found_inf = _scalar(device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        )
    all_reduce_small(found_inf, dist.ReduceOp.MAX, groups, stats)
    return bool(found_inf.item() > 0)
