"""Contiguous parameter and gradient buffers, one per param dtype, cut into buckets.

One ``ParamAndGradBuffer`` holds every trainable parameter of one dtype. After construction each
such parameter's ``.data`` (a DTensor's local shard) is a view into ``param_data`` and its
``main_grad`` (the one attribute distopt hangs on a parameter) is a view, of the same local
shape, into ``grad_data``. Both buffers share one layout (see [Note: layout rule] in
layout/elementwise.py), so a bucket (ddp/buffers/bucket.py) is the same range of both, and the
collectives of a bucket run on one contiguous tensor without any copy. With sharded grads there
is no ``grad_data``: ``grad_shards`` keeps this rank's reduced shard of every bucket
([Note: sharded grads] in ddp/buffers/grad_pool.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from ...layout.elementwise import BufferLayout
from ...parallel.dtensor import alias_local, local_tensor
from ...parallel.managed_replicas import ManagedReplicas
from .bucket import Bucket
from .grad_pool import GradPool
from .grad_storage import FullGrads, ShardedGrads
from .param_storage import FullParams, ParamPool, ShardedParams, placeholders_for


class ParamAndGradBuffer:
    """Flat param and grad storage for parameters of one dtype, cut into buckets."""

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: BufferLayout,
        *,
        grad_dtype: torch.dtype,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        reduce_scatter: bool,
        stats: comm.CommStats | None = None,
        replicate_group: dist.ProcessGroup | ManagedReplicas | None = None,
        fp32_accumulation: bool = False,
        check_local_grads: bool = False,
        grad_pool: GradPool | None = None,
        param_pool: ParamPool | None = None,
        device: torch.device | None = None,
        expert: bool = False,
        grad_scale: float = 1.0,
    ) -> None:
        """``params`` in layout order, laid out by ``layout`` (from layout/model_layout.py). With a
        ``grad_pool`` the grads are sharded: no ``grad_data``, only ``grad_shards`` (this
        rank's reduced shard of every bucket) between steps; see [Note: sharded grads] in
        ddp/buffers/grad_pool.py. With a ``param_pool`` the params are sharded too: no
        ``param_data``, only ``param_shards``, and the params are placeholders between uses; see
        [Note: sharded params] in ddp/buffers/param_storage.py. ``expert``: it holds experts'
        params, reduced over the expert-data-parallel ``group`` with their grads first multiplied by
        ``grad_scale`` ([Note: expert parallelism] in parallel/experts.py)."""
        if not params:
            raise ValueError("a buffer needs at least one parameter")
        self.params = params  # layout order
        self.param_dtype = params[0].dtype
        self.expert = expert
        self.grad_dtype = grad_dtype
        self.dp_size = layout.dp_size
        self.dp_rank = dp_rank
        self.layout = layout
        # A meta-device model's buffers go where its shards will be ([Note: meta-device
        # models] in ddp/params/materialize.py).
        device = device or params[0].device
        sharded = grad_pool is not None
        self.grad_data = (
            None if sharded else torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        )
        shard_total = sum(b.shard_size for b in self.layout.buckets)
        # [sum of the buckets' shard sizes]: bucket by bucket, this rank's reduced grads. Left
        # unwritten (its pages untouched until then): a step's first reduction of each bucket
        # writes its shard whole ([Note: sharded grads] in ddp/buffers/grad_pool.py).
        self.grad_shards = (
            torch.empty(shard_total, dtype=grad_dtype, device=device) if sharded else None
        )
        # Padding must be zero: it is reduced and gathered with the rest and must stay finite.
        self.param_data = (
            None if param_pool is not None
            else torch.zeros(self.layout.numel, dtype=self.param_dtype, device=device)
        )
        # With sharded params: bucket by bucket, this rank's shard of the params.
        self.param_shards = (
            torch.zeros(shard_total, dtype=self.param_dtype, device=device)
            if param_pool is not None else None
        )
        if param_pool is None:
            with torch.no_grad():
                for param, slot in zip(params, self.layout.params, strict=True):
                    rng = slot.buffer_range
                    # A DTensor param keeps its local shard here; see [Note: DTensor params].
                    local = local_tensor(param)
                    view = self.param_data[rng.start : rng.end].view_as(local)
                    view.copy_(local.detach())
                    alias_local(param, view)
        else:
            self._shard_params()
        with torch.no_grad():
            for param, slot in zip(params, self.layout.params, strict=True):
                rng = slot.buffer_range
                # With sharded grads a view of the transient grads, only during a reduction.
                param.main_grad = (
                    None if sharded
                    else self.grad_data[rng.start : rng.end].view_as(local_tensor(param))
                )

        self.buckets: list[Bucket] = []
        kept_offset = 0
        for bucket_layout in self.layout.buckets:
            rng = bucket_layout.buffer_range
            indices = bucket_layout.param_indices
            bucket_params = [params[i] for i in indices]
            ranges = [self.layout.params[i].bucket_range for i in indices]
            shard = bucket_layout.shard_range(dp_rank)
            if param_pool is None:
                param_data = self.param_data[rng.start : rng.end]
                params_store = FullParams(param_data, param_data[shard.start : shard.end])
            else:
                kept_params = self.param_shards[kept_offset : kept_offset + shard.size]
                params_store = ShardedParams(kept_params, param_pool, rng.size, bucket_params,
                                             ranges, self._placeholder, shard.start)
                if not self._meta:  # a meta-device model's params get them once materialized
                    params_store.show_placeholders()
            args = (bucket_layout, bucket_params, ranges, params_store)
            options = dict(
                dp_rank=dp_rank, group=group, reduce_scatter=reduce_scatter, stats=stats,
                replicate_group=replicate_group, fp32_accumulation=fp32_accumulation,
                check_local_grads=check_local_grads, grad_scale=grad_scale,
            )
            # Where the bucket's grads live: the one place the sharding of grads matters.
            if grad_pool is None:
                grad_data = self.grad_data[rng.start : rng.end]
                storage = FullGrads(grad_data, grad_data[shard.start : shard.end])
            else:
                kept = self.grad_shards[kept_offset : kept_offset + shard.size]
                storage = ShardedGrads(kept, grad_pool, rng.size, bucket_params, ranges)
            kept_offset += shard.size
            self.buckets.append(Bucket(*args, storage, **options))

    def _shard_params(self) -> None:
        """This rank's shard of every bucket's params, from the params' values, one bucket at
        a time (no rank holds more than one bucket of the whole model for it)."""
        device = self.param_shards.device
        self._placeholder = placeholders_for({self.param_dtype}, device)[self.param_dtype]
        self._meta = any(p.is_meta for p in self.params)
        if self._meta:
            return  # written module by module by materialize_shards
        offset = 0
        with torch.no_grad():
            for bucket in self.layout.buckets:
                full = torch.zeros(bucket.buffer_range.size, dtype=self.param_dtype,
                                   device=device)
                for index in bucket.param_indices:
                    slot = self.layout.params[index].bucket_range
                    full[slot.start : slot.end].copy_(
                        local_tensor(self.params[index]).detach().reshape(-1))
                shard = bucket.shard_range(self.dp_rank)
                self.param_shards[offset : offset + shard.size].copy_(
                    full[shard.start : shard.end])
                offset += shard.size

    def write_shard(self, param: nn.Parameter, values: torch.Tensor | None = None) -> None:
        """Copy the slices of ``param``'s values (or of ``values``, the whole param's: a state
        dict loaded into a sharded model) that fall in this rank's shard of its bucket into
        ``param_shards`` (a meta-device model, materialized module by module)."""
        index = next(i for i, p in enumerate(self.params) if p is param)
        slot = self.layout.params[index]
        bucket = self.layout.buckets[slot.bucket]
        shard = bucket.shard_range(self.dp_rank)
        owned = slot.bucket_range.intersect(shard)
        if owned is None:
            return
        offset = sum(b.shard_size for b in self.layout.buckets[: slot.bucket])
        values = (local_tensor(param) if values is None else values).detach().reshape(-1)
        start = owned.start - slot.bucket_range.start
        self.param_shards[offset + owned.start - shard.start : offset + owned.end - shard.start
                          ].copy_(values[start : start + owned.size])

    def show_placeholders(self) -> None:
        """Every param as its placeholder (sharded params, once materialized)."""
        for bucket in self.buckets:
            bucket.params_store.show_placeholders()

    def param_storage(self) -> list[torch.Tensor]:
        """The param tensors this buffer holds between steps: ``param_data`` (every param), or
        with sharded params ``param_shards`` (this rank's shard of every bucket)."""
        return [self.param_data if self.param_shards is None else self.param_shards]

    def grad_storage(self) -> list[torch.Tensor]:
        """The grad tensors this buffer holds between steps: ``grad_data`` (every grad), or
        with sharded grads ``grad_shards`` (this rank's reduced shard of every bucket)."""
        return [self.grad_data if self.grad_shards is None else self.grad_shards]
