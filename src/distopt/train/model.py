"""A small byte-level GPT in plain PyTorch: the demo model of `distopt train`.

Pre-norm GPT-2 blocks with learned positions and an lm head tied to the token embedding.
The tie matters to distopt: `lm_head.weight is wte.weight` is ONE Parameter, so
`module.parameters()` yields it once and it gets one slot in the grad buffer, whose grad
accumulates the contributions of both uses before it is reduced.

Init is a pure function of the torch RNG state at construction: build the model on CPU
after `torch.manual_seed(seed)` on every rank and every rank starts from the same weights,
then move it with `model.to(device, dtype)`.

With `n_experts` each block's MLP is a mixture of that many experts (train/moe.py); built with
an expert-parallel group (`GPT(config, ep_group=...)`) each rank keeps its share of them, with
the values the model with every expert local has, whatever the EP size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .moe import MoE

__all__ = ["GPT", "GPTConfig", "MODEL_PRESETS", "gpt_config"]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT; see `MODEL_PRESETS` for the named sizes."""

    seq_len: int
    """Longest context the model accepts (rows of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int
    """Width of the residual stream."""
    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches, in [0, 1)."""
    n_experts: int = 0
    """Experts of each block's mixture of experts (each the size of the dense MLP); 0: a
    dense MLP."""
    top_k: int = 2
    """Experts each token is routed to, with n_experts."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "n_layer", "n_head", "n_embd", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_embd as a multiple of n_head"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig.top_k must be in [1, n_experts={self.n_experts}], "
                             f"got {self.top_k!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Parameter counts at seq_len=256 (positions add seq_len * n_embd).
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 64},  # ~0.13M: unit tests, CPU smoke runs
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 256},  # ~3.3M: CPU training demos
    "medium": {"n_layer": 6, "n_head": 8, "n_embd": 512},  # ~19M: GPU runs
}


def gpt_config(name: str, seq_len: int, **overrides: Any) -> GPTConfig:
    """The `GPTConfig` of preset `name` with context `seq_len`; `overrides` replace fields."""
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {', '.join(sorted(MODEL_PRESETS))}"
        )
    return GPTConfig(**{**MODEL_PRESETS[name], "seq_len": seq_len, **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # [b, t, 3c] -> three [b, n_head, t, head_dim]
        q, k, v = self.c_attn(x).view(b, t, 3, self.n_head, c // self.n_head).unbind(dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp: nn.Module = (
            MoE(config.n_embd, config.n_experts, config.top_k, lambda: MLP(config))
            if config.n_experts else MLP(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over token ids in [0, vocab_size); with ``n_experts``, a
    mixture of experts whose experts are spread over ``ep_group`` (None: every one local)."""

    def __init__(self, config: GPTConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tie by sharing the Parameter object itself: one tensor, one grad, one optimizer slot.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: each residual branch's output projection is scaled so the residual stream's
        # variance does not grow with depth (two branches per block).
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=proj_std)
            for mlp in self.experts_of(block) or [block.mlp]:
                nn.init.normal_(mlp.c_proj.weight, mean=0.0, std=proj_std)
        if config.n_experts:  # every expert initialized: keep this EP rank's
            for block in self.blocks:
                block.mlp.keep_local(ep_group)

    @staticmethod
    def experts_of(block: nn.Module) -> nn.ModuleList | None:
        """A block's list of (this rank's) experts; None for a dense block."""
        return block.mlp.experts if isinstance(block.mlp, MoE) else None

    def expert_lists(self) -> list[nn.ModuleList]:
        """Every block's list of this rank's experts (what ``distopt.ExpertParallel`` takes)."""
        return [e for e in map(self.experts_of, self.blocks) if e is not None]

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameter elements, the tied embedding/head counted once."""
        return sum(p.numel() for p in self.parameters())  # parameters() drops duplicates

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits `[batch, time, vocab]` for int64 ids `idx` `[batch, time]`, and the mean
        cross-entropy against `targets` (same shape as `idx`) in fp32, or None."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [batch, time], got {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence of length {t} is longer than the model's seq_len "
                f"{self.config.seq_len}; crop the input or build the model with a larger seq_len"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        # fp32 softmax: bf16/fp16 logits lose too much precision in the log-sum-exp.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss
