"""``check_for_nan_in_grad``: one verdict on every rank, naming the param and the rank.

After the reduction each rank knows which of its reduced grads hold a nan or inf, and (with the
option) which of its own grads did before the reduction mixed every rank's. One MIN over the
data-parallel, replica and TP ranks agrees on the first culprit, so every rank raises the same
error, or none does: no rank goes on into a collective that another has left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm

if TYPE_CHECKING:
    from ..buffers.bucket import Bucket

FIX = ("lower the learning rate, check the inputs, or use fp16 with a loss scaler (which skips "
       "such steps) instead of check_for_nan_in_grad")


def raise_on_nonfinite_grad(
    buckets: list[Bucket],
    params: list[nn.Parameter],
    names: dict[nn.Parameter, str],
    groups: list[dist.ProcessGroup | None],
    stats: comm.CommStats | None,
) -> None:
    """Raise ``FloatingPointError`` on every rank of ``groups`` if a grad of ``buckets`` held a
    nan or inf on any of them, naming the first param of ``params`` (registration order) and,
    when the bucket recorded this rank's own grads, the lowest rank that produced it."""
    # Two verdicts, agreed by one MIN: the first param whose reduced grad is not finite, and
    # the first (param, rank) whose own grad was not finite before the reduction, encoded as
    # index * world + rank.
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    index_of = {p: i for i, p in enumerate(params)}
    count = len(params)
    reduced = local = count
    for bucket in buckets:
        for param in bucket.nonfinite_params():
            reduced = min(reduced, index_of[param])
        for param in bucket.nonfinite_local_params():
            local = min(local, index_of[param])
    flags = torch.tensor([reduced, local * world + rank], dtype=torch.int64,
                         device=params[0].device)
    comm.all_reduce_small(flags, dist.ReduceOp.MIN, groups, stats)
    reduced, first_local = flags.tolist()
    if first_local < count * world:
        index, producer = divmod(first_local, world)
        raise FloatingPointError(
            f"nan or inf in the gradient of parameter '{names[params[index]]}' produced on "
            f"rank {producer} (the lowest rank whose own gradient held one before the "
            f"data-parallel reduction); {FIX}"
        )
    if reduced < count:
        raise FloatingPointError(
            f"nan or inf in the gradient of parameter '{names[params[reduced]]}' after the "
            "data-parallel reduction, though every rank's own gradient was finite (the sum "
            f"overflowed its dtype); {FIX}"
        )
