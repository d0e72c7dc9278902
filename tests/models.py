"""Small models with the awkward features that break distributed optimizers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)

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


# A tiny causal transformer and a Markov-chain language to train it on. The language uses only
# the first TT_USED of TT_VOCAB tokens, so the embedding rows of the others get grads that are
# exactly zero; its entropy (about 0.9 nats per token) is the loss a perfect model reaches.
TT_VOCAB, TT_USED, TT_SEQ = 32, 24, 8


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias: a key bias shifts every score of a row alike, so its true grad is zero
        # and Adam would amplify the roundoff it is made of.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, s, d / heads]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Pre-norm causal transformer with learned positions and an untied output head."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(TT_VOCAB, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(TT_SEQ, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, TT_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).float().flatten(0, 1), targets.flatten())


def markov_batch(step: int, global_batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets [global_batch, TT_SEQ] from a fixed Markov chain in which
    every token has three successors, with probabilities 0.6, 0.3 and 0.1."""
    probs = torch.zeros(TT_USED, TT_USED)
    for t in range(TT_USED):
        for mult, add, p in ((5, 1, 0.6), (7, 3, 0.3), (11, 2, 0.1)):
            probs[t, (t * mult + add) % TT_USED] += p
    g = torch.Generator().manual_seed(5000 + step)
    seq = [torch.randint(0, TT_USED, (global_batch,), generator=g)]
    for _ in range(TT_SEQ):
        seq.append(torch.multinomial(probs[seq[-1]], 1, generator=g).squeeze(1))
    tokens = torch.stack(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


# A pre-norm transformer block small enough for tensor parallelism over 2 ranks on the CPU, its
# plan for torch's parallelize_module, and its batches.
TP_DIM, TP_HEADS, TP_HEAD_DIM, TP_FFN, TP_SEQ, TP_BATCH = 8, 4, 2, 16, 4, 8


class Block(nn.Module):
    """Pre-norm attention + MLP block. TP-agnostic: heads and sequence length are read from
    the local tensors (fewer heads under TP, a sequence chunk under sequence parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(TP_DIM)
        self.q = nn.Linear(TP_DIM, TP_HEADS * TP_HEAD_DIM)
        # No key bias: softmax ignores it, so its true grad is 0 and Adam would amplify the
        # rounding noise there into differences that say nothing about distopt.
        self.k = nn.Linear(TP_DIM, TP_HEADS * TP_HEAD_DIM, bias=False)
        self.v = nn.Linear(TP_DIM, TP_HEADS * TP_HEAD_DIM)
        self.o = nn.Linear(TP_HEADS * TP_HEAD_DIM, TP_DIM)
        self.ln2 = nn.LayerNorm(TP_DIM)
        self.fc1 = nn.Linear(TP_DIM, TP_FFN)
        self.fc2 = nn.Linear(TP_FFN, TP_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (lin(h).unflatten(-1, (-1, TP_HEAD_DIM)).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).flatten(-2))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def tp_plan(sequence_parallel: bool = False) -> dict:
    col, row = ColwiseParallel, RowwiseParallel
    if not sequence_parallel:
        return {"q": col(), "k": col(), "v": col(), "o": row(), "fc1": col(), "fc2": row()}
    # Activations outside attention and MLP stay split along the sequence; the LayerNorms hold
    # Replicate DTensor params whose grads come back Partial (summed over the TP ranks).
    seq = Shard(1)
    return {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "q": col(input_layouts=seq), "k": col(input_layouts=seq), "v": col(input_layouts=seq),
            "o": row(output_layouts=seq), "fc1": col(input_layouts=seq),
            "fc2": row(output_layouts=seq)}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (TP_BATCH, TP_SEQ, TP_DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
