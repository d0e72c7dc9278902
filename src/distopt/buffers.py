"""Contiguous parameter and gradient buffers, and the buckets cut from them.

One ``ParamAndGradBuffer`` holds every trainable parameter of one dtype. After construction each
such parameter's ``.data`` (a DTensor's local shard) is a view into ``param_data`` and its
``main_grad`` (the one attribute distopt hangs on a parameter) is a view, of the same local shape,
into ``grad_data``. Both buffers share
one layout (see [Note: layout rule] in layout.py), so a bucket is the same range of both, and the
collectives of a bucket run on one contiguous tensor without any copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .dtensor import alias_local, local_tensor
from .layout import BucketLayout, BufferLayout, build_layout


@dataclass(eq=False, slots=True)
class Bucket:
    """A bucket's views of both buffers, and of this rank's shard of them."""

    layout: BucketLayout
    params: list[nn.Parameter]
    param_data: torch.Tensor  # [bucket numel], padding included
    grad_data: torch.Tensor  # [bucket numel]
    param_shard: torch.Tensor  # [bucket numel / d], this rank's chunk of param_data
    grad_shard: torch.Tensor  # [bucket numel / d], this rank's chunk of grad_data
    order: int = -1  # position in the DDP's global launch order, set by the DDP

    @property
    def index(self) -> int:
        return self.layout.index


class ParamAndGradBuffer:
    """Flat param and grad storage for parameters of one dtype, cut into buckets."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int,
        dp_size: int,
        dp_rank: int,
    ) -> None:
        if not params:
            raise ValueError("a buffer needs at least one parameter")
        self.params = params  # layout order
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.layout: BufferLayout = build_layout(
            [local_tensor(p).numel() for p in params], bucket_size=bucket_size, dp_size=dp_size
        )
        device = params[0].device
        # Padding must be zero: it is reduced and gathered with the rest and must stay finite.
        self.param_data = torch.zeros(self.layout.numel, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        self.index_of: dict[nn.Parameter, int] = {}

        with torch.no_grad():
            for index, (param, slot) in enumerate(zip(params, self.layout.params, strict=True)):
                rng = slot.buffer_range
                # A DTensor param keeps its local shard here; see [Note: DTensor params].
                local = local_tensor(param)
                view = self.param_data[rng.start : rng.end].view_as(local)
                view.copy_(local.detach())
                alias_local(param, view)
                param.main_grad = self.grad_data[rng.start : rng.end].view_as(local)
                self.index_of[param] = index

        self.buckets: list[Bucket] = []
        for bucket_layout in self.layout.buckets:
            rng = bucket_layout.buffer_range
            shard = bucket_layout.shard_range(dp_rank).shifted(rng.start)
            self.buckets.append(
                Bucket(
                    layout=bucket_layout,
                    params=[params[i] for i in bucket_layout.param_indices],
                    param_data=self.param_data[rng.start : rng.end],
                    grad_data=self.grad_data[rng.start : rng.end],
                    param_shard=self.param_data[shard.start : shard.end],
                    grad_shard=self.grad_data[shard.start : shard.end],
                )
            )

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self.buckets[self.layout.params[self.index_of[param]].bucket]
