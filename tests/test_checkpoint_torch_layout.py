"""``save_checkpoint`` in torch's layout: what it writes is what ``get_state_dict`` gives under
``"model"`` and ``"optimizer"``, so that torch's own recipe (``get_state_dict``, ``dcp.load``,
``set_state_dict``) resumes it in torch DDP and FSDP2 at another data-parallel size, in a
process that never imports distopt; distopt's checkpoints of the earlier layout still load.

Every run trains the same MLP on the same global batches (12 rows a step, each rank its rows),
so every system at every d follows the trajectory of one process with torch's AdamW on the
whole batch: the reference ([Note] in test_torch_dcp_state_dict.py's docstring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import distopt

MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}
SAVED_AT, STEPS, ROWS, LR = 2, 4, 12, 1e-2


def model() -> nn.Module:
    """Shapes that no d in 2..4 divides, so that distopt's pieces cut rows of the weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                         nn.Linear(6, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def build_distopt(mode: str, **options):
    ddp = distopt.DistributedDataParallel(model(), **MODES[mode], **options)
    return ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR)


def train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = next(ddp.parameters()).dtype
    for step in steps:
        x, y = (t[rank::world].to(dtype) for t in batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
