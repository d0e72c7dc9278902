"""Whole-tensor optimizers (torch.optim.Muon, Adafactor) sharded by ownership, d = 1..4.

Exactness: every rank trains its slice of the batch; distopt reduces the grads and each owner
steps its matrices. A single-process torch reference in the same process is fed those very
averaged grads (gathered from the ranks' reduced shards) and clipped by the same coefficient, so
any difference can only come from how distopt shards the step: there must be none, bit for bit.
Trajectory: end to end against a reference on the full batch, within a bound measured from how
far the reference itself moves when its grads are summed in another order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt

from dist_harness import case_result, run_cases
from helpers import max_diff, muon_groups, world_params
from models import AwkwardLM, batches, rank_slice

STEPS = 20
CLIP = 0.5
MUON = {"lr": 0.02, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.01}
ADAFACTOR = {"lr": 1e-2}


class NewtonSchulzCounter:
    """Counts torch Muon's Newton-Schulz runs in this process while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = torch_muon._zeropower_via_newtonschulz

    def __enter__(self) -> NewtonSchulzCounter:
        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        torch_muon._zeropower_via_newtonschulz = counted
        return self

    def __exit__(self, *exc) -> None:
        torch_muon._zeropower_via_newtonschulz = self._original


def _reference(model: AwkwardLM, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "muon":
        muon, adamw = muon_groups(model, MUON, ADAMW)
        return [torch.optim.Muon(muon["params"], **MUON),
                torch.optim.AdamW(adamw["params"], foreach=True, **ADAMW)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [torch.optim.Adafactor(trainable, foreach=True, **ADAFACTOR)]


def _distopt(ddp: distopt.DistributedDataParallel, model: AwkwardLM, kind: str):
    if kind == "muon":
        # With the gather overlapped with the next forward: the wait hooks follow the layout.
        return distopt.DistributedOptimizer(ddp, torch.optim.Muon,
                                            params=muon_groups(model, MUON, ADAMW),
                                            clip_grad=CLIP, overlap_param_gather=True)
    return distopt.DistributedOptimizer(ddp, torch.optim.Adafactor, clip_grad=CLIP, **ADAFACTOR)


def _averaged_grads(ddp: distopt.DistributedDataParallel) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Every param's grad as distopt reduced it: each bucket's reduced shards, gathered."""
    ddp.finish_grad_sync()
    grads = {}
    for bucket in ddp.buckets:
        full = torch.empty_like(bucket.grad_data)
        dist.all_gather_into_tensor(full, bucket.grad_shard.contiguous(), group=ddp.process_group)
        for param, rng in zip(bucket.params, bucket.param_ranges, strict=True):
            grads[param] = full[rng.start : rng.end].view_as(param).clone()
    return grads


def exact(kind: str, mesh_shape: tuple[int, int] | None = None) -> dict:
    """Fed distopt's averaged grads, the reference must end every step bitwise equal. With
    ``mesh_shape`` (replicate, shard) the params are owned within each shard group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model)
    mesh = None if mesh_shape is None else init_device_mesh(
        "cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    ddp = distopt.DistributedDataParallel(model, bucket_size=60, find_unused_parameters=True,
                                          device_mesh=mesh)
    opt = _distopt(ddp, model, kind)
    sched = CosineAnnealingLR(opt, T_max=STEPS)
    ref_opts = _reference(ref, kind)
    ref_scheds = [CosineAnnealingLR(o, T_max=STEPS) for o in ref_opts]
    ref_of = dict(zip(model.parameters(), ref.parameters(), strict=True))

    unequal_steps, ns_calls, comm = [], [], []

    def compare(step: int) -> None:
        if not all(torch.equal(p, ref_of[p]) for p in model.parameters()):
            unequal_steps.append((step, max_diff(model, ref)))

    for step in range(STEPS):
        tokens, targets = batches(step)
        opt.zero_grad()
        ddp.comm_stats.reset()
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                   step).backward()
        if step > 0:  # the forward waited for the last step's gathers (overlapped for Muon)
            compare(step - 1)
        grads = _averaged_grads(ddp)
        unused = set(ddp.unused_params)
        with NewtonSchulzCounter() as counter:
            result = opt.step()
        ns_calls.append(counter.calls)
        comm.append((dict(ddp.comm_stats.calls), dict(ddp.comm_stats.bytes)))
        sched.step()

        for param, ref_param in ref_of.items():
            if ref_param.requires_grad:
                ref_param.grad = None if param in unused else grads[param]
        # The same coefficient as distopt's clip, from distopt's norm (checked below).
        coef = (CLIP / (torch.tensor([result.grad_norm]) + 1e-6)).clamp_(max=1.0).reshape(())
        ref_grads = [p.grad for p in ref.parameters() if p.grad is not None]
        ref_norm = torch.nn.utils.get_total_norm(ref_grads).item()
        torch._foreach_mul_(ref_grads, coef)
        for o in ref_opts:
            o.step()
        for s in ref_scheds:
            s.step()
        assert abs(result.grad_norm / ref_norm - 1) < 1e-6, (result.grad_norm, ref_norm)
    ddp.finish_param_sync()
    compare(STEPS - 1)

    whole = [b for b in ddp.buckets if b.layout.whole_tensor]
    owners = {ddp.param_names[p]: ddp.buffer_of[p].layout.params[i].owner
              for buf in ddp.flat_buffers for i, p in enumerate(buf.params)
              if buf.layout.params[i].owner is not None}
    return {
        "unequal_steps": unequal_steps,
        "moved": max_diff(model, start),
        "ns_calls": ns_calls,
        "comm": comm,
        "buckets": len(ddp.buckets),
        "whole_buckets": len(whole),
        "bucket_bytes": sum(b.grad_data.numel() * b.grad_data.element_size()
                            for b in ddp.buckets),
        "owners": owners,
        "used_sometimes": [s for s in range(STEPS) if s % 2 == 0],
    }


def trajectory_muon() -> dict:
    """End to end against the full-batch reference, beside the noise of the reference's own
    summation order (the same grads summed slice by slice). Rank 0 alone trains the two
    references and compares (None on the others): every rank holds the same params after a
    step's gathers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AwkwardLM()
    ref, ref_sliced = copy.deepcopy(model), copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=60, find_unused_parameters=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon,
                                       params=muon_groups(model, MUON, ADAMW))
    ref_opts, sliced_opts = _reference(ref, "muon"), _reference(ref_sliced, "muon")
    worst, noise = 0.0, 0.0
    for step in range(STEPS):
        tokens, targets = batches(step)
        opt.zero_grad()
        model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                   step).backward()
        opt.step()
        ddp.finish_param_sync()
        if rank != 0:
            continue
        for o in ref_opts + sliced_opts:
            o.zero_grad()
        ref.loss(tokens, targets, step).backward()
        # The other order: the mean of the slices' mean grads, as a data-parallel run sums.
        for k in reversed(range(world)):
            (ref_sliced.loss(rank_slice(tokens, k, world), rank_slice(targets, k, world), step)
             / world).backward()
        for o in ref_opts + sliced_opts:
            o.step()
        worst = max(worst, max_diff(model, ref))
        noise = max(noise, max_diff(ref_sliced, ref))
    return {"max_diff": worst, "noise": noise} if rank == 0 else None


def remainders_match_fp32_masters() -> dict:
    """bf16 params: Muon + AdamW with store_param_remainders against the fp32-master path,
    masters and state compared bitwise after every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for remainders in (False, True):
        torch.manual_seed(0)
        model = AwkwardLM().to(torch.bfloat16)
        ddp = distopt.DistributedDataParallel(model, bucket_size=60, find_unused_parameters=True)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon,
                                           params=muon_groups(model, MUON, ADAMW),
                                           clip_grad=CLIP, store_param_remainders=remainders)
        runs.append((model, ddp, opt))
    unequal = []
    for step in range(10):
        tokens, targets = batches(step)
        for model, ddp, opt in runs:
            opt.zero_grad()
            model.loss(rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                       step).backward()
            opt.step()
            ddp.finish_param_sync()
        (_, _, plain), (_, _, split) = runs
        masters = all(torch.equal(a, b) for a, b in
                      zip(plain.main_param_values(), split.main_param_values(), strict=True))
        states = all(
            torch.equal(plain.state[a][k], split.state[b][k])
            for a, b in zip(plain.main_params, split.main_params, strict=True)
            for k in plain.state.get(a, {})
        )
        if not (masters and states):
            unequal.append(step)
    shapes = sorted({tuple(m.shape) for m in runs[1][2].main_params if m.dim() == 2})
    return {"unequal_steps": unequal, "matrix_shapes": shapes}


def bad_vector_in_muon(default_groups: bool) -> str:
    """A 1-D param in a Muon group: every rank raises, naming it, before any collective."""
    torch.manual_seed(0)
    model = AwkwardLM()
    ddp = distopt.DistributedDataParallel(model, bucket_size=60)
    ddp.comm_stats.reset()
    params = None if default_groups else [{"params": [model.l1.weight, model.l1.bias]}]
    try:
        distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=params, lr=0.02)
    except ValueError as e:
        assert not ddp.comm_stats.calls, ddp.comm_stats.calls
        return str(e)
    return "no error"


def _cases(world: int) -> list:
    cases = [
        ("exact-muon", exact, ("muon",)),
        ("exact-adafactor", exact, ("adafactor",)),
        ("trajectory-muon", trajectory_muon, ()),
        ("remainders", remainders_match_fp32_masters, ()),
        ("bad-vector", bad_vector_in_muon, (False,)),
        ("bad-vector-default-groups", bad_vector_in_muon, (True,)),
    ]
    if world == 4:
        cases.append(("exact-muon-hierarchical", exact, ("muon", (2, 2))))
    return cases


WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases(request.param))


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_bitwise_equal_to_single_process(world, kind):
    d, results = world
    per_rank = case_result(results, f"exact-{kind}")
    for rank, r in enumerate(per_rank):
        assert r["unequal_steps"] == [], f"rank {rank}: steps that differ {r['unequal_steps']}"
        assert r["moved"] > 1e-3  # the params did train
        assert r["whole_buckets"] >= 1


def test_newton_schulz_runs_once_per_matrix(world):
    d, results = world
    per_rank = case_result(results, "exact-muon")
    for step in range(STEPS):
        # Four matrices, the fourth used only on even steps (unused ones are not stepped).
        expected = 4 if step % 2 == 0 else 3
        assert sum(r["ns_calls"][step] for r in per_rank) == expected
    # Each matrix has exactly one owner, the same on every rank; with four matrices and
    # d <= 4 ranks every rank owns at least one.
    owners = per_rank[0]["owners"]
    assert all(r["owners"] == owners for r in per_rank)
    assert len(owners) == 4 and set(owners.values()) == set(range(d))


def test_communication_is_one_reduce_scatter_and_one_gather_per_bucket(world):
    d, results = world
    for kind in ("muon", "adafactor"):
        for r in case_result(results, f"exact-{kind}"):
            for calls, sent in r["comm"]:
                if d == 1:
                    assert "reduce_scatter" not in calls or calls["reduce_scatter"] == r["buckets"]
                    continue
                assert calls["reduce_scatter"] == r["buckets"]
                assert calls["all_gather"] == r["buckets"]
                # fp32 params and grads: each collective covers its bucket, nothing more.
                assert sent["reduce_scatter"] == r["bucket_bytes"]
                assert sent["all_gather"] == r["bucket_bytes"]
                # and the small ones: the step's norm, what p.grad reads.
                assert set(calls) <= {"reduce_scatter", "all_gather", "all_reduce_small",
                                      "agree_grad_statistics"}


def test_trajectory_within_the_reference_order_noise(world):
    d, results = world
    r = case_result(results, "trajectory-muon")[0]
    if d == 1:
        assert r["max_diff"] == 0.0 and r["noise"] == 0.0
        return
    # distopt sums the ranks' grads in the collective's order, the reference in backward's:
    # each order rounds differently in the last bit, and Newton-Schulz (bf16 inside torch's
    # Muon) may carry such a bit into an update. The reference summed slice by slice is one
    # more such order and shows how far that alone moves the weights (a few fp32 ulps here).
    # Allow four times that spread: a real error in the step moves a weight by about
    # lr * update, over 1e-4, three orders of magnitude more.
    assert r["noise"] > 0.0
    assert r["max_diff"] <= 4 * r["noise"], r


@pytest.mark.parametrize("case", ["bad-vector", "bad-vector-default-groups"])
def test_vector_in_muon_group_names_the_param(world, case):
    _, results = world
    messages = case_result(results, case)
    for message in messages:
        assert "l1.bias" in message and "2-D" in message and "AdamW" in message


def test_remainders_give_the_fp32_master_path_bitwise(world):
    _, results = world
    for r in case_result(results, "remainders"):
        assert r["unequal_steps"] == []
        assert len(r["matrix_shapes"]) >= 1  # this rank's Muon masters keep the params' shapes


def test_hierarchical_mesh_owns_within_the_shard_group(world):
    d, results = world
    if d != 4:
        pytest.skip("a (replicate, shard) = (2, 2) mesh needs 4 ranks")
    per_rank = case_result(results, "exact-muon-hierarchical")
    for r in per_rank:
        assert r["unequal_steps"] == []
    # Owners are shard ranks: 0 and 1 only, the same layout on both replicas.
    assert set(per_rank[0]["owners"].values()) == {0, 1}
    assert all(r["owners"] == per_rank[0]["owners"] for r in per_rank)
    for step in range(STEPS):
        # Each replica runs Newton-Schulz once per matrix it steps: twice per matrix in all.
        expected = 4 if step % 2 == 0 else 3
        assert sum(r["ns_calls"][step] for r in per_rank) == 2 * expected
