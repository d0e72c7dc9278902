"""The trainable params of a module to be wrapped, checked before anything is built from them,
and the first ranks' weights every replica starts from."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as comm
from ..parallel.dtensor import local_tensor
from ..parallel.experts import ExpertParams
from ..parallel.process_groups import ParallelGroups


def trainable_named_params(
    module: nn.Module, wrappers: tuple[type[nn.Module], ...],
    ignored: frozenset[str] = frozenset(),
) -> list[tuple[str, nn.Parameter]]:
    """Validate the module and return its trainable params (shared ones once), less those of
    torch DDP's ignore list (``ignored`` names); a module that is one of ``wrappers`` already
    is refused."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, wrappers):
        raise TypeError(
            f"the module is already wrapped in {type(module).__module__}."
            f"{type(module).__name__}; pass the bare module to distopt.DistributedDataParallel"
        )
    # A zero-size param has nothing to reduce or step (torch's optimizers step it as nothing
    # too): it stays out of the buffers and keeps autograd's own empty p.grad.
    named = [(n, p) for n, p in module.named_parameters()
             if p.requires_grad and n not in ignored and p.numel() > 0]
    if not named:
        raise ValueError("the module has no trainable parameters (all are frozen or absent)")
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices ({', '.join(devices)}); distopt keeps one "
            "contiguous buffer per dtype, so move the whole module to one device first "
            "(module.to(device))"
        )
    for name, p in named:
        if type(local_tensor(p.data)) is not torch.Tensor or p.is_sparse:
            raise TypeError(
                f"parameter '{name}' is a {type(p.data).__name__}; distopt buffers hold dense "
                "local tensors only"
            )
        if not p.is_floating_point():
            raise TypeError(f"parameter '{name}' has non-floating dtype {p.dtype}")
    return named


def broadcast_initial_weights(module: nn.Module, parallel: ParallelGroups,
                              experts: ExpertParams | None, with_buffers: bool,
                              ignored: frozenset[str] = frozenset()) -> None:
    """Torch DDP's rule: every replica starts from the first rank's params (and buffers,
    unless ``broadcast_buffers=False``), but those of its ignore list; an expert's params from
    the first rank holding the same experts. Meta tensors have no values yet; see
    [Note: meta-device models]."""
    named = (*module.named_parameters(), *(module.named_buffers() if with_buffers else ()))
    synced = [t for n, t in named if n not in ignored]
    in_experts = set() if experts is None else {
        id(p) for m in experts.parallel.modules for p in m.parameters()}
    comm.broadcast_from_first_ranks(
        [local_tensor(t.data) for t in synced if not t.is_meta and id(t) not in in_experts],
        parallel.data_parallel_groups)
    if experts is not None:
        comm.broadcast_from_first_ranks(
            [t.data for t in module.parameters() if id(t) in in_experts and not t.is_meta],
            [experts.parallel.expert_dp_group])
