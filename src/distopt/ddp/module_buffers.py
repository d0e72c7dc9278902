"""Module buffers across the data-parallel group, as torch DDP keeps them: BatchNorm statistics
broadcast from the first ranks before a forward, and SyncBatchNorm reducing over the group.

[Note: buffer broadcasting]
A module's buffers (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) are
updated by each rank's forward from its own batch, so without communication they drift apart:
each rank would evaluate, and a checkpoint would keep, statistics of another history. torch DDP
with ``broadcast_buffers=True`` (its default) broadcasts rank 0's buffers at the start of a
forward whenever its ``require_forward_param_sync`` is set: at first, and after a forward that
ran with grad enabled outside ``no_sync()``. ``DistributedDataParallel(broadcast_buffers=True)``
follows the same rule (``BufferBroadcast``), so its buffers equal torch DDP's rank for rank:

* with accumulation the first micro-batch of a step broadcasts; the micro-batches after one run
  under ``no_sync()`` do not (torch sets the flag after each forward, not in ``no_sync``);
* an evaluation forward (``torch.no_grad()`` or inference mode) after training broadcasts, the
  next forward after it does not;
* the forward itself then updates each rank's statistics from its own batch, so right after a
  training forward the ranks differ by that one update, as under torch DDP; what every rank's
  forward reads at its start is rank 0's, and so is what a checkpoint stores (below).

The buffers go in one broadcast per dtype (fp32 statistics and int64 counters: two per
forward, whatever the number of layers), each a flat copy sent from the group's first rank and
copied back (``collectives.broadcast_coalesced``). On a hierarchical mesh the replicate group
sends first, then the shard group ([Note: hierarchical data parallelism]), so every rank ends
with global DP rank 0's values; they are counted as ``replicate_broadcast_buffers`` and
``broadcast_buffers`` in ``ddp.comm_stats``. With tensor parallelism only the DP groups
broadcast: each TP rank keeps its own buffers, which may legitimately differ (statistics of
channels sharded over the TP ranks). As torch does, the copy leaves the buffers' version
counters alone, so a graph that saved a buffer (BatchNorm in eval mode) still runs backward.
``broadcast_buffers=False`` is torch's too: no broadcast, not even at construction; each rank
keeps its own statistics.

Checkpoints store the buffers of the first DP ranks (``ParallelGroups.first_dp_rank``), the
values the next forward broadcasts, and a load gives them to every rank; so a run resumed at
the same DP size ends bitwise where the uninterrupted one ends, buffers included, when the save
follows a forward that syncs (grad enabled, outside ``no_sync()``: after a step). Before, DCP
wrote whichever rank's copy its planner picked.

``nn.SyncBatchNorm`` reduces its batch statistics over its ``process_group``, or over the default
group when that is None. The DDP gives the layers that have none its data-parallel group (the
whole mesh's DP ranks on a hierarchical mesh, which must then be the default group: no other
group spans them), and keeps a group the user chose. Every rank then computes the same
statistics, and the broadcast changes no value. torch's SyncBatchNorm runs on CUDA, XPU and HPU
devices only: on the CPU its training forward raises, under torch DDP alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..parallel.dtensor import local_tensor
from ..parallel.process_groups import ParallelGroups


class BufferBroadcast:
    """The first ranks' buffers of ``module``, broadcast before the forwards torch DDP
    broadcasts in; see [Note: buffer broadcasting]."""

    def __init__(self, module: nn.Module, parallel: ParallelGroups,
                 stats: comm.CommStats | None, *, enabled: bool,
                 ignored: frozenset[str] = frozenset()) -> None:
        self.module = module
        self.ignored = ignored  # torch DDP's ignore list: each rank keeps its own
        self.enabled = enabled
        self._groups = [("replicate_broadcast_buffers", parallel.replicate_group),
                        ("broadcast_buffers", parallel.dp_group)]
        self._stats = stats
        self._needed = enabled and any(comm.group_size(g) > 1 for _, g in self._groups)
        self._next_forward_syncs = True  # torch DDP's require_forward_param_sync

    def before_forward(self) -> None:
        if not (self._needed and self._next_forward_syncs):
            return
        # Read each time: a module may replace a buffer (torch DDP re-reads them too).
        buffers = [local_tensor(b) for n, b in self.module.named_buffers()
                   if n not in self.ignored]
        with contextlib.ExitStack() as stack:
            for buffer in buffers:
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(buffer))
            comm.broadcast_coalesced(buffers, self._groups, self._stats)

    def after_forward(self, *, grad_sync: bool) -> None:
        """Record whether the next forward broadcasts: after a forward with grad enabled and
        ``grad_sync`` (outside ``no_sync()``), as torch DDP's ``_post_forward`` does."""
        self._next_forward_syncs = torch.is_grad_enabled() and grad_sync


def adopt_sync_batchnorm_group(module: nn.Module, parallel: ParallelGroups) -> int:
    """Give every ``nn.SyncBatchNorm`` of ``module`` without a ``process_group`` the
    data-parallel group; return how many got it. Raises (before any collective, the same on
    every rank) when no one group spans the data-parallel ranks."""
    layers = [m for m in module.modules()
              if isinstance(m, nn.SyncBatchNorm) and m.process_group is None]
    if not layers or parallel.dp_group is None:
        return 0  # one process: the layer computes plain batch statistics
    group = sync_batchnorm_group(parallel)
    for layer in layers:
        layer.process_group = group
    return len(layers)


def sync_batchnorm_group(parallel: ParallelGroups) -> dist.ProcessGroup:
    """The one group over every data-parallel rank of ``parallel``'s model."""
    if parallel.replicate_group is None:
        return parallel.dp_group
    dp_ranks = parallel.dp_size * parallel.replicate_size
    if dp_ranks == dist.get_world_size():
        return dist.group.WORLD
    raise ValueError(
        f"the model has nn.SyncBatchNorm layers without a process_group, on a hierarchical mesh "
        f"whose {dp_ranks} data-parallel ranks ({parallel.replicate_size} replicas of "
        f"{parallel.dp_size}) are not the default group ({dist.get_world_size()} ranks), and "
        "no one group of distopt's spans them: pass a group of this rank's data-parallel ranks "
        "to nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=...)"
    )
