"""A model built on the meta device, materialized shard by shard: no rank holds it whole.

[Note: meta-device models]
A model too big for one rank is built under ``torch.device("meta")`` (shapes and dtypes, no
memory), as FSDP2's users do. With sharded params the DDP then materializes it one module at a
time, in registration order: the module's own params and buffers get memory on the target
device (each tensor swapped in place, so that the objects the DDP and its buckets hold stay
the module's), its ``reset_parameters()`` initializes them, the first
data-parallel rank's values are broadcast (torch DDP's rule: every replica starts from rank 0's
weights), each param's slices that fall in this rank's shard of its bucket are copied into the
param shards, and the param becomes a placeholder again. So a rank holds at most one module's
params whole at a time. A module with params but no ``reset_parameters`` cannot be initialized
here: it is refused by name before anything is allocated, as is the meta device without
sharded params (nothing would hold the values). ``load_checkpoint`` can then overwrite the
freshly initialized values. The target device is the process group's: CUDA's current device
under NCCL, the CPU under gloo or on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm
from ..parallel.dtensor import local_tensor
from ..parallel.process_groups import ParallelGroups
from .buffer import ParamAndGradBuffer


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
            "module (see [Note: meta-device models] in ddp/materialize.py), or build the model "
            "on a real device first"
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
    where = {p: buf for buf in buffers for p in buf.params}
    done: set[int] = set()
    for submodule in module.modules():
        own = [t for t in (*submodule.parameters(recurse=False),
                           *submodule.buffers(recurse=False)) if id(t) not in done]
        if not any(t.is_meta for t in own):
            continue
        with torch.no_grad():
            for tensor in own:  # the same objects (the DDP and its buckets hold them), real
                if tensor.is_meta:
                    real = torch.empty_like(tensor, device=device)
                    if isinstance(tensor, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                    torch.utils.swap_tensors(tensor, real)
            submodule.reset_parameters()
            comm.broadcast_from_first_ranks([local_tensor(t.data) for t in own],
                                            parallel.data_parallel_groups)
            for tensor in own:
                done.add(id(tensor))
                if tensor in where:
                    where[tensor].write_shard(tensor)
    for buf in buffers:
        buf.show_placeholders()
