"""Params tied across pipeline stages: their grads summed over the stages that hold them.

[Note: tied stage params]
A weight that two pipeline stages use (the token embedding of the first stage and the lm head of
the last, GPT's tie) is one ``nn.Parameter`` in the whole model but a param of each stage's
module. Megatron's rule keeps the copies equal: each stage computes its grad, the grads are
summed across the stages, and every copy steps that sum from the same values with the same
optimizer state, so the copies stay bit-identical (the update is element-wise, or whole-tensor
on the same matrix, and its clip coefficient is global). Under distopt the grads are reduced
over each stage's DP group first, and a rank then holds only its shard of them: two stages'
shards cover the same elements only where the param is laid out alike on both, so the DDP puts
each tied param (``tied_params={name: param}``) into a buffer of its own (``ParamSpec.alone``):
one bucket at offset 0, padded to a multiple of d * 64 elements, the same on every stage at the
same DP size. After ``finish_grad_sync`` the optimizer adds the reduced shards of a tie across
the stages that hold it, one all-reduce of 1/d of the param over their group (the pipeline
group when every stage holds it; else a group of the holding ranks, made once when the optimizer
is built), and a rank that holds it in several chunks (a V-shaped schedule) adds those first.

Each element is counted once in the global norm and the zero count, by the holder with the
lowest pipeline rank (the first of its chunks there); the others leave their copy out
(``TiedGrads.copies``). The same holder alone writes it into checkpoints, under the tie's name,
and every holder reads it from there, so a pipelined checkpoint holds the tie once, as the
unpipelined model does. When the optimizer is built the holders compare a digest of their values
and refuse to start from different ones: build every stage from one initialization (the same
seed), or load a checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..ddp.buffers.bucket import Bucket
from ..ddp.buffers.param_placeholder import is_between_uses
from ..ddp.wrapper import DistributedDataParallel
from ..parallel.dtensor import local_tensor


@dataclass(frozen=True, slots=True)
class _Tie:
    name: str
    buckets: tuple[Bucket, ...]  # the bucket of each copy on this rank, in model order
    group: dist.ProcessGroup | None  # the ranks that hold it, None when only this one does


@dataclass(frozen=True, slots=True)
class TiedGrads:
    """The ties of one optimizer's models; see [Note: tied stage params]."""

    ties: tuple[_Tie, ...]
    copies: frozenset[nn.Parameter]
    """This rank's tied params that another holder counts and writes."""

    def sum_(self, stats: comm.CommStats | None) -> None:
        """Add every tie's reduced grads over its holders (after ``finish_grad_sync``)."""
        for tie in self.ties:
            total = tie.buckets[0].owned_grad
            for bucket in tie.buckets[1:]:
                total.add_(bucket.owned_grad)
            if tie.group is not None:
                if stats is not None:
                    stats.record("tied_all_reduce", total)
                with comm.failures_named("all_reduce", f"the grads of tied param '{tie.name}'"):
                    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tie.group)
            for bucket in tie.buckets[1:]:
                bucket.owned_grad.copy_(total)


def tied_grads(models: Sequence[DistributedDataParallel],
               pp_group: dist.ProcessGroup | None) -> TiedGrads | None:
    """Wire the ties of ``models`` (one optimizer's) across the pipeline; collective over
    ``pp_group`` (and the default group when a tie needs a group of its own). None without
    ties anywhere."""
    local: dict[str, list[tuple[int, nn.Parameter]]] = {}
    for index, model in enumerate(models):
        for param, name in model.tied_params.items():
            local.setdefault(name, []).append((index, param))
    mine = {name: [_describe(p) for _, p in held] for name, held in sorted(local.items())}
    every = comm.all_gather_object(mine, pp_group)  # one entry per pipeline rank
    names = sorted({name for described in every for name in described})
    if not names:
        return None
    holders = {name: [r for r, described in enumerate(every) if name in described]
               for name in names}
    _check(names, every, holders)
    pp_size = comm.group_size(pp_group)
    groups = _tie_groups(holders, pp_group, pp_size)
    me = comm.group_rank(pp_group)
    ties, copies = [], set()
    for name, held in local.items():
        buckets = []
        for position, (index, param) in enumerate(held):
            buckets.append(_alone_bucket(models[index], param, name))
            if me != holders[name][0] or position > 0:
                copies.add(param)
        ties.append(_Tie(name, tuple(buckets), groups.get(name)))
    return TiedGrads(tuple(ties), frozenset(copies))


def _describe(param: nn.Parameter) -> tuple[tuple[int, ...], str, str]:
    """Shape, dtype and a digest of the values of one copy of a tie (none for a sharded
    param between uses: its values are spread over the ranks, and equal at the start since
    every stage built the model from one seed)."""
    if is_between_uses(param):
        raw = b"sharded"
    else:
        data = local_tensor(param).detach().contiguous().reshape(-1)
        raw = data.view(torch.uint8).cpu().numpy().tobytes() if data.numel() else b""
    return tuple(local_tensor(param).shape), str(param.dtype), hashlib.sha256(raw).hexdigest()


def _check(names: list[str], every: list[dict[str, Any]],
           holders: dict[str, list[int]]) -> None:
    # The same gathered descriptions on every rank of the pipeline: the same verdict.
    for name in names:
        copies = [(r, d) for r in holders[name] for d in every[r][name]]
        if len(copies) < 2:
            raise ValueError(
                f"tied param '{name}' is held by one pipeline stage only (pipeline rank "
                f"{copies[0][0]}): name it in tied_params= of every stage that holds the weight "
                "(the first stage's embedding and the last stage's head), or drop it"
            )
        (r0, (shape0, dtype0, digest0)), *rest = copies
        for r, (shape, dtype, digest) in rest:
            if (shape, dtype) != (shape0, dtype0):
                raise ValueError(
                    f"tied param '{name}' is of shape {shape} and {dtype} on pipeline rank {r} "
                    f"but {shape0} and {dtype0} on pipeline rank {r0}: tie the same weight on "
                    "every stage"
                )
            if digest != digest0:
                raise ValueError(
                    f"tied param '{name}' holds other values on pipeline rank {r} than on "
                    f"pipeline rank {r0}: build every stage from one initialization (the same "
                    "seed), or load a checkpoint, before building the optimizer"
                )


def _tie_groups(holders: dict[str, list[int]], pp_group: dist.ProcessGroup | None,
                pp_size: int) -> dict[str, dist.ProcessGroup]:
    """The group each tie's grads are summed over (ties held on one rank have none). Made
    by every rank of the default group in one order when some tie needs a group of its own."""
    groups: dict[str, dist.ProcessGroup] = {}
    partial = {}
    for name, ranks in holders.items():
        if len(ranks) == pp_size and pp_size > 1:
            assert pp_group is not None
            groups[name] = pp_group
        elif len(ranks) > 1:
            partial[name] = tuple(dist.get_global_rank(pp_group, r) for r in ranks)
    # Every pipeline group holds the same stages, so all of them need new groups or none does.
    if partial:
        wanted = comm.all_gather_object(sorted(set(partial.values())), dist.group.WORLD)
        for ranks in sorted({r for listed in wanted for r in listed}):
            group = dist.new_group(list(ranks))
            for name, mine in partial.items():
                if mine == ranks:
                    groups[name] = group
    return groups


def _alone_bucket(model: DistributedDataParallel, param: nn.Parameter, name: str) -> Bucket:
    buckets = model.buffer_of[param].buckets
    if len(buckets) != 1 or buckets[0].params != [param]:
        raise RuntimeError(f"tied param '{name}' does not have a buffer of its own")
    return buckets[0]
