"""The models the benchmark trains: the demo GPT (or a transformer of its shape) and an MLP.

``build_model(name, seq_len)`` returns a ``BenchModel``: the module, a function computing the
loss from the module's output, and a function making one rank's batch of a step. The demo GPT
lives in ``distopt.train.model``; where that module is not installed, a local transformer of
the same shape stands in (pre-norm blocks, SDPA attention, embedding tied to the head, ~3.3M
params), so the benchmark runs either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("gpt", "mlp")
VOCAB = 256
# The "small" preset of the demo GPT: the size it is trained at on CPUs.
GPT_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 256}
MLP_WIDTH, MLP_DEPTH, MLP_IO = 1024, 3, 256


@dataclass(kw_only=True, slots=True)
class BenchModel:
    """A model with its loss and its data, as the benchmark needs them."""

    module: nn.Module
    """The model, on CPU in fp32, built from the current torch seed."""
    loss: Callable[[Any], torch.Tensor]
    """The loss from the (possibly wrapped) module's output."""
    batch: Callable[[int, int, int, torch.device], tuple[torch.Tensor, ...]]
    """``batch(step, rank, batch_size, device)``: one rank's inputs of a step (forward args)."""
    source: str
    """Where the module's class comes from (for the report)."""


def build_model(name: str, seq_len: int) -> BenchModel:
    """The benchmark model ``name`` (one of ``MODELS``) for sequences of ``seq_len`` tokens."""
    if name == "gpt":
        return _gpt(seq_len)
    if name == "mlp":
        return _mlp(seq_len)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def _token_batch(seq_len: int):
    def batch(step: int, rank: int, batch_size: int, device: torch.device):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return batch


def _gpt(seq_len: int) -> BenchModel:
    try:
        from distopt.train.model import GPT, gpt_config
    except ImportError:
        module: nn.Module = LocalGPT(seq_len=seq_len, **GPT_SHAPE)
        source = "distopt.bench.models.LocalGPT"
    else:
        module = GPT(gpt_config("small", seq_len))
        source = "distopt.train.model.GPT"
    return BenchModel(
        module=module, loss=lambda out: out[1], batch=_token_batch(seq_len), source=source
    )


def _mlp(rows_per_sample: int) -> BenchModel:
    sizes = [MLP_IO] + [MLP_WIDTH] * MLP_DEPTH + [MLP_IO]
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.GELU()]
    module = nn.Sequential(*layers[:-1])

    def batch(step: int, rank: int, batch_size: int, device: torch.device):
        # One "token" per row, so tokens/s compares with the GPT at the same batch and length.
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(batch_size * rows_per_sample, MLP_IO, generator=g)
        return (x.to(device),)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    return BenchModel(module=module, loss=loss, batch=batch, source="torch.nn.Sequential MLP")


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # [b, t, 3c] -> three [b, heads, t, c / heads]
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class LocalGPT(nn.Module):
    """A pre-norm GPT with the demo model's shape and interface: ``forward(idx, targets)``
    returns ``(logits, loss)``; the lm head is the token embedding."""

    def __init__(self, *, seq_len: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # GPT-2 init: each residual branch's output projection is scaled down with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                deep = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if deep else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
