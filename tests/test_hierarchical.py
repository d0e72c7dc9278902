"""Hierarchical data parallelism: shard over "dp_shard", replicate over "dp_replicate".

Four gloo ranks run every case in one spawned group. Each case builds a 2-D mesh
(replicate, shard): the fp32-accumulated reduction's two stages, bit for bit, and a checkpoint
saved at (2, 2), resumed by the same four ranks flat and by a group of two ranks flat and at
(1, 2). Training on a mesh against single-process torch.optim (trajectories, what each group
carried, what each rank holds) is part of the parity grid in test_parity.py. See
[Note: hierarchical data parallelism] in distopt/parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import distopt
from distopt.checkpoint import merge_state_dicts
from distopt.comm import collectives as comm
from distopt.comm import sums

from checkpoint_index import untiled_keys, written_bytes
from dist_harness import case_result, run_cases
from helpers import (
    CLIP,
    FP32_TOL,
    error_report,
    fp32_average,
    lm_loss,
    markov_loss,
    max_diff,
    owned_grad_pieces,
    parity_groups,
    state_diff,
)
from models import AwkwardLM, TinyTransformer, batches, rank_slice

# Every case runs on four ranks: the quick loop (-m "not slow") keeps to two.
pytestmark = pytest.mark.slow

WORLD = 4
FP32_ACCUMULATION_LAYOUTS = [(2, 2), (4, 1)]


def _mesh(replicate: int, shard: int):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


SAVE_AT, END = 3, 6


def _build_for_checkpoint(mesh):
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=40,
                                          device_mesh=mesh)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, params=parity_groups(model, "adamw"), clip_grad=CLIP, lr=1e-2
    )
    return model, ddp, opt


def _train(ddp, opt, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens, targets = batches(step)
        opt.zero_grad()
        lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                 step).backward()
        opt.step()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def save_hierarchical(replicate: int, shard: int, path: str) -> dict:
    """Train at (replicate, shard) to SAVE_AT, save, train on to END; write each rank's
    in-memory state dict and (rank 0) the trajectory, for the resumes to compare with."""
    model, ddp, opt = _build_for_checkpoint(_mesh(replicate, shard))
    _train(ddp, opt, range(SAVE_AT))
    saved = distopt.save_checkpoint(path, ddp, opt)
    # The same state saved in the background: its parts are the synchronous save's.
    saved_async = distopt.save_checkpoint(f"{path}-async", ddp, opt, async_save=True).wait(120)
    torch.save(opt.sharded_state_dict(), f"{path}-sd-{dist.get_rank()}.pt")
    ref = {"saved": _params(model)}
    _train(ddp, opt, range(SAVE_AT, END))
    ref["final"] = _params(model)
    if dist.get_rank() == 0:
        torch.save(ref, f"{path}-ref.pt")
    return {"moved": max_diff(model, AwkwardLM()), "rank": dist.get_rank(),
            "shard_rank": ddp.parallel.dp_rank, "owned": sum(m.numel() for m in opt.main_params),
            "written": written_bytes(saved), "untiled": untiled_keys(saved),
            "written_async": written_bytes(saved_async), "untiled_async": untiled_keys(saved_async),
            "trainable_tensors": sum(1 for p in model.parameters() if p.requires_grad)}


def resume(path: str, layout: tuple[int, int] | None, saved_world: int) -> dict:
    """Load the checkpoint at ``layout`` (a (replicate, shard) mesh, or None: flat over every
    rank) and train to END on the same global batches: the params and the optimizer state at
    the load are exactly the saved ones, and the end is the uninterrupted run's."""
    model, ddp, opt = _build_for_checkpoint(None if layout is None else _mesh(*layout))
    distopt.load_checkpoint(path, ddp, opt)
    ref = torch.load(f"{path}-ref.pt")
    at_load = max(
        (p.detach() - ref["saved"][k]).abs().max().item() for k, p in model.named_parameters()
    )
    saved = merge_state_dicts(
        [torch.load(f"{path}-sd-{r}.pt", weights_only=False) for r in range(saved_world)]
    )
    worst_state = state_diff(opt, saved)
    _train(ddp, opt, range(SAVE_AT, END))
    final = max(
        (p.detach() - ref["final"][k]).abs().max().item() for k, p in model.named_parameters()
    )
    return {"at_load": at_load, "state_diff": worst_state, "final": final,
            "dp_size": ddp.dp_size, "replicas": ddp.parallel.replicate_size,
            "owned": sum(m.numel() for m in opt.main_params)}


def fp32_accumulated_reduction(replicate: int, shard: int) -> dict:
    """bf16 grads with reduce_scatter_with_fp32_accumulation on a mesh: each stage sums in
    fp32 and rounds once, so every owned piece is the fp32 average over the replicas of the
    shard groups' rounded fp32 averages, bit for bit; see
    [Note: fp32-accumulated reduce-scatter]. Every rank's bf16 grads are recomputed here on a
    reference copy, so the exact average is known."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    per_rank = []
    for r in range(world):
        ref.zero_grad()
        markov_loss(ref, 0, r, world).backward()
        per_rank.append([p.grad.clone() for p in ref.parameters()])
    ddp = distopt.DistributedDataParallel(
        model, grad_dtype=torch.bfloat16, bucket_size=5000, device_mesh=_mesh(replicate, shard),
        reduce_scatter_with_fp32_accumulation=True,
    )
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.0)
    opt.zero_grad()
    ddp.comm_stats.reset()
    markov_loss(ddp, 0, rank, world).backward()
    ddp.finish_grad_sync()
    index = {p: i for i, p in enumerate(model.parameters())}
    two_stage, single, pieces, worst = True, True, 0, -1.0
    for param, piece in owned_grad_pieces(ddp):
        rows = [grads[index[param]].reshape(-1)[piece] for grads in per_rank]
        groups = [fp32_average(rows[k * shard : (k + 1) * shard], torch.bfloat16)
                  for k in range(replicate)]
        got = param.main_grad.reshape(-1)[piece]
        two_stage &= torch.equal(got, fp32_average(groups, torch.bfloat16))
        single &= torch.equal(got, fp32_average(rows, torch.bfloat16))
        worst = max(worst, error_report(got, rows)["over_half_ulp"])
        pieces += 1
    # The collective alone: the replicas' copies summed in fp32 in replica order, rounded once;
    # the all-gather version (NCCL's) gives the same bits on gloo too.
    group = ddp.parallel.replicate_group
    copies = [torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
              for r in dist.get_process_group_ranks(group)]
    mine = copies[dist.get_rank(group)]
    p2p, gathered = mine.clone(), mine.clone()
    comm.all_reduce_avg_fp32_accum(p2p, group, async_op=True).wait()
    sums.all_gather_all_reduce_fp32(gathered, group, async_op=False)
    return {"two_stage": two_stage, "single_rounding": single, "over_half_ulp": worst,
            "pieces": pieces, "buckets": len(ddp.buckets), "calls": dict(ddp.comm_stats.calls),
            "bytes": dict(ddp.comm_stats.bytes),
            "owned_padded": sum(b.owned_grad.numel() for b in ddp.buckets),
            "collective": torch.equal(p2p, fp32_average(copies, torch.bfloat16)),
            "gathered_same": torch.equal(gathered, p2p)}


def bad_meshes() -> dict:
    out = {}
    meshes = {
        "unknown-name": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("nodes", "gpus")),
        "dp-and-dp-shard": lambda: init_device_mesh(
            "cpu", (1, 2, 2), mesh_dim_names=("dp", "dp_replicate", "dp_shard")),
    }
    for name, make in meshes.items():
        try:
            distopt.DistributedDataParallel(AwkwardLM(), device_mesh=make())
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def nan_check_names_the_rank() -> str:
    """A nan in the own grads of the last rank (replica 1, shard 1) is named, with that rank,
    on every rank of both replicas."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, find_unused_parameters=True, bucket_size=40,
                                          overlap_grad_reduce=False,
                                          check_for_nan_in_grad=True, device_mesh=_mesh(2, 2))
    tokens, targets = (rank_slice(t, rank, world) for t in batches(0))
    lm_loss(ddp, tokens, targets, 0).backward()
    if rank == world - 1:
        model.l2.weight.main_grad[0, 0] = float("nan")  # before the reduction: launched later
    try:
        ddp.finish_grad_sync()
    except FloatingPointError as error:
        return str(error)
    return "no error"


def _cases(tmp: str) -> list:
    cases = [("nan-check-2x2", nan_check_names_the_rank, ())]
    for r, s in FP32_ACCUMULATION_LAYOUTS:
        cases.append((f"fp32acc-reduction-{r}x{s}", fp32_accumulated_reduction, (r, s)))
    cases.append(("save-2x2", save_hierarchical, (2, 2, f"{tmp}/ckpt-2x2")))
    cases.append(("resume-flat4", resume, (f"{tmp}/ckpt-2x2", None, WORLD)))
    cases.append(("bad-meshes", bad_meshes, ()))
    return cases


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hier"))


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_cases(WORLD, _cases(checkpoints))


@pytest.fixture(scope="module")
def resumed_on_two(results, checkpoints):
    """The checkpoint saved at (2, 2) on four ranks, resumed by two: flat, and on a (1, 2) mesh."""
    case_result(results, "save-2x2")
    path = f"{checkpoints}/ckpt-2x2"
    return run_cases(2, [("resume-flat2", resume, (path, None, WORLD)),
                         ("resume-1x2", resume, (path, (1, 2), WORLD))])


@pytest.mark.parametrize("layout", FP32_ACCUMULATION_LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_fp32_accumulation_sums_both_stages_in_fp32(results, layout):
    r, s = layout
    for v in case_result(results, f"fp32acc-reduction-{r}x{s}"):
        assert v["pieces"] > 0 and v["buckets"] >= 3
        # Each stage's fp32 sum, rounded once: the same bits on every rank.
        assert v["two_stage"], v
        if s == 1:
            # Nothing to round in the shard group: one rounding in all, as flat.
            assert v["single_rounding"] and v["over_half_ulp"] <= 0, v
        # Overlapped as the plain path: both stages of every bucket start during backward
        # (counted once each); the replicate stage carries the owned chunk.
        assert v["calls"].get("reduce_scatter", 0) == (v["buckets"] if s > 1 else 0)
        assert v["calls"]["replicate_all_reduce"] == v["buckets"]
        assert v["bytes"]["replicate_all_reduce"] == 2 * v["owned_padded"]
        assert v["collective"] and v["gathered_same"]


def test_checkpoint_saved_hierarchical_resumes_flat(results):
    for v in case_result(results, "save-2x2"):
        assert v["moved"] > 0.05
    for v in case_result(results, "resume-flat4"):
        assert (v["dp_size"], v["replicas"]) == (4, 1)
        assert v["at_load"] == 0.0 and v["state_diff"] == 0.0, v
        # Another summation order of the same average (two stages against one): round-off,
        # which AdamW carries (helpers.FP32_TOL).
        assert v["final"] <= FP32_TOL, v


def test_each_replica_writes_only_its_half_of_its_shard(results):
    """At (2, 2) the two replicas of a shard hold the same pieces: each writes half of their
    optimizer state, so no byte is written twice; the model's entries (in torch's layout the
    fp32 masters of the trainable params, and the rest of the state dict) are dealt out over
    the ranks; an async save writes each rank the same bytes."""
    values = case_result(results, "save-2x2")
    written = values[0]["written"]
    assert set(written) == {0, 1, 2, 3}  # every rank wrote a file
    assert values[0]["untiled"] == []  # every key's chunks cover it exactly once
    assert values[0]["written_async"] == written and values[0]["untiled_async"] == []
    trainable = sum(p.numel() for p in AwkwardLM().parameters() if p.requires_grad)
    tensors = values[0]["trainable_tensors"]
    # Together the ranks write the state once: AdamW's two fp32 moments per element and one
    # fp32 step per trainable tensor.
    assert sum(w["optimizer"] for w in written.values()) == 8 * trainable + 4 * tensors
    pieces = len(AwkwardLM().state_dict())
    for v in values:
        # Half of the moments of the shard the rank's replicas own, to a piece's split (an
        # element's 8 bytes per piece) and the steps.
        half = 8 * v["owned"] / 2
        assert abs(written[v["rank"]]["optimizer"] - half) <= 8 * pieces + 4 * tensors, v
        mates = [w for w in values if w["shard_rank"] == v["shard_rank"]]
        assert sum(written[w["rank"]]["optimizer"] for w in mates) >= 8 * v["owned"]
    model_bytes = sum(t.numel() * t.element_size() for t in AwkwardLM().state_dict().values())
    assert sum(w.get("model", 0) for w in written.values()) == model_bytes
    assert sum(1 for w in written.values() if w.get("model")) >= 3  # dealt out, not on one rank


@pytest.mark.parametrize("name", ["resume-flat2", "resume-1x2"])
def test_checkpoint_saved_hierarchical_resumes_on_two_ranks(resumed_on_two, name):
    values = case_result(resumed_on_two, name)
    for v in values:
        assert (v["replicas"], v["dp_size"]) == (1, 2)
        assert v["at_load"] == 0.0 and v["state_diff"] == 0.0, v
        assert v["final"] <= FP32_TOL, v  # test_checkpoint.py's bound at another DP size
    # The two ranks together own every element once, as each replica did at (2, 2).
    assert sum(v["owned"] for v in values) == sum(
        p.numel() for p in AwkwardLM().parameters() if p.requires_grad)


def test_bad_meshes_name_the_fix(results):
    for v in case_result(results, "bad-meshes"):
        assert "name it 'dp'" in v["unknown-name"] and "dp_replicate" in v["unknown-name"]
        assert "either 'dp'" in v["dp-and-dp-shard"]


def test_nan_check_names_the_rank_across_replicas(results):
    for message in case_result(results, "nan-check-2x2"):
        assert f"parameter 'l2.weight' produced on rank {WORLD - 1} " in message, message
