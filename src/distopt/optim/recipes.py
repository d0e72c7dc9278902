"""Which optimizer trains which parameter in ``distopt train``: Muon's standard recipe.

[Note: the Muon recipe]
Muon orthogonalises each update with Newton-Schulz iterations, which is meant for the hidden
matrices of a network: the attention and MLP weights, which map one hidden space to another.
Embeddings (and a head tied to one) are lookup tables whose rows move one token at a time, and
norms and biases are vectors, so they train with AdamW. ``hidden_matrices`` splits a module
that way: the 2-D params outside ``nn.Embedding`` modules go to Muon, everything else to AdamW.
The demo GPT's head is its token embedding (one Parameter), so it stays with AdamW.

Muon's step size: torch's Muon scales its orthogonal update by ``adjust_lr_fn``. "original"
(Keller Jordan's) multiplies lr by ``sqrt(max(1, rows / cols))`` and wants an lr of about 0.02,
ten times AdamW's, so a run would need two learning rates. "match_rms_adamw" (Moonshot's)
scales the update to the RMS of a typical AdamW update (0.2 * sqrt(max(rows, cols))), so that
Muon reuses AdamW's learning rate and weight decay. That is the one chosen here: ``--lr``, the
warm-up and the cosine schedule mean the same for both groups, and a run with ``--optimizer
muon`` differs from one with ``--optimizer adamw`` only in how the hidden matrices are stepped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# AdamW's options in the recipe (and in ``distopt train --optimizer adamw``): betas and weight
# decay of GPT-style pretraining.
ADAMW_OPTIONS: dict[str, Any] = {"betas": (0.9, 0.95), "weight_decay": 0.1}


def hidden_matrices(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable params of ``module`` split as the Muon recipe splits them: (2-D params
    outside ``nn.Embedding`` modules, every other one), each in registration order, a shared
    param once. See [Note: the Muon recipe]."""
    embedded = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    matrices, rest = [], []
    for p in module.parameters():  # shared params once, as distopt's buffers hold them
        if not p.requires_grad:
            continue
        (matrices if p.dim() == 2 and id(p) not in embedded else rest).append(p)
    return matrices, rest


def muon_param_groups(
    module: nn.Module, lr: float, adamw_options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Param groups of the Muon recipe, for ``DistributedOptimizer(ddp, torch.optim.Muon,
    params=groups, **muon_options)``: the hidden matrices with Muon, the rest with AdamW. See
    [Note: the Muon recipe].

    Args:
        module: the model (the module the DDP wraps), split by ``hidden_matrices``; it must
            have at least one hidden matrix for Muon.
        lr: the learning rate of both groups, the same number for Muon and AdamW when Muon
            runs with ``adjust_lr_fn="match_rms_adamw"``.
        adamw_options: the AdamW group's other options (betas, weight decay, eps, ...);
            None: ``ADAMW_OPTIONS``, GPT-style pretraining's betas (0.9, 0.95) and weight
            decay 0.1. No AdamW group is made when every param is a hidden matrix.
    """
    matrices, rest = hidden_matrices(module)
    if not matrices:
        raise ValueError("the model has no 2-D hidden matrices for Muon to train")
    groups: list[dict[str, Any]] = [{"params": matrices, "lr": lr}]
    if rest:
        if adamw_options is None:
            adamw_options = ADAMW_OPTIONS
        groups.append({"params": rest, "optimizer": torch.optim.AdamW, "lr": lr,
                       **adamw_options})
    return groups


__all__ = ["ADAMW_OPTIONS", "hidden_matrices", "muon_param_groups"]
