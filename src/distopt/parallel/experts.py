"""Expert parallelism: a mixture of experts' experts spread over ranks, each expert's params
sharded over its own data-parallel group.

[Note: expert parallelism]
A mixture of experts (MoE) routes each token to k of E experts. Under expert parallelism (EP)
each rank holds E / ep of them, and a token reaches its experts through an all-to-all over the
EP group. The ranks form a mesh (dp, ep): the dense params (attention, norms, embeddings, the
router) are replicated on every rank and data-parallel over all dp * ep of them, while an
expert's params live on the dp ranks at one EP coordinate, its *expert-data-parallel* group.
``ExpertParallel(mesh, modules)`` says both: the mesh ("dp", "ep") and the ``nn.ModuleList``s
that hold this rank's experts. ``DistributedDataParallel(module, experts=...)`` then keeps one
model and one set of hooks, but two kinds of buffers:

* dense buffers, laid out for d = dp * ep and reduce-scattered and gathered over the DDP's group;
* expert buffers (``ParamAndGradBuffer.expert``), laid out for d = dp and reduce-scattered and
  gathered over the expert-DP group. Their buckets launch in the one launch order of
  [Note: bucket launch order] with the dense ones, each on its own group, so every group sees
  its collectives in the same order on each of its ranks.

The averaging factor. The reference is one process that trains the whole batch with every expert
local: the loss is the mean over every token of the batch, so an expert's grad is the sum, over
every token that reached it, of that token's grad, divided by the tokens of the whole batch.
Each rank's loss is the mean over its own tokens (1/(dp * ep) of the batch), and the all-to-all's
backward already returns to an expert the grads of every token its EP group routed to it: so
the grad an expert holds on one rank is the sum over its EP group's tokens of the grads of
``loss_r``, and the sum of those over its expert-DP group is the sum over every rank's. The
reference is that sum divided by dp * ep, the dense group's size, not by the dp ranks that
reduce it: averaging over the expert-DP group alone would leave expert grads ep times too large.
So an expert bucket's grads are multiplied by 1/ep before its average over the dp ranks (exact
for ep a power of two), which is the sum divided by dp * ep. Megatron-Core divides expert grads
by the dense data-parallel size for the same reason.

Global statistics need nothing more: every element of a dense bucket is owned by one rank of the
dense group, every element of an expert is owned by one rank of its expert-DP group, and the EP
coordinates hold different experts, so the sum of squares over the dense group (every rank of
the mesh) counts each element of the model exactly once; one all-reduce gives the norm, one
the inf/nan verdict, over both kinds. ``find_unused_parameters`` asks whether any rank that
holds a param computed a grad for it: a dense param over the whole mesh, an expert's over its
expert-DP group (``used_anywhere``, one all-reduce over the mesh with one slot per EP
coordinate), as one process with every expert local would see a grad or None.

Sharded params (``shard_params=True``) gather an expert's bucket over its expert-DP group
around the expert's forward and backward: every rank of that group must run the expert in every
forward, an idle one on no rows (``MoE.run_idle_experts`` in the demo), by the rule of
[Note: every rank runs the same modules] in ddp/params/param_unshard.py; an idle expert's grad is
then zero, never None.

Names. An expert is known by its global index: this rank's experts of a list of n are the
global experts ``ep_rank * n .. ep_rank * n + n - 1``, so the param ``moe.experts.1.w`` of EP
rank 1 (n = 2) is ``moe.experts.3.w`` of the model with every expert local. Checkpoints key
expert params, their state and their model entries by that global name, and list every EP
coordinate's (``ExpertParams.global_order``), so a checkpoint saved at one (dp, ep) loads at
another, or into the model with every expert local, and back (see [Note: expert checkpoints] in
checkpoint/format.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives as comm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

V = TypeVar("V")

EXPERT_MESH_DIMS = ("dp", "ep")
"""The dimension names of an expert mesh: the expert-data-parallel one, then the EP one."""


class ExpertParallel:
    """Which modules of a model are experts, and the mesh their ranks form.

    Args:
        mesh: a 2-D ``DeviceMesh`` named ``("dp", "ep")`` over the ranks of the DDP's
            data-parallel group (by default every rank): ``mesh["ep"]`` is the group a token's
            all-to-all runs over, ``mesh["dp"]`` the expert-data-parallel group that holds the
            same experts and reduces their grads.
        modules: the ``nn.ModuleList`` of this rank's experts, or a sequence of them (one per
            MoE layer). Each list holds n experts, this rank's ``ep_rank * n ..
            ep_rank * n + n - 1``, under the path where the model with every expert local holds
            all ``n * ep`` of them. See [Note: expert parallelism].
    """

    def __init__(self, mesh: DeviceMesh, modules: nn.ModuleList | Sequence[nn.ModuleList]) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"ExpertParallel takes a torch.distributed.device_mesh.DeviceMesh, got "
                f"{type(mesh).__name__}: init_device_mesh(device, (dp, ep), "
                "mesh_dim_names=('dp', 'ep'))"
            )
        names = tuple(mesh.mesh_dim_names or ())
        if names != EXPERT_MESH_DIMS:
            raise ValueError(
                f"the expert mesh has {mesh.ndim} dimensions named {names or 'nothing'}; build "
                "it as init_device_mesh(device, (dp, ep), mesh_dim_names=('dp', 'ep')): the "
                "expert-data-parallel dimension, then the expert-parallel one"
            )
        lists = [modules] if isinstance(modules, nn.ModuleList) else list(modules)
        if not lists or not all(isinstance(m, nn.ModuleList) and len(m) for m in lists):
            raise TypeError(
                "ExpertParallel's modules are the nn.ModuleList(s) of this rank's experts, each "
                "holding at least one expert (one list per MoE layer)"
            )
        self.mesh = mesh
        self.modules: tuple[nn.ModuleList, ...] = tuple(lists)
        self.ep_group: dist.ProcessGroup = mesh["ep"].get_group()
        self.expert_dp_group: dist.ProcessGroup = mesh["dp"].get_group()
        self.ep_size = comm.group_size(self.ep_group)
        self.ep_rank = comm.group_rank(self.ep_group)
        self.expert_dp_size = comm.group_size(self.expert_dp_group)
        self.expert_dp_rank = comm.group_rank(self.expert_dp_group)

    @property
    def grad_scale(self) -> float:
        """What an expert bucket's grads are multiplied by before their average over the
        expert-DP group; see [Note: expert parallelism]."""
        return 1.0 / self.ep_size

    def buffer_options(self) -> dict[str, object]:
        """What an expert buffer is built with: the expert-DP group, this rank's place in it,
        and the factor its grads take first."""
        return dict(dp_rank=self.expert_dp_rank, group=self.expert_dp_group, expert=True,
                    grad_scale=self.grad_scale)

    def describe(self) -> str:
        """What every rank of the mesh must agree on (the model check compares it)."""
        return f"ep={self.ep_size} expert_dp={self.expert_dp_size}"

    def resolve(self, module: nn.Module, trainable: Sequence[tuple[str, nn.Parameter]],
                dp_group: dist.ProcessGroup | None, *, replicated: bool,
                tensor_parallel: bool, reduce_scatter: bool) -> ExpertParams:
        """The expert params of ``module`` (whose trainable params are ``trainable``) and
        their global names; raises, on every rank alike and before any collective, where the
        experts cannot compose with the rest of the DDP's arguments. The DDP calls it when it
        is built with ``experts=``.

        Args:
            module: the wrapped model; the expert lists must be its submodules, neither nested
                nor the whole model, and their params tied to nothing outside them.
            trainable: the model's trainable params with their names, as the DDP holds them.
            dp_group: the DDP's data-parallel group (None: this process alone), which must
                span the same ranks as the expert mesh.
            replicated: whether the DDP's mesh has a replicate dimension (hierarchical data
                parallelism), which experts do not compose with.
            tensor_parallel: whether the model has DTensor (tensor-parallel) params, which
                experts do not compose with either.
            reduce_scatter: whether the DDP reduce-scatters its grads (the distributed
                optimizer); experts need it, since only its step counts their grads across
                the expert-parallel ranks.
        """
        if replicated or tensor_parallel:
            raise ValueError(
                "experts= composes with a flat data-parallel group only: drop the "
                f"{'dp_replicate mesh' if replicated else 'DTensor (tensor-parallel) params'}"
                " or the experts"
            )
        if not reduce_scatter:
            raise ValueError(
                "experts= needs the distributed optimizer (sharding 'optim' or 'optim_grads'): "
                "the replicated optimizer (use_distributed_optimizer=False, sharding='none', "
                "BasicOptimizer) does not count expert grads across the EP ranks; use "
                "distopt.DistributedOptimizer"
            )
        mesh_ranks = sorted(int(r) for r in self.mesh.mesh.flatten().tolist())
        dp_ranks = (sorted(dist.get_process_group_ranks(dp_group)) if dp_group is not None
                    else [dist.get_rank()])
        if mesh_ranks != dp_ranks:
            raise ValueError(
                f"the expert mesh spans ranks {mesh_ranks} but the data-parallel group of the "
                f"dense params is ranks {dp_ranks}; the dense params are data-parallel over "
                "every rank of the (dp, ep) mesh: build the mesh over the DDP's group (by "
                "default every rank) or pass process_group= with the mesh's ranks"
            )
        paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        lists = []
        for expert_list in self.modules:
            if id(expert_list) not in paths:
                raise ValueError(
                    "an nn.ModuleList given to ExpertParallel is not a submodule of the wrapped "
                    "model: pass the model's own lists of experts (e.g. "
                    "[block.moe.experts for block in model.blocks])"
                )
            lists.append((paths[id(expert_list)], len(expert_list)))
        for path, _ in lists:
            inner = [p for p, _ in lists if p != path and p.startswith(path + ".")]
            if inner or not path:
                raise ValueError(
                    f"the expert lists '{path}' and '{(inner or [''])[0]}' are nested, or one is "
                    "the whole model: give the innermost nn.ModuleList of each MoE layer"
                )
        expert_ids = {id(p) for m in self.modules for p in m.parameters()}
        for m in self.modules:
            for name, _ in m.named_buffers():
                raise ValueError(
                    f"expert module buffer '{name}': buffers of experts are not supported (they "
                    "would be broadcast from another EP rank's experts); keep experts to params"
                )
        for name, p in module.named_parameters(remove_duplicate=False):
            inside = any(name.startswith(path + ".") for path, _ in lists)
            if (id(p) in expert_ids) != inside:
                raise ValueError(
                    f"parameter '{name}' is shared between an expert and another module: "
                    "experts live on some EP ranks only, so they cannot be tied to other params"
                )
        params = frozenset(p for _, p in trainable if id(p) in expert_ids)
        if not params:
            raise ValueError("the experts given to ExpertParallel have no trainable parameters")
        return ExpertParams(self, tuple(lists), params)


@dataclass(frozen=True, slots=True)
class ExpertParams:
    """The experts of one wrapped model: which params, and the global names of their entries."""

    parallel: ExpertParallel
    lists: tuple[tuple[str, int], ...]
    """(path in the model, experts on this rank) of each list of experts."""
    params: frozenset[nn.Parameter]
    """The trainable params of the experts."""

    def _split(self, name: str) -> tuple[str, int, int, str] | None:
        """(list path, its experts per rank, local index, the rest of the name) of a name
        under a list of experts; None for any other name."""
        for path, n in self.lists:
            if name.startswith(path + "."):
                index, _, rest = name[len(path) + 1:].partition(".")
                return path, n, int(index), rest
        return None

    def name_at(self, name: str, ep_rank: int) -> str:
        """The global name of the entry ``name`` (a param, or any key of the module's
        state_dict) of EP rank ``ep_rank``'s model; other names as they are."""
        split = self._split(name)
        if split is None:
            return name
        path, n, index, rest = split
        return f"{path}.{ep_rank * n + index}" + (f".{rest}" if rest else "")

    def global_name(self, name: str) -> str:
        """This rank's entry ``name`` under its global name."""
        return self.name_at(name, self.parallel.ep_rank)

    def global_order(self, names: Sequence[str]) -> list[str]:
        """Every EP rank's entries of ``names`` (this rank's, in their order), in the order
        the model with every expert local registers them: each run of names under one list of
        experts is repeated for each EP rank, lowest first."""
        return [name for name, _ in self.everywhere([(n, None) for n in names])]

    def everywhere(self, items: Sequence[tuple[str, V]]) -> list[tuple[str, V]]:
        """``global_order`` of (name, value) pairs, each expert's value standing for the
        values of the experts in its place on the other EP ranks (their shapes and dtypes:
        every EP rank holds experts of the same structure)."""
        out: list[tuple[str, V]] = []
        run: list[tuple[str, V]] = []
        run_list: str | None = None

        def flush() -> None:
            out.extend((self.name_at(n, c), v) for c in range(self.parallel.ep_size)
                       for n, v in run)

        for name, value in items:
            split = self._split(name)
            path = None if split is None else split[0]
            if path is None or path != run_list:
                flush()
                run, run_list = [], path
            if path is None:
                out.append((name, value))
            else:
                run.append((name, value))
        flush()
        return out

    def is_expert_entry(self, name: str) -> bool:
        """Whether ``name`` (a param, or a key of the module's state_dict) is an expert's."""
        return self._split(name) is not None


def used_anywhere(used: Sequence[int], expert: Sequence[bool], experts: ExpertParallel,
                  dp_group: dist.ProcessGroup | None, device: torch.device,
                  stats: comm.CommStats | None) -> list[int]:
    """Whether some rank that holds each param computed a grad for it: over the dense group for
    a dense param, over the expert-DP group for an expert's. One all-reduce (max) over the
    dense group, each expert flag in the slot of this rank's EP coordinate, so that ranks with
    other experts in the same place leave it alone; see [Note: expert parallelism]."""
    slots, mine = experts.ep_size, experts.ep_rank
    values = [0] * (len(used) * slots)
    for i, (u, is_expert) in enumerate(zip(used, expert, strict=True)):
        values[i * slots + (mine if is_expert else 0)] = u
    flags = torch.tensor(values, dtype=torch.int32, device=device)
    comm.all_reduce_small(flags, dist.ReduceOp.MAX, [dp_group], stats)
    flags = flags.view(len(used), slots)
    return [int(flags[i, mine if is_expert else 0]) for i, is_expert in enumerate(expert)]

