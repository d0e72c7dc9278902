"""Which ranks a model is spread over: its data-parallel group and its tensor-parallel mesh.

``DistributedDataParallel`` resolves both once, into a ``ParallelGroups``, and everything that
communicates (the optimizer, checkpoints) takes its groups from that layout instead of
recomputing them from the params.

[Note: hierarchical data parallelism]
On several nodes, a flat layout sends every reduce-scatter and all-gather byte over the slow
inter-node network and shards the optimizer state far finer than memory needs. A mesh with
dimensions ("dp_replicate", "dp_shard") shards within a group (e.g. the ranks of one node)
and replicates across such groups. Buckets are laid out for d = the shard size and
reduce-scattered in the shard group during backward; as soon as a bucket's reduce-scatter has
finished, this rank's reduced chunk is all-averaged over the replicate group (the ranks that
own the same chunk in the other replicas), still during backward, in launch order
(``Bucket.advance_reduction``); the optimizer steps the chunk, and the all-gather runs in the
shard group. Replicas then hold identical chunks, so grad statistics (norm, zero count, inf
flag, nan check) reduce over the shard group only and count every element once; only
``find_unused_parameters``, the start-up broadcast and the broadcast of module buffers
([Note: buffer broadcasting] in ddp/module_buffers.py) span both groups. Memory per rank is the
table at d = the shard size; the replicate group carries 2 (N/s)(r - 1)/r elements per rank
and step, 1/s of a flat all-reduce. With ``reduce_scatter_with_fp32_accumulation`` the second
stage sums in fp32 as well (see [Note: fp32-accumulated reduce-scatter]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..comm import collectives as comm
from .managed_replicas import ManagedReplicas
from .tensor_parallel import TensorParallelMesh, common_mesh, stat_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


MESH_DIMS = ("pp", "dp", "dp_replicate", "dp_shard", "tp")
"""The mesh dimension names distopt reads: a flat data-parallel dimension ("dp"), or a
hierarchical one ("dp_replicate" x "dp_shard", see [Note: hierarchical data parallelism]),
beside the tensor-parallel one ("tp") that DTensor params live on and the pipeline one ("pp")
whose ranks hold the other stages (see [Note: pipeline stages] in distopt/pipelining.py)."""


def resolve_dp_groups(process_group: Any, device_mesh: DeviceMesh | None) -> tuple[Any, Any]:
    """The groups named by ``process_group`` or by ``device_mesh`` (at most one of the two):
    the group buckets are sharded over, and the group the shards are replicated over (None
    unless the mesh has a "dp_replicate" dimension)."""
    if device_mesh is None:
        return process_group, None
    from torch.distributed.device_mesh import DeviceMesh

    if process_group is not None:
        raise ValueError(
            "pass the data-parallel group either as process_group= or as device_mesh=, not both"
        )
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(device_mesh).__name__}"
        )
    if device_mesh.ndim == 1:
        return device_mesh.get_group(), None
    names = tuple(device_mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown or not names:
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions named {names or 'nothing'}; distopt "
            "needs the data-parallel one: name it 'dp' (mesh_dim_names=('dp', 'tp')), or shard "
            "within a node and replicate across nodes with ('dp_replicate', 'dp_shard'), or "
            "pass the 1-D submesh, device_mesh=mesh['dp'] (distopt reads the dimensions "
            f"{', '.join(MESH_DIMS)})"
        )
    if "dp_shard" in names:
        if "dp" in names:
            raise ValueError(
                f"device_mesh names both 'dp' and 'dp_shard' ({names}); name the data-parallel "
                "dimensions either 'dp' (flat) or 'dp_replicate' and 'dp_shard' (hierarchical)"
            )
        replicate = device_mesh["dp_replicate"].get_group() if "dp_replicate" in names else None
        return device_mesh["dp_shard"].get_group(), replicate
    if "dp" not in names:
        raise ValueError(
            f"device_mesh has dimensions {names} but no data-parallel one to shard over; add "
            "'dp' (flat) or 'dp_shard' (with 'dp_replicate', hierarchical)"
        )
    return device_mesh["dp"].get_group(), None


def resolve_pp_group(device_mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The group of the pipeline stages this rank's model is one of: the mesh's "pp"
    dimension, None without one."""
    if device_mesh is None or "pp" not in (device_mesh.mesh_dim_names or ()):
        return None
    return device_mesh["pp"].get_group()


THIS_PROCESS = object()  # process_group of for_this_process(): no group, even under dist


def resolve_group(process_group: Any) -> dist.ProcessGroup | None:
    """The DP group a DDP was given: ``THIS_PROCESS`` means none, None the default group (none
    when torch.distributed is not initialized)."""
    if process_group is THIS_PROCESS:
        return None
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This rank's place in the parallel layout of a model, seen from this rank.

    ``dp_group`` is None for a single process. ``tp`` is the mesh of the model's DTensor params,
    None when it has none; see [Note: DTensor params].
    """

    dp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    tp: TensorParallelMesh | None
    replicate_group: dist.ProcessGroup | None = None
    replicate_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    """The pipeline stages' group (one rank per stage, at this rank's DP and TP coordinates),
    None without pipeline parallelism; see [Note: pipeline stages] in distopt/pipelining.py."""
    managed_replicas: ManagedReplicas | None = None
    """The replica groups a torchft Manager runs, which only the grads' second reduction stage
    and the step's commit see (``replicate_group`` is then None); see [Note: fault-tolerant
    replicas] in parallel/managed_replicas.py."""

    @classmethod
    def of(cls, dp_group: dist.ProcessGroup | None, tp: TensorParallelMesh | None,
           replicate_group: dist.ProcessGroup | None = None, *,
           mesh: DeviceMesh | None = None,
           managed_replicas: ManagedReplicas | None = None) -> ParallelGroups:
        """The layout of these groups; ``mesh``: the DDP's mesh, whose "pp" dimension (if
        any) names the pipeline stages."""
        return cls(dp_group=dp_group, dp_size=comm.group_size(dp_group),
                   dp_rank=comm.group_rank(dp_group), tp=tp, replicate_group=replicate_group,
                   replicate_size=comm.group_size(replicate_group),
                   pp_group=resolve_pp_group(mesh), managed_replicas=managed_replicas)

    @property
    def pp_size(self) -> int:
        return comm.group_size(self.pp_group)

    @property
    def pp_rank(self) -> int:
        return comm.group_rank(self.pp_group)

    @property
    def data_parallel_groups(self) -> list[dist.ProcessGroup | None]:
        """Every group of data-parallel ranks: the shard group, then the replicate group."""
        return [self.dp_group, self.replicate_group]

    @property
    def first_dp_rank(self) -> bool:
        """Whether this rank is at coordinate 0 of every data-parallel group: the rank whose
        module buffers the others receive (see [Note: buffer broadcasting] in
        ddp/module_buffers.py)."""
        return self.dp_rank == 0 and comm.group_rank(self.replicate_group) == 0

    def verdict_groups(
        self, *, sharded: bool = True, replicas: bool = False
    ) -> list[dist.ProcessGroup | None]:
        """The groups over which a verdict on the reduced grads this rank holds (an inf, a
        nan, a norm) is agreed: the shard group when its ranks hold different shards, then the
        TP groups, then the pipeline stages (each holds other params). Replicas hold the same
        reduced grads, so they agree without their group; ``replicas`` adds it for a verdict on
        what each rank produced before the reduction."""
        return (([self.dp_group] if sharded else [])
                + ([self.replicate_group] if replicas else []) + stat_groups(self.tp)
                + ([self.pp_group] if self.pp_size > 1 else []))

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.mesh.size()

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks a checkpoint of the model is collective over: the DP group, or with TP
        every rank (the default group, checked here to be the DP group times the TP mesh, so
        that every rank raises the same error before communicating). A pipeline stage's
        checkpoint is one of the whole model, collective over every rank ([Note: pipeline
        checkpoints] in checkpoint/pipeline.py)."""
        if self.pp_group is not None:
            world = dist.get_world_size()
            size = self.pp_size * self.dp_size * self.replicate_size * self.tp_size
            if size != world:
                raise ValueError(
                    f"checkpoints of pipelined models are collective over every rank, but the "
                    f"mesh (pipeline x data-parallel x tensor-parallel: {size} ranks) is not the "
                    f"world ({world} ranks): build the ('pp', 'dp') mesh over every rank"
                )
            return dist.group.WORLD
        if self.tp is None and self.replicate_group is None:
            return self.dp_group
        world = dist.get_world_size()
        if self.tp is not None and self.dp_size * self.replicate_size * self.tp_size != world:
            raise ValueError(
                f"checkpoints of tensor-parallel models are collective over every rank, but the "
                f"data-parallel group ({self.dp_size * self.replicate_size} ranks) times the "
                f"tensor-parallel mesh ({self.tp_size} ranks) is not the world ({world} ranks): "
                "run the model on a (dp, tp) mesh that spans the default process group"
            )
        if self.tp is None and self.dp_size * self.replicate_size != world:
            raise ValueError(
                f"checkpoints of a model sharded over {self.dp_size} ranks and replicated over "
                f"{self.replicate_size} are collective over every rank, but that is not the world "
                f"({world} ranks): build the ('dp_replicate', 'dp_shard') mesh over every rank"
            )
        return dist.group.WORLD


def common_groups(layouts: Sequence[ParallelGroups]) -> ParallelGroups:
    """The one layout of several model chunks: one DP group, and one TP mesh, which chunks
    without DTensor params adopt."""
    if len({(id(layout.dp_group), id(layout.replicate_group)) for layout in layouts}) > 1:
        raise ValueError("all model chunks must use the same data-parallel process group")
    if len({id(layout.pp_group) for layout in layouts}) > 1:
        raise ValueError(
            "all model chunks must be stages of the same pipeline: build every chunk's "
            "DistributedDataParallel with the same device_mesh (its 'pp' dimension)"
        )
    return replace(layouts[0], tp=common_mesh([layout.tp for layout in layouts]))
