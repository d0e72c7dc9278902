"""Global gradient statistics over sharded grads: norm, clipping, zeros, inf/nan.

Each statistic comes in two halves: a local part over some of the grads this rank owns
(disjoint across ranks, so each element is counted exactly once), which the step calls once
per chunk, and the reduction over the groups, called once per step ([Note: step chunks] in
optim/step.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import CommStats, all_reduce_small

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


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``max_norm / (total_norm + 1e-6)`` capped at 1 (torch's rule), a 0-dim tensor."""
    return (max_norm / (total_norm + 1e-6)).clamp_(max=1.0).reshape(())


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


def norms_by_name(norms: list[torch.Tensor | None], names: list[str], all_names: list[str],
                  groups: Groups, device: torch.device, stats: CommStats | None = None
                  ) -> dict[str, float]:
    """Each of ``all_names``' L2 norm over ``groups``' ranks, from this rank's pieces' norms
    (``norms[i]`` of a piece of ``names[i]``; None: no grad): one all-reduce of a vector in
    the sorted order of ``all_names``, which every rank of the groups shares."""
    order = sorted(set(all_names))
    index = {name: i for i, name in enumerate(order)}
    squares = torch.zeros(len(order), dtype=torch.float32, device=device)
    for norm, name in zip(norms, names, strict=True):
        if norm is not None:
            squares[index[name]] += norm.float().square()
    all_reduce_small(squares, dist.ReduceOp.SUM, groups, stats)
    return dict(zip(order, squares.sqrt_().tolist(), strict=True))
