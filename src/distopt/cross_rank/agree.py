"""The collective half of every cross-rank check: one 32-byte digest per rank and group, the
descriptions themselves only where digests differ, and one verdict spread over every group, so
that every rank raises the same ``ValueError`` or none does ([Note: one model on every rank] in
cross_rank/model.py, [Note: one optimizer on every rank] in cross_rank/optimizer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ..comm import collectives as comm
from ..parallel.process_groups import ParallelGroups

D = TypeVar("D")  # what the ranks of a group describe and compare


def compared_groups(parallel: ParallelGroups) -> list[tuple[str, dist.ProcessGroup, bool]]:
    """The groups of ranks that must agree, by name, with whether they compare everything
    (False: a tensor-parallel group, whose local shapes and layout legitimately differ);
    those of one rank left out."""
    tp_groups = list(parallel.tp.groups) if parallel.tp is not None else []
    return [(name, group, full) for name, group, full in (
        ("data-parallel", parallel.dp_group, True),
        ("data-parallel replicate", parallel.replicate_group, True),
        *(("tensor-parallel", group, False) for group in tp_groups),
    ) if comm.group_size(group) > 1]


def raise_unless_same(
    described: list[tuple[str, dist.ProcessGroup, D]],
    digest_of: Callable[[D], bytes],
    difference: Callable[[list[D], list[int], str], str | None],
    device: torch.device,
    stats: comm.CommStats | None,
) -> None:
    """Raise the same ``ValueError`` on every rank of the groups of ``described`` (name,
    group, this rank's description for it) unless each group's ranks hold equal
    descriptions: one 32-byte digest per rank and group, the descriptions themselves only
    where digests differ, then the verdict spread over every group; the message is what
    ``difference`` (descriptions, ranks, group name) says."""
    device = _collective_device([group for _, group, _ in described], device)
    message = None
    for name, group, mine in described:
        if _digests_differ(digest_of(mine), group, device, stats):
            # Only now the details: every rank of the group sees the same digests, so all of
            # them take this branch together.
            found = difference(comm.all_gather_object(mine, group),
                               dist.get_process_group_ranks(group), name)
            message = message or found
    if len(described) > 1:
        message = _spread(message, [group for _, group, _ in described], device, stats)
    if message is not None:
        raise ValueError(message)


def _digests_differ(digest: bytes, group: dist.ProcessGroup, device: torch.device,
                    stats: comm.CommStats | None) -> bool:
    mine = torch.frombuffer(bytearray(digest), dtype=torch.int64).to(device)  # [4]
    every = [torch.empty_like(mine) for _ in range(comm.group_size(group))]
    if stats is not None:
        stats.record("model_check", mine, group)
    dist.all_gather(every, mine, group=group)
    return any(not torch.equal(d, mine) for d in every)


def _spread(message: str | None, groups: list[dist.ProcessGroup], device: torch.device,
            stats: comm.CommStats | None) -> str | None:
    # The groups are the dimensions of one mesh: reducing over each in turn reaches every rank.
    flag = torch.tensor([message is not None], dtype=torch.int32, device=device)
    comm.all_reduce_small(flag, dist.ReduceOp.MAX, groups, stats)
    if not flag.item():
        return None
    for group in groups:
        gathered = comm.all_gather_object(message, group)  # by every rank, found or not
        message = message or next((m for m in gathered if m is not None), None)
    return message


def agree_on_refusal(message: str | None, parallel: ParallelGroups, device: torch.device,
                     stats: comm.CommStats | None) -> str | None:
    """One rank's refusal (``message``, None where this rank has none) made every rank's of
    the data-parallel and tensor-parallel groups: the first found, or None on every rank."""
    groups = [group for _, group, _ in compared_groups(parallel)]
    if not groups:
        return message
    return _spread(message, groups, _collective_device(groups, device), stats)


def _collective_device(groups: list[dist.ProcessGroup], device: torch.device) -> torch.device:
    # gloo communicates CPU tensors; NCCL those on the params' device.
    gloo_only = all(dist.get_backend(group) == "gloo" for group in groups)
    return torch.device("cpu") if gloo_only else device
