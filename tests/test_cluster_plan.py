"""The cluster plan: memory per rank and bytes sent per step, inside a node and across nodes.

Every expected number is worked out by hand in the comments from the ring model of
[Note: cluster traffic model] (src/distopt/plan/cluster.py): ranks numbered node by node, each
collective a ring through its group's ranks in rank order, each rank sending all of its share
of a collective to the next rank of its ring.
"""

from __future__ import annotations

import pytest
import torch

import distopt
from distopt.memory import bytes_per_param_breakdown
from distopt.plan.cluster import cluster_plan, layout_plan

FP32 = bytes_per_param_breakdown(torch.float32, torch.float32)  # params 4, grads 4, Adam 8
BF16_FP32 = bytes_per_param_breakdown(torch.bfloat16, torch.float32)  # params 2, grads 4


def _traffic(plan) -> dict[str, float]:
    t = plan.traffic
    return {
        "rs": t.reduce_scatter,
        "rep": t.replicate_all_reduce,
        "ag": t.all_gather,
        "inside": t.inside_node,
        "across": t.across_nodes,
        "busiest": t.across_nodes_busiest,
    }


def test_two_nodes_of_two_shard_inside_each_node():
    plan = cluster_plan(2, 2, 2, FP32)
    # Sharded (2 x 2): reduce-scatter 1/2 * 4 B, all-gather 1/2 * 4 B, both inside a node; the
    # replicate all-reduce of the 1/2-size chunk sends 2 * (1/2) * 4/2 = 2 B, and its ring
    # {0, 2} (and {1, 3}) has both hops between the nodes.
    assert _traffic(plan.sharded) == pytest.approx(
        {"rs": 2, "rep": 2, "ag": 2, "inside": 4, "across": 2, "busiest": 2}
    )
    # Flat over 4: 3/4 * 4 B each way. The ring 0-1-2-3-0 crosses nodes at 1->2 and 3->0: half
    # of the 6 B a rank sends crosses on average, all 6 B from ranks 1 and 3.
    assert _traffic(plan.flat) == pytest.approx(
        {"rs": 3, "rep": 0, "ag": 3, "inside": 3, "across": 3, "busiest": 6}
    )
    # Memory: 8 B of params and grads, Adam's 8 B sharded over 4 (flat) or 2.
    assert plan.flat.memory_total == 8 + 8 / 4 and plan.sharded.memory_total == 8 + 8 / 2
    assert plan.sharded.memory == {
        "params": 4,
        "grads": 4,
        "main_params": 0,
        "main_grads": 0,
        "optimizer_state": 4,
    }
    assert (plan.sharded.shard_size, plan.sharded.replicas, plan.sharded.shard_group_nodes) == (
        2,
        2,
        1,
    )
    assert (plan.flat.shard_size, plan.flat.replicas, plan.flat.shard_group_nodes) == (4, 1, 2)


def test_shard_groups_smaller_than_a_node():
    # 2 nodes x 4, shard 2: 4 replicas. bf16 params (2 B), fp32 grads (4 B).
    plan = layout_plan(2, 4, 2, BF16_FP32)
    # reduce-scatter 1/2 * 4, all-gather 1/2 * 2, replicate 2 * (3/4) * 4/2 = 3. The replicate
    # ring {0, 2, 4, 6} sits on nodes 0, 0, 1, 1: hops 2->4 and 6->0 cross, so ranks 2, 6 (and
    # 3, 7) send their 3 B across and the others none; mean 4 * 3 / 8 = 1.5.
    assert _traffic(plan) == pytest.approx(
        {"rs": 2, "rep": 3, "ag": 1, "inside": 6 - 1.5, "across": 1.5, "busiest": 3}
    )
    # Gathering the r chunks for an fp32 sum: (r - 1) * 4/2 = 6 B, r/2 = 2 times the all-reduce.
    gathered = layout_plan(2, 4, 2, BF16_FP32, fp32_accumulation=True)
    assert _traffic(gathered) == pytest.approx(
        {"rs": 2, "rep": 6, "ag": 1, "inside": 9 - 3, "across": 3, "busiest": 6}
    )


def test_shard_groups_spanning_nodes():
    # 4 nodes x 2, shard 4: each shard group spans 2 nodes. fp32: 4 B params and grads.
    plan = cluster_plan(4, 2, 4, FP32)
    # reduce-scatter and all-gather 3/4 * 4 = 3 B each; replicate 2 * (1/2) * 4/4 = 1 B.
    # Shard ring 0-1-2-3-0 on nodes 0, 0, 1, 1: ranks 1 and 3 send their 6 B across; the
    # replicate rings {0, 4}, ... always cross. Per rank across: 7, 1, 7, 1 -> mean 4.
    assert _traffic(plan.sharded) == pytest.approx(
        {"rs": 3, "rep": 1, "ag": 3, "inside": 3, "across": 4, "busiest": 7}
    )
    assert plan.sharded.shard_group_nodes == 2
    # Flat over 8 ranks on 4 nodes: 4 of the ring's 8 hops cross; 7/8 * 4 B each way.
    assert _traffic(plan.flat) == pytest.approx(
        {"rs": 3.5, "rep": 0, "ag": 3.5, "inside": 3.5, "across": 3.5, "busiest": 7}
    )


def test_one_node_sends_nothing_across():
    plan = cluster_plan(1, 8, 4, FP32)
    for layout in (plan.flat, plan.sharded):
        t = layout.traffic
        assert t.across_nodes == t.across_nodes_busiest == 0
        assert t.inside_node == pytest.approx(t.total)
    assert plan.flat.traffic.total == pytest.approx(2 * 7 / 8 * 4)


def test_shard_size_one_only_all_reduces():
    # Every rank its own shard group: plain DDP's all-reduce, 2 (r - 1)/r of the grads.
    plan = layout_plan(2, 2, 1, FP32)
    assert _traffic(plan) == pytest.approx(
        {"rs": 0, "rep": 2 * 3 / 4 * 4, "ag": 0, "inside": 3, "across": 3, "busiest": 6}
    )
    assert plan.memory_total == 16.0  # the replicated table's figure: nothing is sharded


@pytest.mark.parametrize("nodes,gpus,shard", [(2, 8, 8), (4, 8, 8), (4, 8, 16), (3, 4, 2)])
def test_the_figures_of_the_design(nodes, gpus, shard):
    """Memory is the table at d = s; the replicate group carries 1/s of an all-reduce over the
    replicas; with the shard groups inside nodes, only the replicate stage crosses nodes."""
    breakdown = bytes_per_param_breakdown(torch.bfloat16, torch.bfloat16)
    plan = cluster_plan(nodes, gpus, shard, breakdown)
    world, r = nodes * gpus, nodes * gpus // shard
    assert plan.sharded.memory_total == distopt.theoretical_bytes_per_param(
        torch.bfloat16, torch.bfloat16, shard
    )
    assert plan.flat.memory_total == distopt.theoretical_bytes_per_param(
        torch.bfloat16, torch.bfloat16, world
    )
    t = plan.sharded.traffic
    assert t.replicate_all_reduce * shard == pytest.approx(2 * (r - 1) / r * 2)
    assert t.inside_node + t.across_nodes == pytest.approx(t.total)
    if shard <= gpus:
        assert t.across_nodes_busiest == pytest.approx(t.replicate_all_reduce)
        # The replicate ring has one crossing hop per node among its r ranks: s/G of them.
        assert t.across_nodes == pytest.approx(t.replicate_all_reduce * shard / gpus)
    # Flat: a ring over n nodes crosses n of its n G hops.
    flat = plan.flat.traffic
    assert flat.across_nodes == pytest.approx(flat.total / gpus)
    assert flat.across_nodes_busiest == pytest.approx(flat.total)


@pytest.mark.parametrize(
    "nodes,gpus,shard,message",
    [
        (2, 8, 3, "shard size 3 does not divide the 16 ranks"),
        (2, 8, 0, "shard size 0 does not divide"),
        (0, 8, 8, "nodes and gpus_per_node must be >= 1"),
    ],
)
def test_bad_layouts_name_the_fix(nodes, gpus, shard, message):
    with pytest.raises(ValueError, match=message):
        layout_plan(nodes, gpus, shard, FP32)
