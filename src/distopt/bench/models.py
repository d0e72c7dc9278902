"""The models the benchmark trains: the demo GPT (preset ``small``, 3.3M params; ``gpt-tiny``:
preset ``tiny``, 0.13M) and two MLPs: ``mlp``, 256-1024-1024-1024-256 (2.6M), and ``mlp8``, eight
layers of width 1024 (7.9M), whose larger matrices give the collectives more compute to hide
behind.

``build_model(name, seq_len)`` returns a ``BenchModel``: the module, a function computing the
loss from the module's output, and a function making one rank's batch of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..train.model import GPT, gpt_config

MODELS = ("gpt", "mlp", "gpt-tiny", "mlp8")
VOCAB = 256
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
    if name == "gpt-tiny":
        # The preset ``tiny`` (2 blocks, width 64): for Muon on a CPU, where torch's
        # Newton-Schulz runs its products in bf16, about 40x slower than fp32 there.
        return _gpt(seq_len, preset="tiny")
    if name == "mlp":
        return _mlp(seq_len)
    if name == "mlp8":
        return _mlp(seq_len, depth=8)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def _token_batch(seq_len: int):
    def batch(step: int, rank: int, batch_size: int, device: torch.device):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    return batch


def _gpt(seq_len: int, preset: str = "small") -> BenchModel:
    module = GPT(gpt_config(preset, seq_len))
    source = "distopt.train.model.GPT"
    return BenchModel(
        module=module, loss=lambda out: out[1], batch=_token_batch(seq_len), source=source
    )


def _mlp(rows_per_sample: int, depth: int = MLP_DEPTH) -> BenchModel:
    sizes = [MLP_IO] + [MLP_WIDTH] * depth + [MLP_IO]
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
