"""``distopt bench --pp N``: one rank's pipeline stage of the benchmark GPT, under a torch schedule.

The GPT is split as ``distopt train --pp`` splits it (``distopt.train.stages.GPTStage``: the
blocks evenly, the embeddings on the first stage, the final norm and the head on the last,
every param under its whole-model name) and each stage is sharded over its row of a (pp, dp)
``DeviceMesh``:

* distopt: ``distopt.DistributedDataParallel(stage, device_mesh=mesh, tied_params=...)`` inside
  ``distopt.pipelining.PipelineStage``, with ``distopt.DistributedOptimizer`` (AdamW);
* FSDP2: ``fully_shard`` on each block and on the stage's root over the mesh's "dp" dimension,
  inside torch's own ``PipelineStage`` on the "pp" group, with ``torch.optim.AdamW`` (the
  composition torchtitan uses).

The head's weight is the embedding's (tied), and the first and the last stage each hold a copy.
distopt sums the two copies' grads across the stages itself (``tied_params``). FSDP2 has no
such option, so after the schedule's step each tie rank all-reduces its local shard of the
copy's grad with the other end's over a group of the two (``tie_group``): the shards match,
both ends having the same shape sharded over the same DP size. Both systems thus train the
same math, the unpipelined GPT's, and step the two copies identically.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..train.model import GPT
from ..train.stages import SCHEDULES, GPTStage, stage_loss
from .systems import STAGE_SYSTEMS, System, build_system

__all__ = ["SCHEDULES", "STAGE_DEFAULT_SYSTEMS", "StagedSystem", "build_staged_system",
           "stage_mesh"]

STAGE_DEFAULT_SYSTEMS = ("fsdp2", "distopt", "distopt-shard-grads", "distopt-shard-params")
"""What ``--pp`` runs when ``--systems`` is not given: FSDP2 stages, the baseline of the
ratios, beside distopt's stages with sharded optimizer state and with sharded params."""


def stage_mesh(pp: int, device: torch.device) -> DeviceMesh:
    """The (pp, dp) mesh of every rank of the group: rank ``i * dp + j`` is stage ``i``'s DP
    rank ``j``, as ``distopt train --pp`` lays it out."""
    dp = dist.get_world_size() // pp
    return DeviceMesh(device.type, torch.arange(pp * dp).reshape(pp, dp),
                      mesh_dim_names=("pp", "dp"))


def tie_groups(mesh: DeviceMesh) -> dict[int, dist.ProcessGroup]:
    """For each DP index, the group of the first and the last stage's ranks at that index
    (the two copies of the tie); every rank creates every group, in the same order."""
    ranks = mesh.mesh
    return {j: dist.new_group([int(ranks[0, j]), int(ranks[-1, j])])
            for j in range(ranks.shape[1])}


class StagedSystem:
    """One rank's stage of a configuration: its ``System`` (the wrapped stage module and the
    optimizer) and the schedule that runs its micro-batches."""

    def __init__(self, system: System, stage: GPTStage, index: int, count: int,
                 mesh: DeviceMesh, micro_batches: int, schedule: str,
                 device: torch.device) -> None:
        import torch.distributed.pipelining as pipelining

        from ..pipelining import PipelineStage

        self.system = system
        self.stage = stage
        self.first, self.last = stage.first, stage.last
        self.pp_group = mesh.get_group("pp")
        groups = tie_groups(mesh)
        tied = stage.tied_params()
        self.tie_group = groups[mesh.get_coordinate()[1]] if tied else None
        self.tie_param = next(iter(tied.values()), None)
        self.is_distopt = system.name.startswith("distopt")
        if self.is_distopt:
            pipeline_stage = PipelineStage(system.model, index, count, device)
        else:
            pipeline_stage = pipelining.PipelineStage(system.model, index, count, device,
                                                      group=self.pp_group)
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
        self.schedule = cls(pipeline_stage, n_microbatches=micro_batches, loss_fn=stage_loss)

    @property
    def name(self) -> str:
        return self.system.name

    def zero_grad(self) -> None:
        self.system.zero_grad()

    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One schedule step over this rank's batch; the mean micro-batch loss on the last
        stage, None on the others."""
        losses: list[torch.Tensor] = []
        self.schedule.step(*((x,) if self.first else ()),
                           **({"target": y, "losses": losses} if self.last else {}))
        if not losses:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def sync(self) -> None:
        """Finish the step's grad reductions; for FSDP2, sum the tie's copies by hand."""
        self.system.sync()
        if self.tie_group is not None and not self.is_distopt:
            grad = self.tie_param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.tie_group)

    def step(self) -> None:
        self.system.step()

    def finish_param_sync(self) -> None:
        self.system.finish_param_sync()

    def state_bytes(self) -> dict[str, int]:
        return self.system.state_bytes()

    def whole_model_params(self) -> list[torch.Tensor]:
        """This stage's params whole, the last stage's copy of the tie left out: summed over
        one rank of every stage, the whole model's params, each once."""
        params = self.system.full_params()
        if self.last and not self.first:
            names = [n for n, _ in self.stage.named_parameters()]
            params = [p for n, p in zip(names, params, strict=True) if n != "lm_head.weight"]
        return params


def build_staged_system(name: str, gpt: GPT, mesh: DeviceMesh, device: torch.device, *,
                        micro_batches: int, schedule: str,
                        bucket_size: int | None = None) -> StagedSystem:
    """This rank's stage of ``gpt`` (on ``device``), wrapped as configuration ``name``."""
    if name not in STAGE_SYSTEMS:
        raise ValueError(f"{name} has no pipeline-stage mode; choose from "
                         f"{', '.join(STAGE_SYSTEMS)}")
    pp = mesh.size(0)
    index = mesh.get_coordinate()[0]
    stage = GPTStage(gpt, index, pp)
    tied = stage.tied_params() if name.startswith("distopt") else None
    system = build_system(name, stage, device, bucket_size=bucket_size, mesh=mesh,
                          tied_params=tied)
    return StagedSystem(system, stage, index, pp, mesh, micro_batches, schedule, device)


def stage_param_count(module: nn.Module) -> int:
    """Trainable elements of one stage module (the tie counted on each stage that holds it)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def stage_index_of(rank: int, nproc: int, pp: int) -> int:
    """The stage of global rank ``rank`` on the (pp, dp) mesh of ``stage_mesh``."""
    return rank // (nproc // pp)
