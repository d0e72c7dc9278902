"""Reduce-scatter, all-gather and the fp32-summed all-reduce on gloo, from point-to-point messages.

[Note: collectives on gloo]
Gloo has no reduce-scatter of its own: torch's gloo backend clones the input, all-reduces the
clone and copies one chunk out, so a reduce-scatter there costs a whole all-reduce plus two
copies; its all-gather goes through a temporary output and a copy, and composing either from
per-chunk ``reduce`` or ``broadcast`` calls costs one ring collective per rank. On gloo distopt
therefore builds both from point-to-point messages, which gloo sends straight between the
ranks' buffers: in the reduce-scatter each rank sends chunk j of the bucket to rank j and
receives the d - 1 others' copies of its own chunk into a temporary of (d - 1)/d of the bucket,
which it adds to its chunk and divides by d once they have all arrived; in the all-gather each
rank sends its chunk to every other rank and receives theirs in place. Each rank sends (d-1)/d
of the bucket in each, so the two together move exactly one all-reduce's worth of bytes, as on
NCCL. Only the owned chunk of a reduced bucket is meaningful afterwards. On a 2-core machine
each takes about half the time of gloo's own reduce-scatter or all-gather
(``distopt bench --collectives``; see benchmarks/README.md). Each blocking wait costs a
wake-up of gloo's thread and a round trip to the peer, so a caller with several buckets starts
all of their collectives before waiting for any (``finish_grad_sync``, ``start_param_sync``):
waited for one by one, the MLP benchmark's 8 buckets' gathers took 1.8-4.3x as long as started
together (benchmarks/bucket_collectives.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .handles import _Composite
from .sums import average_in_fp32

# gloo matches point-to-point messages by (peer, tag) in the order they were posted. Tags of
# distopt's own keep its reductions, its gathers and a user's own messages on the same group
# from ever matching each other.
REDUCE_TAG = 0x6470
GATHER_TAG = 0x6469


def _size_and_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def reduce_scatter_avg(shard, full, group, *, async_op: bool):
    # See [Note: collectives on gloo]. A bucket's numel is a multiple of d (layout/elementwise.py).
    size, rank = _size_and_rank(group)
    chunks = full.chunk(size)
    mine = chunks[rank]
    received = torch.empty((size - 1, mine.numel()), dtype=full.dtype, device=full.device)
    works = []
    peers = [peer for peer in range(size) if peer != rank]
    for row, peer in zip(received, peers, strict=True):
        works.append(dist.isend(chunks[peer], group_dst=peer, group=group, tag=REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=REDUCE_TAG))

    def average() -> None:
        if shard.data_ptr() != mine.data_ptr():
            shard.copy_(mine)
        for row in received:
            shard.add_(row)
        shard.div_(size)

    return _Composite(works, average).finish(async_op)


def reduce_scatter_avg_fp32(shard, full, group, *, async_op: bool):
    # The messages of reduce_scatter_avg; only the summation differs.
    size, rank = _size_and_rank(group)
    chunks = full.chunk(size)
    received = torch.empty((size - 1, chunks[rank].numel()), dtype=full.dtype,
                           device=full.device)
    works, rows = [], []
    for peer in range(size):
        if peer == rank:
            rows.append(chunks[rank])
            continue
        row = received[peer if peer < rank else peer - 1]
        works.append(dist.isend(chunks[peer], group_dst=peer, group=group, tag=REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=REDUCE_TAG))
        rows.append(row)
    return _Composite(works, lambda: average_in_fp32(shard, rows)).finish(async_op)


def all_gather(full, shard, group, *, async_op: bool):
    # See [Note: collectives on gloo].
    size, rank = _size_and_rank(group)
    chunks = full.chunk(size)
    mine = chunks[rank]
    if shard.data_ptr() != mine.data_ptr():
        mine.copy_(shard)
    works = []
    for peer in range(size):
        if peer != rank:
            works.append(dist.isend(mine, group_dst=peer, group=group, tag=GATHER_TAG))
            works.append(dist.irecv(chunks[peer], group_src=peer, group=group, tag=GATHER_TAG))
    return _Composite(works).finish(async_op)


def all_reduce_avg_fp32(full, group, *, async_op: bool):
    # See [Note: collectives on gloo]: this rank's copy to every peer, theirs into ``received``.
    size, rank = _size_and_rank(group)
    received = torch.empty((size - 1, full.numel()), dtype=full.dtype, device=full.device)
    works, rows = [], []
    for peer in range(size):
        if peer == rank:
            rows.append(full)
            continue
        row = received[peer if peer < rank else peer - 1]
        works.append(dist.isend(full, group_dst=peer, group=group, tag=REDUCE_TAG))
        works.append(dist.irecv(row, group_src=peer, group=group, tag=REDUCE_TAG))
        rows.append(row)
    # ``full`` is overwritten only after every send of it has completed.
    return _Composite(works, lambda: average_in_fp32(full, rows)).finish(async_op)
