"""What a cluster layout costs each rank: memory by component and bytes sent per step.

Pure arithmetic, no torch.distributed: for ``nodes`` x ``gpus_per_node`` ranks and a shard size
``s``, the bytes per parameter one rank holds (``memory.bytes_per_param_breakdown`` at d = s) and
the bytes per parameter it sends in one optimizer step, split into what stays inside a node and what
crosses nodes, for sharding within groups of ``s`` ranks (a ("dp_replicate", "dp_shard") mesh; see
[Note: hierarchical data parallelism] in parallel/process_groups.py) and for the flat layout (``s``
= every rank). ``distopt memory --nodes N --gpus-per-node G --shard-size S`` prints both.

[Note: cluster traffic model]
What one rank sends per step, with N params, s ranks per shard group, r = ranks / s replicas,
g and p the bytes of a grad and of a param element (padding left out):

- reduce-scatter of the grads in the shard group: (s - 1)/s N g,
- all-reduce of this rank's reduced chunk (N/s elements) in the replicate group:
  2 (r - 1)/r (N/s) g; with ``reduce_scatter_with_fp32_accumulation`` the chunk is instead
  gathered from every replica and summed in fp32 there, (r - 1) (N/s) g, the same at r = 2,
  r/2 times as much beyond,
- all-gather of the updated params in the shard group: (s - 1)/s N p.

Flat is s = every rank, r = 1. A collective sends the same bytes whatever its algorithm; which
of them cross nodes depends on the algorithm, and the model used here is the ring: ranks are
numbered node by node (as torchrun numbers them), a collective over a group runs as one ring
through the group's ranks in rank order, and each rank sends all of its bytes of that
collective to the next rank of its ring. A hop crosses nodes when the two ranks are on
different nodes, so a rank sends either all or none of a collective's bytes across nodes. Two
figures follow:

- across nodes, mean per rank: the bytes that cross nodes in all, over the ranks; the fraction
  of a ring's hops that cross nodes times what each rank sends. A flat ring over n nodes of G
  ranks has n crossing hops out of nG, so 1/G of the flat collectives' bytes cross nodes,
- across nodes, busiest rank: the most any one rank sends across nodes. A ring moves in
  lockstep, so its time is bounded by its slowest hop, and a hop between nodes carries a whole
  rank's share; flat, that is the whole reduce-scatter and all-gather over one inter-node link.

With s ranks per shard group inside a node (s divides the GPUs per node), no reduce-scatter or
all-gather byte crosses nodes and only the replicate all-reduce does: its groups take one rank
from each shard group, s/G of their hops cross nodes, and each rank's share is 1/s of a flat
all-reduce. With s larger than a node the shard groups span s/G nodes and their rings cross
nodes too. NCCL may run several rings or trees at once, spreading the inter-node bytes over
more links than one ring does; the bytes each rank sends are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import BytesPerParam


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes per parameter of the model that one rank sends in one optimizer step."""

    reduce_scatter: float
    """Grads, in the shard group."""
    replicate_all_reduce: float
    """This rank's reduced chunk of the grads, in the replicate group."""
    all_gather: float
    """Updated params, in the shard group."""
    inside_node: float
    """What stays inside a node, mean over the ranks."""
    across_nodes: float
    """What crosses nodes, mean over the ranks."""
    across_nodes_busiest: float
    """What crosses nodes from the rank that sends the most across nodes."""

    @property
    def total(self) -> float:
        return self.reduce_scatter + self.replicate_all_reduce + self.all_gather


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    """One layout of the cluster's ranks: shard groups of ``shard_size``, ``replicas`` of them."""

    shard_size: int
    replicas: int
    shard_group_nodes: int
    """The most nodes any shard group spans (1: every shard group lies inside a node)."""
    memory: dict[str, float]
    """Bytes per parameter one rank holds, by component of ``memory.BytesPerParam``."""
    memory_total: float
    traffic: Traffic


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    nodes: int
    gpus_per_node: int
    flat: LayoutPlan
    sharded: LayoutPlan

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def _ring_crossings(groups: list[list[int]], gpus_per_node: int) -> dict[int, bool]:
    """For each rank of ``groups``: does its ring hop (to the next rank of its group, in rank
    order, the last back to the first) cross nodes? Ranks of one-rank groups send nothing."""
    crossing = {}
    for group in groups:
        for i, rank in enumerate(group):
            successor = group[(i + 1) % len(group)]
            crossing[rank] = len(group) > 1 and rank // gpus_per_node != successor // gpus_per_node
    return crossing


def layout_plan(
    nodes: int,
    gpus_per_node: int,
    shard_size: int,
    breakdown: BytesPerParam,
    *,
    fp32_accumulation: bool = False,
) -> LayoutPlan:
    """Memory and traffic per rank when buckets are sharded over groups of ``shard_size``
    consecutive ranks and replicated across the groups; see [Note: cluster traffic model].
    ``breakdown`` gives the bytes of a param (``params``) and of a grad (``grads``) element."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes and gpus_per_node must be >= 1, got {nodes} and {gpus_per_node}")
    world = nodes * gpus_per_node
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"shard size {shard_size} does not divide the {world} ranks ({nodes} nodes x "
            f"{gpus_per_node}); pick a divisor, such as the GPUs of one node ({gpus_per_node})"
        )
    s, r = shard_size, world // shard_size
    grad, param = breakdown.grads, breakdown.params
    reduce_scatter = (s - 1) / s * grad
    all_gather = (s - 1) / s * param
    chunk = grad / s  # this rank's reduced chunk, per parameter of the model
    replicate = (r - 1) * chunk if fp32_accumulation else 2 * (r - 1) / r * chunk

    # The mesh (r, s): shard group i holds ranks i*s .. i*s + s - 1, replicate group j the
    # ranks j, j + s, j + 2s, ...
    shard_groups = [list(range(i * s, (i + 1) * s)) for i in range(r)]
    replicate_groups = [list(range(j, world, s)) for j in range(s)]
    shard_crosses = _ring_crossings(shard_groups, gpus_per_node)
    replicate_crosses = _ring_crossings(replicate_groups, gpus_per_node)
    across = [
        (reduce_scatter + all_gather) * shard_crosses[rank] + replicate * replicate_crosses[rank]
        for rank in range(world)
    ]
    total = reduce_scatter + replicate + all_gather
    mean_across = sum(across) / world
    return LayoutPlan(
        shard_size=s,
        replicas=r,
        shard_group_nodes=max(len({rank // gpus_per_node for rank in g}) for g in shard_groups),
        memory=breakdown.per_rank(s),
        memory_total=breakdown.total(s),
        traffic=Traffic(
            reduce_scatter=reduce_scatter,
            replicate_all_reduce=replicate,
            all_gather=all_gather,
            inside_node=total - mean_across,
            across_nodes=mean_across,
            across_nodes_busiest=max(across),
        ),
    )


def cluster_plan(
    nodes: int,
    gpus_per_node: int,
    shard_size: int,
    breakdown: BytesPerParam,
    *,
    fp32_accumulation: bool = False,
) -> ClusterPlan:
    """The layout sharded over groups of ``shard_size`` ranks beside the flat one (every rank
    one shard group), per rank and per parameter; see [Note: cluster traffic model]."""
    world = nodes * gpus_per_node
    return ClusterPlan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        flat=layout_plan(
            nodes, gpus_per_node, world, breakdown, fp32_accumulation=fp32_accumulation
        ),
        sharded=layout_plan(
            nodes, gpus_per_node, shard_size, breakdown, fp32_accumulation=fp32_accumulation
        ),
    )


__all__ = ["ClusterPlan", "LayoutPlan", "Traffic", "cluster_plan", "layout_plan"]
