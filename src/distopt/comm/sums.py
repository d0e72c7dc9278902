"""The fp32-summed reduce-scatter and all-reduce on backends with collectives of their own
(NCCL): the chunks gathered in the grads' dtype, summed in fp32 in rank order, rounded once. See
[Note: fp32-accumulated reduce-scatter] in comm/collectives.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .handles import _Composite

# torch >= 2.10 renamed the single-tensor all-gather; keep working on the older name.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else (
    "all_gather_into_tensor"
)


def average_in_fp32(shard: torch.Tensor, chunks: list[torch.Tensor]) -> None:
    # See [Note: fp32-accumulated reduce-scatter]: sum in rank order, divide, round once.
    total = chunks[0].to(torch.float32, copy=True)
    for chunk in chunks[1:]:
        total.add_(chunk)
    shard.copy_(total.div_(len(chunks)))


def all_to_all_reduce_scatter_fp32(shard, full, group, *, async_op: bool):
    # Row r of ``received`` is rank r's copy of this rank's chunk. The bucket's numel is a
    # multiple of d (layout/elementwise.py).
    size = dist.get_world_size(group)
    received = torch.empty(full.numel(), dtype=full.dtype, device=full.device)
    work = dist.all_to_all_single(received, full, group=group, async_op=True)
    rows = list(received.view(size, -1))
    return _Composite([work], lambda: average_in_fp32(shard, rows)).finish(async_op)


def all_gather_all_reduce_fp32(full, group, *, async_op: bool):
    # Row r of ``received`` is rank r's copy.
    size = dist.get_world_size(group)
    received = torch.empty(size * full.numel(), dtype=full.dtype, device=full.device)
    work = getattr(dist, ALL_GATHER)(received, full, group=group, async_op=True)
    rows = list(received.view(size, -1))
    return _Composite([work], lambda: average_in_fp32(full, rows)).finish(async_op)
