"""Resume distopt checkpoints with torch alone: torch DDP or FSDP2, torch's own recipe
(``get_state_dict``, ``dcp.load``, ``set_state_dict``), in processes that never import distopt.

    python tests/torch_resume.py OUT WORLD CKPT:SYSTEM ...

starts WORLD gloo processes; each loads every CKPT (a checkpoint directory) under SYSTEM
(``torch`` or ``fsdp``), trains to ``STEPS`` and rank 0 writes, with ``torch.save`` into OUT,
``{"ends": {"CKPT:SYSTEM": [each rank's params and AdamW state, whole]}, "distopt_imported":
...}``. The model, the batches and the learning rate are test_checkpoint_torch_layout.py's,
defined here so that this file imports torch only.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

SAVED_AT, STEPS, ROWS, LR = 2, 4, 12, 1e-2


def model() -> nn.Module:
    """Shapes that no d in 2..4 divides, so that distopt's pieces cut rows of the weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                         nn.Linear(6, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = (t[rank::world] for t in batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def one_process_run(net: nn.Module, loss_fn: Any, batch: Any, steps: int, lr: float
                    ) -> dict[str, torch.Tensor]:
    """``net`` trained in this one process with torch's AdamW on each whole ``batch(step)``
    for ``steps`` steps; its ends."""
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return ends(net, opt)


def reference() -> dict[str, torch.Tensor]:
    """One process, torch's AdamW on the whole batch, ``STEPS`` steps."""
    return one_process_run(model(), nn.functional.mse_loss, batch, STEPS, LR)


def build(system: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = model()
    if system == "torch":
        ddp = nn.parallel.DistributedDataParallel(net)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


def resume(ckpt: str, system: str) -> dict[str, torch.Tensor]:
    """torch's recipe: load ``ckpt`` under ``system``, train to ``STEPS``; where it ends."""
    net, opt = build(system)
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    train(net, opt, range(SAVED_AT, STEPS))
    return ends(net, opt)


def ends(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Params and AdamW state, whole, by the model's FQNs, under torch DDP, FSDP2 or none."""
    out = {f"param/{n.removeprefix('module.')}":
           (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
           for n, p in net.named_parameters()}
    full = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    for fqn, state in full["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{fqn}"] = state[key].detach().clone()
    return out


def _worker(rank: int, world: int, store: str, out: str, jobs: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    ends = {}
    for job in jobs:
        ckpt, _, system = job.rpartition(":")
        ends[job] = resume(ckpt, system)
    imported = any(m.split(".")[0] == "distopt" for m in sys.modules)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (ends, imported))
    if rank == 0:
        torch.save({"ends": {job: [e[job] for e, _ in everyone] for job in jobs},
                    "distopt_imported": any(i for _, i in everyone)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    out, world, jobs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, f"{tmp}/store", out, jobs), nprocs=world)
