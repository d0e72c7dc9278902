"""Params that got no grad in a step: torch DDP's refusal, or, with ``find_unused_parameters``,
which params no rank used.

[Note: params without a grad]
A param that got no grad in any backward of a step is torch DDP's error unless
``find_unused_parameters`` is set: torch refuses it at the next forward (so is a param frozen
after wrapping for the whole step: [Note: params frozen after wrapping] in
ddp/torch_compat/trainable.py). Stepping it on a zero grad instead would move it where
``torch.optim`` leaves it (weight decay, momentum), so ``finish`` refuses it too, naming it. The
refusal comes after the step's reductions, which every rank runs alike whatever it used: where the
params without a grad differ by rank (an expert no token of this rank's batch chose), the ranks that
used everything are not left waiting in a collective, and the step stops before any param moves.
With ``find_unused_parameters`` the ranks agree which params no rank used (one small all-reduce) and
leave those out of the step; a param used on some ranks only is stepped on the average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from ...parallel.experts import ExpertParams, used_anywhere
from ...parallel.process_groups import ParallelGroups


def unused_refusal(names: list[str], model_name: str) -> RuntimeError:
    """The error for params of ``model_name`` that got no grad on this rank."""
    shown = ", ".join(f"'{n}'" for n in names[:5]) + (
        f" and {len(names) - 5} more" if len(names) > 5 else "")
    return RuntimeError(
        f"{len(names)} parameter(s) of {model_name} got no gradient in this step on "
        f"this rank ({shown}), and find_unused_parameters is False: torch DDP refuses "
        f"this too. Pass find_unused_parameters=True, which reduces the others and leaves "
        f"a parameter no rank used (or one frozen for the whole step) out of the step, as "
        f"torch.optim skips a grad of None; "
        f"or freeze it (requires_grad=False) before wrapping; or use it in the forward"
    )


def used_on_some_rank(used: bytearray, params: list[nn.Parameter],
                      experts: ExpertParams | None, parallel: ParallelGroups,
                      stats: comm.CommStats | None) -> list[int]:
    """Per param, whether any rank that holds it computed a grad for it this step (``used``:
    this rank's flags): one small all-reduce."""
    device = params[0].device
    if experts is not None:  # see [Note: expert parallelism]
        return used_anywhere(used, [p in experts.params for p in params], experts.parallel,
                             parallel.dp_group, device, stats)
    flags = torch.tensor(list(used), dtype=torch.int32, device=device)
    # Over every data-parallel rank: replicas train on other data than their peers.
    comm.all_reduce_small(flags, dist.ReduceOp.MAX, parallel.data_parallel_groups, stats)
    return flags.tolist()
