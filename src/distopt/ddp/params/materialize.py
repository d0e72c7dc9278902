"""A model built on the meta device, materialized shard by shard: no rank holds it whole.

[Note: meta-device models]
A model too big for one rank is built under ``torch.device("meta")`` (shapes and dtypes, no
memory), as FSDP2's users do. With sharded params the DDP then materializes it module by module,
in registration order (``module.modules()``), with the values the same model built whole on one
process from the same RNG state has, so a run does not depend on where it was built:

* over one flat data-parallel group (the common case) only its first rank initializes: it gives
  each module's own params and buffers memory on the target device (each tensor swapped in
  place, so that the objects the DDP and its buckets hold stay the module's), a trainable
  param as a view of its bucket's staging buffer, runs its ``reset_parameters()`` (which
  writes the values there) and lets the param go again; a bucket whose params are all in is
  scattered, each rank receiving its shard
  straight into its ``param_shards``, while the first rank goes on with the next modules (one
  scatter in flight). The other ranks allocate nothing but their shards, the module buffers and
  any frozen params, which the first rank broadcasts (torch DDP's rule: every replica starts
  from the first rank's values). At the end every rank takes the first rank's RNG state, the
  one a whole build on one process leaves. So the first rank holds one module whole and at
  most two buckets at a time, the others nothing beyond their shards;
* with replicas, tensor or expert parallelism every rank initializes each module whole, the
  first ranks' values are broadcast and each rank keeps its shards (one module at a time).

A module with params but no ``reset_parameters`` cannot be initialized here: it is refused by
name before anything is allocated, as is the meta device without sharded params (nothing would
hold the values). ``load_checkpoint`` can then overwrite the freshly initialized values. The
target device is the process group's: CUDA's current device under NCCL, the CPU under gloo or
on one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from ...layout.elementwise import Range
from ...parallel.dtensor import alias_local, local_tensor
from ...parallel.process_groups import ParallelGroups
from ..buffers.bucket import Bucket
from ..buffers.buffer import ParamAndGradBuffer


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def target_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a meta-device model's shards go: the data-parallel group's device."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_materializable(module: nn.Module, shard_params: bool) -> None:
    """Refuse, before anything is allocated, a meta-device model distopt cannot initialize."""
    if not shard_params:
        raise ValueError(
            "the model's params are on the meta device, which holds no values: pass "
            "shard_params=True to have distopt materialize this rank's shards module by "
            "module (see [Note: meta-device models] in ddp/params/materialize.py), or build "
            "the model on a real device first"
        )
    for name, submodule in module.named_modules():
        own = [t for t in (*submodule.parameters(recurse=False),
                           *submodule.buffers(recurse=False)) if t.is_meta]
        if own and not callable(getattr(submodule, "reset_parameters", None)):
            raise ValueError(
                f"module '{name or type(module).__name__}' ({type(submodule).__name__}) has "
                "params or buffers on the meta device but no reset_parameters() to initialize "
                "them: "
                "define reset_parameters() on it, or build the model on a real device"
            )


def materialize_shards(module: nn.Module, buffers: list[ParamAndGradBuffer],
                       parallel: ParallelGroups, device: torch.device) -> None:
    """Initialize a meta-device model one module at a time into the buffers' param shards;
    see [Note: meta-device models]. Collective over the data-parallel groups."""
    flat = (comm.group_size(parallel.replicate_group) == 1 and parallel.tp is None
            and all(b.group is parallel.dp_group for buf in buffers for b in buf.buckets))
    if flat:
        _from_first_rank(module, buffers, parallel.dp_group, device)
    else:
        _on_every_rank(module, buffers, parallel, device)
    for buf in buffers:
        buf.show_placeholders()


def _meta_tensors_by_module(module: nn.Module) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """Each module with tensors of its own still on the meta device, in registration order,
    with those tensors (a tensor registered twice, as a tied param, belongs to the first)."""
    seen: set[int] = set()
    out = []
    for submodule in module.modules():
        own = [t for t in (*submodule.parameters(recurse=False),
                           *submodule.buffers(recurse=False)) if id(t) not in seen]
        seen.update(id(t) for t in own)
        if any(t.is_meta for t in own):
            out.append((submodule, own))
    return out


def _swap_in(tensor: torch.Tensor, real: torch.Tensor) -> None:
    """Give a meta tensor ``real``'s storage, the object itself kept."""
    if isinstance(tensor, nn.Parameter):
        real = nn.Parameter(real, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, real)


def _from_first_rank(module: nn.Module, buffers: list[ParamAndGradBuffer],
                     group: dist.ProcessGroup | None, device: torch.device) -> None:
    first = comm.group_rank(group) == 0
    size = comm.group_size(group)
    src = dist.get_global_rank(group, 0) if size > 1 else 0
    where: dict[nn.Parameter, tuple[Bucket, Range]] = {}
    missing: dict[Bucket, int] = {}
    for buf in buffers:
        for bucket in buf.buckets:
            missing[bucket] = len(bucket.params)
            for param, slot in zip(bucket.params, bucket.param_ranges, strict=True):
                where[param] = (bucket, slot)
    nothing = {dtype: torch.zeros((), dtype=dtype, device=device)
               for dtype in {p.dtype for p in where}}
    staging = _Staging(list(missing), device, group, src, size)
    for submodule, own in _meta_tensors_by_module(module):
        with torch.no_grad():
            for tensor in own:
                if not tensor.is_meta:
                    continue
                if tensor not in where:  # replicated: every rank holds it whole
                    _swap_in(tensor, torch.empty_like(tensor, device=device))
                elif first:  # initialized straight into its bucket's staging buffer
                    bucket, slot = where[tensor]
                    region = staging.of(bucket)[slot.start : slot.end]
                    _swap_in(tensor, region.view(tensor.shape))
                else:  # no memory: the shard arrives by scatter
                    _swap_in(tensor, nothing[tensor.dtype].expand(tensor.shape))
            if first:
                submodule.reset_parameters()
            replicated = [t for t in own if t not in where]
            if replicated and size > 1:
                for tensor in replicated:
                    dist.broadcast(tensor.data, src=src, group=group)
            for tensor in own:
                if tensor not in where:
                    continue
                bucket, _ = where[tensor]
                if first:
                    alias_local(tensor, nothing[tensor.dtype].expand(tensor.shape))
                missing[bucket] -= 1
                if missing[bucket] == 0:
                    staging.send(bucket)
    staging.finish()
    _take_first_rank_rng(device, group, src, size)


class _Staging:
    """The first rank's bucket-sized buffers, reused: a bucket's params are initialized straight
    into one (no copy), which is scattered once they are all in, and free again once that
    scatter is done; one scatter at a time, so two buffers of the largest bucket suffice (one
    filling, one sending), touched once rather than a fresh bucket's pages each time."""

    def __init__(self, buckets: list[Bucket], device: torch.device,
                 group: dist.ProcessGroup | None, src: int, size: int) -> None:
        self.device, self.group, self.src, self.size = device, group, src, size
        self.first = comm.group_rank(group) == 0
        self.numel: dict[torch.dtype, int] = {}
        for bucket in buckets:
            dtype = bucket.param_shard.dtype
            self.numel[dtype] = max(self.numel.get(dtype, 0), bucket.numel)
        self.free: dict[torch.dtype, list[torch.Tensor]] = {d: [] for d in self.numel}
        self.open: dict[Bucket, torch.Tensor] = {}
        self.in_flight: tuple[Any, torch.Tensor | None, torch.dtype] | None = None

    def of(self, bucket: Bucket) -> torch.Tensor:
        """The staging buffer of ``bucket`` [bucket numel] (first rank)."""
        if bucket not in self.open:
            dtype = bucket.param_shard.dtype
            if not self.free[dtype]:
                self.finish()
            self.open[bucket] = (self.free[dtype].pop() if self.free[dtype] else
                                 torch.empty(self.numel[dtype], dtype=dtype, device=self.device))
        return self.open[bucket][: bucket.numel]

    def send(self, bucket: Bucket) -> None:
        """Start scattering ``bucket`` (all its params in) into every rank's shard."""
        self.finish()
        full = None
        if self.first:
            full = self.of(bucket)
            ranges = sorted(bucket.param_ranges, key=lambda r: r.start)
            for gap_start, gap_end in zip([0, *(r.end for r in ranges)],
                                          [*(r.start for r in ranges), bucket.numel],
                                          strict=True):
                full[gap_start:gap_end].zero_()  # padding: a reused buffer holds old values
        handle = _scatter(bucket, full, self.group, self.src, self.size)
        self.in_flight = (handle, self.open.pop(bucket, None), bucket.param_shard.dtype)

    def finish(self) -> None:
        """Wait for the scatter in flight, if any; its buffer is free again."""
        if self.in_flight is not None:
            handle, buffer, dtype = self.in_flight
            self.in_flight = None
            handle.wait()
            if buffer is not None:
                self.free[dtype].append(buffer)


class _Done:
    """The handle of a scatter on one process: the copy is done already."""

    def wait(self) -> None:
        pass


def _scatter(bucket: Bucket, full: torch.Tensor | None, group: dist.ProcessGroup | None,
             src: int, size: int) -> Any:
    """Start sending each rank its shard of ``full`` (on the first rank) into its
    ``param_shard``; a handle whose ``wait`` finishes it."""
    if size == 1:
        assert full is not None
        bucket.param_shard.copy_(full)
        return _Done()
    chunks = list(full.chunk(size)) if full is not None else None
    return dist.scatter(bucket.param_shard, chunks, src=src, group=group, async_op=True)


def _take_first_rank_rng(device: torch.device, group: dist.ProcessGroup | None, src: int,
                         size: int) -> None:
    """Every rank's generator of ``device`` as the first rank left it: the state a whole
    build on one process leaves."""
    if size == 1:
        return
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    moved = state.to(device) if cuda else state
    dist.broadcast(moved, src=src, group=group)
    if cuda:
        torch.cuda.set_rng_state(moved.cpu(), device)
    else:
        torch.set_rng_state(moved)


def _on_every_rank(module: nn.Module, buffers: list[ParamAndGradBuffer],
                   parallel: ParallelGroups, device: torch.device) -> None:
    where = {p: buf for buf in buffers for p in buf.params}
    for submodule, own in _meta_tensors_by_module(module):
        with torch.no_grad():
            for tensor in own:  # the same objects (the DDP and its buckets hold them), real
                if tensor.is_meta:
                    _swap_in(tensor, torch.empty_like(tensor, device=device))
            submodule.reset_parameters()
            comm.broadcast_from_first_ranks([local_tensor(t.data) for t in own],
                                            parallel.data_parallel_groups)
            for tensor in own:
                if tensor in where:
                    where[tensor].write_shard(tensor)
                    # One module whole at a time: back to nothing once its shard is kept.
                    alias_local(tensor, torch.zeros((), dtype=tensor.dtype, device=device)
                                .expand(local_tensor(tensor).shape))
