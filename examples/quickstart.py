"""The smallest complete distopt training script. Launch with torchrun:

    torchrun --nproc_per_node 2 examples/quickstart.py

Each rank trains a small MLP regression on its slice of every global batch; the loss and the
bytes per parameter that each rank really holds are printed next to the theory.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import distopt


def main(steps: int = 200, global_batch: int = 64) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 1))
    ddp = distopt.DistributedDataParallel(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=3e-3, clip_grad=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    target = nn.Linear(32, 1)  # the function to learn, identical on every rank (same seed)
    per_rank = global_batch // world
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(global_batch, 32, generator=g)[rank * per_rank : (rank + 1) * per_rank]
        with torch.no_grad():
            y = torch.sin(target(x))
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        result = opt.step()
        sched.step()
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {result.grad_norm:.3f}")
    report = distopt.measure_state_bytes(opt)
    theory = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, world)
    replicated = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, world,
                                                     distributed=False)
    for r in range(world):
        if r == rank:
            print(f"rank {rank}: {report.total / 2**20:.2f} MiB of training state, "
                  f"{report.bytes_per_param:.2f} B/param (distopt theory {theory:.2f}, "
                  f"replicated {replicated:.2f})", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
