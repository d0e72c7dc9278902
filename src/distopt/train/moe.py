"""A mixture of experts for the demo GPT: a top-k router and experts spread over the ranks of an
expert-parallel (EP) group, tokens exchanged with ``all_to_all_single``.

Every expert is the block's dense MLP. Each token goes to the k experts its router scores
highest, weighted by their softmax probabilities (renormalized over the k when k > 1, as
Mixtral does; with k = 1 the top probability itself, as Switch does, so that the router learns).
There is no capacity limit and no auxiliary loss, so a token's output depends on that token
alone: a batch split over ranks or micro-batches computes what the whole batch computes in one
process, which is what the tests compare against.

With EP each rank holds ``n_experts / ep`` experts, this rank's ``ep_rank * n ..``. A forward
sorts its token copies by expert, tells every EP rank how many it sends to each of its experts
(an all-to-all of counts), sends them (``all_to_all_single`` with uneven splits), runs each local
expert on the rows it received, and sends the results back the same way; the backward of each
exchange is the exchange the other way. An expert that receives no rows is not run, so it gets
no grad on this rank (zero in the DDP's buffer, or left out of the step where no rank ran it
and ``find_unused_parameters`` is on), unless ``run_idle_experts`` is set: then it runs on no
rows and its grad is zero, as sharded params need (every rank runs the same modules). Every EP
rank joins both exchanges in every forward and backward, whatever it routes, so the
collectives match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    """Rows ``x`` sent to the ranks of ``group``, ``send[r]`` of them to rank r, and
    ``recv[r]`` received from each; its backward sends the grads back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (send, recv), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send, recv = ctx.splits
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``'s rows exchanged over ``group`` (differentiable); the identity without a group."""
    return x if group is None else _AllToAll.apply(x, send, recv, group)


class MoE(nn.Module):
    """Top-k routed experts in place of a block's MLP; see the module docstring.

    Built with all ``n_experts`` experts (so that the init consumes the RNG as the model with
    every expert local does); ``keep_local`` then keeps this EP rank's.
    """

    def __init__(self, n_embd: int, n_experts: int, top_k: int,
                 make_expert: Any) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(n_experts))
        self.run_idle_experts = False
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size, self.ep_rank = 1, 0

    def keep_local(self, ep_group: dist.ProcessGroup | None) -> None:
        """Keep only this EP rank's experts and exchange tokens over ``ep_group`` (None or a
        group of one rank: every expert local)."""
        size = 1 if ep_group is None else dist.get_world_size(ep_group)
        if self.n_experts % size:
            raise ValueError(f"{self.n_experts} experts do not split over {size} EP ranks; "
                             "pick an expert count divisible by the EP size")
        if size == 1:
            return
        rank, n = dist.get_rank(ep_group), self.n_experts // size
        self.experts = nn.ModuleList(list(self.experts)[rank * n : (rank + 1) * n])
        self.ep_group, self.ep_size, self.ep_rank = ep_group, size, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [N, C]
        probs = torch.softmax(self.router(tokens).float(), dim=-1)  # [N, E]
        gate, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.top_k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        # Each token's k copies, sorted by expert (so by the EP rank that holds it).
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token_of = order // self.top_k  # [N k]
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)  # [E]
        n = self.n_experts // self.ep_size
        recv_counts = counts.view(self.ep_size, n)  # [ep, n]: from each rank, per local expert
        if self.ep_group is not None:
            recv_counts = torch.empty_like(recv_counts)
            dist.all_to_all_single(recv_counts, counts.view(self.ep_size, n), group=self.ep_group)
        send = counts.view(self.ep_size, n).sum(1).tolist()
        recv = recv_counts.sum(1).tolist()
        rows = all_to_all(tokens[token_of], send, recv, self.ep_group)  # [R, C]

        # Rows arrive by source rank, then by local expert: group them by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(n, device=x.device).repeat(self.ep_size), recv_counts.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        grouped = rows[by_expert]
        # An idle expert is not run (no grad for it here) unless ``run_idle_experts``: then on
        # no rows, so that every rank runs the same modules (sharded params need it).
        outs = [expert(part) for expert, part in
                zip(self.experts, grouped.split(recv_counts.sum(0).tolist()), strict=True)
                if part.shape[0] or self.run_idle_experts]
        # With no rows at all, a product with the received rows keeps the backward exchange.
        out = (torch.cat(outs) if outs else grouped * 0)[torch.argsort(by_expert)]

        back = all_to_all(out, recv, send, self.ep_group)  # [N k, C], in `order`
        weights = gate.reshape(-1)[order].to(back.dtype).unsqueeze(1)
        combined = torch.zeros_like(tokens).index_add(0, token_of, back * weights)
        return combined.view(shape)
