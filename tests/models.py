"""Small models with the awkward features that break distributed optimizers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 11, 5


class AwkwardLM(nn.Module):
    """Odd shapes, biases, an embedding tied to the output head, a frozen layer, a LayerNorm,
    and a layer that is used only on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.l1 = nn.Linear(6, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.l2 = nn.Linear(7, 6)
        self.sometimes = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, tokens: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = self.emb(tokens)
        h = torch.tanh(self.l1(h))
        h = self.frozen(h)
        h = self.l2(h)
        if use_sometimes:
            h = h + self.sometimes(h)
        h = self.norm(h)
        return F.linear(h, self.emb.weight)  # tied head

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        logits = self(tokens, use_sometimes=step % 2 == 0)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))

    def param_groups(self, wd_lr: float, other_lr: float) -> list[dict]:
        decay = [self.emb.weight, self.l1.weight, self.l2.weight]
        other = [self.l1.bias, self.l2.bias, self.sometimes.weight, self.norm.weight,
                 self.norm.bias]
        return [
            {"params": decay, "lr": wd_lr, "weight_decay": 0.1},
            {"params": other, "lr": other_lr, "weight_decay": 0.0},
        ]


def batches(step: int, global_batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank, whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    return tokens, targets


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def mlp(sizes: list[int], dtype: torch.dtype = torch.float32) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1]).to(dtype)
