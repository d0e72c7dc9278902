"""Tensor parallelism: DTensor params on the TP dimension of a mesh, ZeRO along the DP dimension.

A model parallelized with ``torch.distributed.tensor.parallel.parallelize_module(module,
mesh["tp"], plan)`` holds DTensor params: each rank keeps a local shard (``Shard``) or a full
copy (``Replicate``) of every parallelized weight, and plain tensors (LayerNorm, anything not in
the plan) are replicated across the TP ranks by construction. distopt treats the local shards as
its parameters: they live in the contiguous buffers, are reduced over the DP group only and are
split by ZeRO across the DP ranks, while the params stay DTensors for the forward.

[Note: DTensor params]
* Buffers hold local shards. ``ParamAndGradBuffer`` lays out ``local_tensor(p)`` and makes the
  DTensor's local tensor a view into ``param_data`` (``alias_local``, in parallel/dtensor.py);
  ``main_grad`` is a plain view of the same local shape. The hook adds
  ``local_grad(p, p.grad)`` into it: the local
  part of the DTensor grad, first redistributed to the param's placements when it differs
  (a ``Partial`` grad of a ``Replicate`` param under sequence parallelism).
* Every rank of one DP group holds the same TP coordinate, so the same local shapes and the
  same buffer layout; the DP collectives never see another TP rank's shard.
* Only the TP dimension may be in a param's mesh: a DTensor sharded along the DP ranks is
  FSDP's layout (distopt already shards the optimizer state there), and a mesh that spans DP
  ranks would make DTensor redistribute across data that differs per DP rank.

[Note: TP grad statistics]
Each rank's main params are disjoint across the DP group, but across the TP group a param is
either sharded (every TP rank owns different elements) or replicated (every TP rank owns the
same elements). The global grad norm and zero count are therefore summed over the DP group and
every TP mesh dimension, with a replicated param's grads counted only on the TP rank whose
coordinate is 0 along each dimension it is replicated over (exact, unlike dividing by the TP
size). The loss scaler's inf flag is a max, so it is reduced over the same groups unweighted.
The TP mesh is derived from the DTensor params (they must all share one), never passed in.

Checkpoints map the local pieces of DTensor params to the global tensor: see
[Note: TP checkpoints] in distopt/checkpoint/tp_runs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist
from torch import nn

from .dtensor import is_dtensor

T = TypeVar("T")

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class TensorParallelMesh:
    """The TP mesh every DTensor param of a model lives on, seen from this rank."""

    mesh: DeviceMesh
    groups: tuple[dist.ProcessGroup, ...]  # one per mesh dimension
    coordinate: tuple[int, ...]  # this rank's position along each dimension

    @classmethod
    def of(cls, mesh: DeviceMesh) -> TensorParallelMesh:
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # checked: every DTensor param holds this rank
        groups = tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
        return cls(mesh=mesh, groups=groups, coordinate=tuple(coordinate))

    def counts_once(self, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param``'s grads in global statistics; see
        [Note: TP grad statistics]. Plain tensors are replicated over every dimension."""
        placements = param.placements if is_dtensor(param) else (None,) * self.mesh.ndim
        return all(
            coord == 0
            for coord, placement in zip(self.coordinate, placements, strict=True)
            if placement is None or placement.is_replicate()
        )


def check_params(
    named: Sequence[tuple[str, nn.Parameter]], dp_group: dist.ProcessGroup | None
) -> TensorParallelMesh | None:
    """Validate the DTensor params of a model against the DP group; return their TP mesh.

    Purely local (no collectives), so every rank raises the same error before communicating.
    None when no param is a DTensor.
    """
    dtensors = [(name, p) for name, p in named if is_dtensor(p)]
    if not dtensors:
        return None
    from torch.distributed.tensor import Replicate, Shard

    first_name, first = dtensors[0]
    mesh = first.device_mesh
    for name, p in dtensors:
        if p.device_mesh != mesh:
            raise ValueError(
                f"DTensor parameters '{first_name}' and '{name}' live on different device "
                f"meshes ({_describe(mesh)} and {_describe(p.device_mesh)}); distopt reduces "
                "grad statistics over one tensor-parallel mesh: parallelize every submodule "
                "over the same mesh['tp']"
            )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"parameter '{first_name}' lives on a device mesh ({_describe(mesh)}) without this "
            f"rank ({dist.get_rank()}); build the model's DTensors on a mesh holding every rank"
        )
    for name, p in dtensors:
        for placement in p.placements:
            if type(placement) not in (Shard, Replicate):
                raise ValueError(
                    f"parameter '{name}' has placement {placement}; distopt supports Shard(d) "
                    "and Replicate() DTensor params (as ColwiseParallel/RowwiseParallel make)"
                )
    my_rank = dist.get_rank()
    dp_ranks = set(dist.get_process_group_ranks(dp_group)) if dp_group is not None else set()
    dp_others = dp_ranks - {my_rank}
    for dim in range(mesh.ndim):
        tp_ranks = set(dist.get_process_group_ranks(mesh.get_group(dim)))
        if not tp_ranks & dp_others:
            continue
        sharded = [n for n, p in dtensors if not p.placements[dim].is_replicate()]
        if tp_ranks == dp_ranks and sharded:
            raise ValueError(
                f"parameter '{sharded[0]}' is sharded along the data-parallel mesh dimension "
                f"(ranks {sorted(dp_ranks)}): sharding params over DP ranks is FSDP's job "
                "(torch.distributed.fsdp.fully_shard), while distopt keeps whole local params "
                "and shards only the optimizer state there. Parallelize over the "
                "tensor-parallel submesh instead: parallelize_module(module, mesh['tp'], plan). "
                "If that group was meant as the TP group, pass the DP one to distopt: "
                "process_group=mesh['dp'].get_group() or device_mesh=mesh"
            )
        raise ValueError(
            f"the data-parallel group (ranks {sorted(dp_ranks)}) overlaps the mesh of the "
            f"DTensor parameters (ranks {sorted(tp_ranks)} along dimension {dim}); the DP and "
            "TP groups must be disjoint: pass process_group=mesh['dp'].get_group() or "
            "device_mesh=mesh, and parallelize over mesh['tp'] only"
        )
    for name, p in dtensors:
        if some_shard_is_empty(tuple(p.shape), tuple(mesh.shape), p.placements):
            raise ValueError(
                f"parameter '{name}' of shape {tuple(p.shape)} with placements "
                f"{tuple(p.placements)} leaves some tensor-parallel rank an empty shard "
                "(DTensor splits like torch.chunk: 6 rows over 4 ranks are 2, 2, 2, 0); make "
                "each sharded dimension divisible by the TP size"
            )
    return TensorParallelMesh.of(mesh)


def some_shard_is_empty(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence
) -> bool:
    """Whether DTensor's torch.chunk-style sharding leaves any rank of the mesh zero elements.

    Pure arithmetic on global sizes, so every rank reaches the same verdict.
    """
    sizes: list[set[int]] = [{n} for n in shape]
    for k, placement in zip(mesh_shape, placements, strict=True):
        if placement.is_replicate():
            continue
        split: set[int] = set()
        for n in sizes[placement.dim]:
            chunk = -(-n // k)
            split |= {min(chunk, max(n - j * chunk, 0)) for j in range(k)}
        sizes[placement.dim] = split
    return any(0 in s for s in sizes)


def _describe(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    return f"ranks {mesh.mesh.tolist()}" + (f" named {names}" if names else "")


def common_mesh(
    meshes: Sequence[TensorParallelMesh | None],
) -> TensorParallelMesh | None:
    """The one TP mesh of several model chunks (chunks without DTensors adopt it)."""
    found = [m for m in meshes if m is not None]
    for m in found[1:]:
        if m.mesh != found[0].mesh:
            raise ValueError(
                "model chunks have DTensor params on different tensor-parallel meshes "
                f"({_describe(found[0].mesh)} and {_describe(m.mesh)}); use one mesh['tp']"
            )
    return found[0] if found else None


def stat_groups(tp: TensorParallelMesh | None) -> list[dist.ProcessGroup]:
    """The TP groups a global grad statistic reduces over besides the DP group."""
    return list(tp.groups) if tp is not None else []


def counted_grads(
    tp: TensorParallelMesh | None,
    model_params: Sequence[nn.Parameter],
    grads: list[T],
) -> list[T]:
    """The grads this rank counts in global grad statistics; ``grads[i]`` belongs to
    ``model_params[i]``. Without TP: every grad (the same list). See
    [Note: TP grad statistics].
    """
    if tp is None:
        return grads
    return [g for p, g in zip(model_params, grads, strict=True) if tp.counts_once(p)]
