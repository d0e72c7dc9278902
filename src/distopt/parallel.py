"""Which ranks a model is spread over: its data-parallel group and its tensor-parallel mesh.

``DistributedDataParallel`` resolves both once, into a ``ParallelLayout``, and everything that
communicates (the optimizer, checkpoints) takes its groups from that layout instead of
recomputing them from the params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from . import collectives as comm
from .tensor_parallel import TensorParallelMesh, common_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def resolve_dp_group(process_group: Any, device_mesh: DeviceMesh | None) -> Any:
    """The DP group named by ``process_group`` or by ``device_mesh`` (at most one of the two)."""
    if device_mesh is None:
        return process_group
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
        return device_mesh.get_group()
    names = device_mesh.mesh_dim_names or ()
    if "dp" not in names:
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions named {names or 'nothing'}; distopt "
            "needs the data-parallel one: name it 'dp' (mesh_dim_names=('dp', 'tp')) or pass "
            "the 1-D submesh, device_mesh=mesh['dp']"
        )
    return device_mesh["dp"].get_group()


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """This rank's place in the parallel layout of a model, seen from this rank.

    ``dp_group`` is None for a single process. ``tp`` is the mesh of the model's DTensor params,
    None when it has none; see [Note: DTensor params].
    """

    dp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    tp: TensorParallelMesh | None

    @classmethod
    def of(cls, dp_group: dist.ProcessGroup | None,
           tp: TensorParallelMesh | None) -> ParallelLayout:
        return cls(dp_group=dp_group, dp_size=comm.group_size(dp_group),
                   dp_rank=comm.group_rank(dp_group), tp=tp)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.mesh.size()

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks a checkpoint of the model is collective over: the DP group, or with TP
        every rank (the default group, checked here to be the DP group times the TP mesh, so
        that every rank raises the same error before communicating)."""
        if self.tp is None:
            return self.dp_group
        world = dist.get_world_size()
        if self.dp_size * self.tp_size != world:
            raise ValueError(
                f"checkpoints of tensor-parallel models are collective over every rank, but the "
                f"data-parallel group ({self.dp_size} ranks) times the tensor-parallel mesh "
                f"({self.tp_size} ranks) is not the world ({world} ranks): run the model on a "
                "(dp, tp) mesh that spans the default process group"
            )
        return dist.group.WORLD


def common_layout(layouts: Sequence[ParallelLayout]) -> ParallelLayout:
    """The one layout of several model chunks: one DP group, and one TP mesh, which chunks
    without DTensor params adopt."""
    if len({id(layout.dp_group) for layout in layouts}) > 1:
        raise ValueError("all model chunks must use the same data-parallel process group")
    return replace(layouts[0], tp=common_mesh([layout.tp for layout in layouts]))
