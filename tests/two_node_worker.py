"""One rank of tests/test_two_nodes.py, as torchrun starts it: ``two_node_worker.py OUT``
(and ``params_in_one_group``, the same training as a case of the test harness's pool).

It trains the parity model on a ("dp_replicate", "dp_shard") = (2, 2) mesh and writes to
``OUT/rank{RANK}.pt`` its final params, what each step's collectives were (``ddp.comm_stats``),
the ranks of the group of every reduce-scatter, all-gather and replicate all-reduce distopt
issued, and the peer of every point-to-point message of distopt's own (gloo builds the
reduce-scatter and the all-gather from such messages; see [Note: collectives on gloo]).
``DISTOPT_TEST_LAUNCHER`` names the launcher that started the rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distopt
from distopt.comm import collectives as comm
from distopt.comm import gloo
from distopt.comm.gloo_io import idle_gloo_io_threads

from helpers import CLIP, lm_loss, parity_groups
from models import AwkwardLM, batches, rank_slice

STEPS = 5
SHAPE = (2, 2)  # (replicate, shard): one shard group per launcher of two ranks
DISTOPT_TAGS = (gloo.REDUCE_TAG, gloo.GATHER_TAG)


def build() -> tuple[torch.nn.Module, Any, Any]:
    """The model, DDP and optimizer of every run of the test (also the reference's model)."""
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(
        model, bucket_size=40, find_unused_parameters=True, device_mesh=mesh
    )
    opt = distopt.DistributedOptimizer(
        ddp,
        torch.optim.AdamW,
        params=parity_groups(model, "adamw"),
        clip_grad=CLIP,
        overlap_param_gather=True,
        lr=1e-2,
    )
    return model, ddp, opt


def _record_groups(log: list[tuple[str, list[int]]]) -> None:
    """Wrap the collectives the buckets issue (looked up at call time): the global ranks of
    each one's group."""
    for name in ("reduce_scatter_avg", "all_gather", "all_reduce_avg"):
        original = getattr(comm, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            group = args[2] if _name != "all_reduce_avg" else args[1]
            log.append((kwargs.get("op", _name), dist.get_process_group_ranks(group)))
            return _original(*args, **kwargs)

        setattr(comm, name, wrapped)


def _record_messages(log: list[tuple[str, int, int]]) -> None:
    """Wrap dist.isend and dist.irecv: (kind, tag, global peer) of every message."""
    for name, peer_key in (("isend", "group_dst"), ("irecv", "group_src")):
        original = getattr(dist, name)

        def wrapped(tensor, *args, _original=original, _name=name, _key=peer_key, **kwargs):
            peer = dist.get_global_rank(kwargs["group"], kwargs[_key])
            log.append((_name, kwargs.get("tag", 0), peer))
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, wrapped)


def _train(ddp: Any, opt: Any) -> list[dict[str, int]]:
    """STEPS steps on this rank's slice of the parity batches; each step's collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    for step in range(STEPS):
        tokens, targets = batches(step)
        ddp.comm_stats.reset()
        opt.zero_grad()
        loss = lm_loss(
            ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world), step
        )
        loss.backward()
        opt.step()
        calls.append(dict(ddp.comm_stats.calls))
    ddp.finish_param_sync()
    return calls


def params_in_one_group() -> dict[str, torch.Tensor]:
    """The same training in a group of four ranks on one machine (a case of the test harness's
    pool): the final params."""
    model, ddp, opt = build()
    _train(ddp, opt)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, ddp, opt = build()
    idle_gloo_io_threads()  # see [Note: gloo's I/O thread]
    groups: list[tuple[str, list[int]]] = []
    messages: list[tuple[str, int, int]] = []
    _record_groups(groups)
    _record_messages(messages)
    calls = _train(ddp, opt)
    result = {
        "rank": rank,
        "launcher": os.environ["DISTOPT_TEST_LAUNCHER"],
        "group_rank": os.environ["GROUP_RANK"],
        "shard_ranks": dist.get_process_group_ranks(ddp.parallel.dp_group),
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "calls": calls,
        "buckets": len(ddp.buckets),
        "groups": groups,
        "messages": [m for m in messages if m[1] in DISTOPT_TAGS],
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
