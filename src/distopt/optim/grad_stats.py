"""Global gradient statistics over sharded grads: norm, clipping, zeros, inf/nan.

Every function takes the grads this rank owns (disjoint across ranks, so each element is
counted exactly once) and the groups over which the partial results must be summed. Each
statistic is also available in two halves, a local part over some of the grads and the
reduction over the groups, for a step that sees its grads one bucket at a time (see
[Note: param remainders] in optimizer.py); both ways give the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import CommStats, all_reduce_small

Groups = list[dist.ProcessGroup | None]


def _scalar(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each grad (``global_norm`` combines them)."""
    return list(torch._foreach_norm(grads, 2.0)) if grads else []


def global_norm(
    norms: list[torch.Tensor],
    groups: Groups,
    device: torch.device,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """L2 norm over all ranks from this rank's per-grad norms, in a fixed order."""
    total_sq = _scalar(device)
    if norms:
        total_sq += torch.stack(norms).float().square().sum()
    all_reduce_small(total_sq, dist.ReduceOp.SUM, groups, stats)
    return total_sq.sqrt_()


def global_grad_norm(
    grads: list[torch.Tensor], groups: Groups, device: torch.device, stats: CommStats | None = None
) -> torch.Tensor:
    """L2 norm of all grads on all ranks, as a 1-element fp32 tensor."""
    return global_norm(grad_norms(grads), groups, device, stats)


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``max_norm / (total_norm + 1e-6)`` capped at 1 (torch's rule), a 0-dim tensor."""
    return (max_norm / (total_norm + 1e-6)).clamp_(max=1.0).reshape(())


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale grads by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (torch's rule)."""
    if grads:
        torch._foreach_mul_(grads, clip_coefficient(max_norm, total_norm))


def zero_counter(device: torch.device) -> torch.Tensor:
    """The running count ``add_zeros`` adds to."""
    return torch.zeros(1, dtype=torch.float64, device=device)


def add_zeros(total: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Add the zero elements of ``grads`` to ``total`` (from ``zero_counter``)."""
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)


def total_zeros(total: torch.Tensor, groups: Groups, stats: CommStats | None = None) -> int:
    """The zero count over all ranks from this rank's ``total``."""
    all_reduce_small(total, dist.ReduceOp.SUM, groups, stats)
    return int(total.item())


def count_zeros(
    grads: list[torch.Tensor], groups: Groups, device: torch.device, stats: CommStats | None = None
) -> int:
    total = zero_counter(device)
    add_zeros(total, grads)
    return total_zeros(total, groups, stats)


def inverse_scale(inv_scale: float, device: torch.device) -> torch.Tensor:
    """``inv_scale`` as the 1-element fp32 tensor ``unscale_`` multiplies by."""
    return torch.full((1,), inv_scale, dtype=torch.float32, device=device)


def unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply grads by ``inv_scale``; set ``found_inf`` (from ``inf_flag``) to 1 on an inf
    or nan."""
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def inf_flag(device: torch.device) -> torch.Tensor:
    """The flag ``unscale_`` raises."""
    return _scalar(device)


def any_rank_found_inf(
    found_inf: torch.Tensor, groups: Groups, stats: CommStats | None = None
) -> bool:
    """Whether any rank raised its ``found_inf`` flag."""
    all_reduce_small(found_inf, dist.ReduceOp.MAX, groups, stats)
    return bool(found_inf.item() > 0)


def unscale_and_check_(
    grads: list[torch.Tensor],
    inv_scale: float,
    groups: Groups,
    device: torch.device,
    stats: CommStats | None = None,
) -> bool:
    """Multiply grads by ``inv_scale``; True when any rank saw an inf or nan."""
    found_inf = inf_flag(device)
    unscale_(grads, found_inf, inverse_scale(inv_scale, device))
    return any_rank_found_inf(found_inf, groups, stats)
