"""Module buffers as torch DDP keeps them: ``DistributedDataParallel(broadcast_buffers=...)``,
SyncBatchNorm over the data-parallel group, and buffers in checkpoints.

A BatchNorm MLP and a small CNN train for 10 steps at d = 2 and 3 under distopt and, in the same
processes on the same slices of the same global batches, under
``torch.nn.parallel.DistributedDataParallel`` (gloo): one micro-batch per step, two (the first
under ``no_sync()``), and ``broadcast_buffers=False``; at d = 2 also with sharded grads and on a
(2, 1) hierarchical mesh. Params and buffers stay within FP32_TOL of torch DDP's on every rank after
every step; what each forward reads at its start is the same on every rank wherever torch DDP
broadcasts, and apart where it does not; one broadcast per buffer dtype per such forward.
Tensor-parallel ranks keep their own buffers.

torch's SyncBatchNorm refuses CPU tensors in training (and torch DDP refuses it on the CPU), so
the SyncBatchNorm cases swap in ``CpuSyncBatchNorm``: torch's layer with its batch statistics
computed by differentiable all-reduces over the group the layer finds, as torch's forward finds
it (its ``process_group``, else the default group). Their reference is plain torch BatchNorm in
one process on the whole global batch, which SyncBatchNorm equals by definition: distopt's DDP
must give the layers its data-parallel group (a subgroup of 2 of 3 ranks tells it from the
default group). Checkpoints: saved and resumed at d = 2 the run ends bitwise where it would
have, buffers included, and the buffers loaded are rank 0's; with SyncBatchNorm saved at d = 2
and resumed at d = 3, within FP32_TOL. See [Note: buffer broadcasting] in
src/distopt/ddp/module_buffers.py.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import distopt
from distopt.ddp.module_buffers import sync_batchnorm_group
from distopt.parallel.process_groups import ParallelGroups

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, world_params
from models import rank_slice

# The workers import this module too: torch 2.13 calls the differentiable all-reduce of
# CpuSyncBatchNorm deprecated in favour of a private module.
warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)

STEPS = 10
GLOBAL_BATCH = 12  # samples per micro-batch over all ranks: divides by 2 and by 3
SAVE_AT = 5
BROADCAST_OPS = ("broadcast_buffers", "replicate_broadcast_buffers")


# The layers before a BatchNorm have no bias, as usual: BatchNorm removes it, so its true grad
# is zero and AdamW would turn the roundoff it is made of into full-size steps.
def bn_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(),
                         nn.Linear(16, 3))


def small_cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, stride=2, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


MODELS = {"mlp": (bn_mlp, (6,)), "cnn": (small_cnn, (2, 6, 6))}


def micro_batch(kind: str, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global inputs and targets of a micro-batch: the same on every rank at any d."""
    g = torch.Generator().manual_seed(7000 + 10 * step + micro)
    x = 2.0 * torch.randn((GLOBAL_BATCH, *MODELS[kind][1]), generator=g) + 0.5
    return x, torch.randn((GLOBAL_BATCH, 3), generator=g)


def flat_buffers(module: nn.Module) -> torch.Tensor:
    return torch.cat([b.detach().double().reshape(-1) for b in module.buffers()])


def state_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest difference over every param and buffer of two models."""
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)


def record_forwards(module: nn.Module) -> list[torch.Tensor]:
    """The buffers ``module`` holds as each of its forwards starts (after the DDP's
    broadcast), appended to the list returned."""
    seen: list[torch.Tensor] = []
    module.register_forward_pre_hook(lambda m, args: seen.append(flat_buffers(m)))
    return seen


# ---------------------------------------------------------------------- against torch DDP


@dataclass(frozen=True)
class Run:
    model: str = "mlp"
    micro: int = 1  # micro-batches per step, all but the last under no_sync()
    broadcast: bool = True
    shard_grads: bool = False
    mesh: tuple[int, int] | None = None  # (replicate, shard)


def against_torch_ddp(run: Run) -> dict:
    """Train ``run`` under distopt and under torch DDP side by side, then evaluate both on one
    batch; what each held after every step and at the start of every forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MODELS[run.model][0]()
    ref = copy.deepcopy(model)
    mesh = None if run.mesh is None else init_device_mesh(
        "cpu", run.mesh, mesh_dim_names=("dp_replicate", "dp_shard"))
    ddp = distopt.DistributedDataParallel(model, bucket_size=64, device_mesh=mesh,
                                          shard_grads=run.shard_grads,
                                          broadcast_buffers=run.broadcast)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    with warnings.catch_warnings():  # torch 2.13 calls it deprecated; it is what this tests
        warnings.simplefilter("ignore", FutureWarning)
        ref_ddp = nn.parallel.DistributedDataParallel(ref, broadcast_buffers=run.broadcast)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    seen = {"distopt": record_forwards(model), "torch": record_forwards(ref)}
    worst, after, calls, sent = 0.0, [], [], []
    for step in range(STEPS):
        for wrapper, optimizer in ((ddp, opt), (ref_ddp, ref_opt)):
            optimizer.zero_grad()
            for i in range(run.micro):
                x, y = (rank_slice(t, rank, world) for t in micro_batch(run.model, step, i))
                ddp.comm_stats.reset()
                with contextlib.nullcontext() if i == run.micro - 1 else wrapper.no_sync():
                    out = wrapper(x)
                    if wrapper is ddp:
                        calls.append(dict(ddp.comm_stats.calls))
                        sent.append(dict(ddp.comm_stats.bytes))
                    (F.mse_loss(out, y) / run.micro).backward()
            optimizer.step()
        ddp.finish_param_sync()
        worst = max(worst, state_diff(model, ref))
        after.append({"distopt": flat_buffers(model), "torch": flat_buffers(ref)})
    ddp.comm_stats.reset()
    model.eval()
    ref.eval()
    with torch.no_grad():
        x, _ = micro_batch(run.model, STEPS)
        evaluated = {"distopt": ddp(x), "torch": ref_ddp(x)}
    return {"max_diff": worst, "after": after, "seen": seen, "calls": calls, "bytes": sent,
            "eval_calls": dict(ddp.comm_stats.calls), "eval": evaluated,
            "buffer_dtypes": len({b.dtype for b in model.buffers()}),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers())}


def tensor_parallel_keeps_its_own() -> dict:
    """(dp 1, tp 2): BatchNorm before a column- and a row-parallel layer, its running mean
    set to the rank on each TP rank: no broadcast crosses the TP ranks."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    with torch.no_grad():
        model[0].running_mean.fill_(float(rank))
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    means = []
    model[0].register_forward_pre_hook(lambda m, a: means.append(m.running_mean.clone()))
    for step in range(2):
        x, y = micro_batch("mlp", step)  # the same batch on both TP ranks
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return {"means": means, "calls": dict(ddp.comm_stats.calls)}


# ---------------------------------------------------------------------- SyncBatchNorm


class CpuSyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm with its training arithmetic done on the CPU, which torch's own
    forward refuses: batch statistics over ``process_group``, or the default group when that
    is None (as torch's forward picks the group), by differentiable all-reduces of the sums;
    the running statistics updated as torch's (unbiased variance over the whole count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)  # running statistics, no communication
        group = self.process_group or dist.group.WORLD
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([float(x.numel() // x.shape[1])])
        dist.all_reduce(count, group=group)
        n = count.item()
        mean = dist_fn.all_reduce(x.sum(dims), group=group) / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centered = x - mean.view(shape)
        var = dist_fn.all_reduce((centered * centered).sum(dims), group=group) / n
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        normalized = centered / torch.sqrt(var.view(shape) + self.eps)
        return normalized * self.weight.view(shape) + self.bias.view(shape)


def with_sync_batchnorm(model: nn.Module) -> nn.Module:
    """``model`` through ``nn.SyncBatchNorm.convert_sync_batchnorm``, the CPU forward swapped in."""
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for layer in converted.modules():
        if type(layer) is nn.SyncBatchNorm:
            layer.__class__ = CpuSyncBatchNorm
    return converted


def _one_process_reference(kind: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """Plain BatchNorm in one process on each whole global batch: its state after each step."""
    torch.manual_seed(0)
    model = MODELS[kind][0]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states = []
    for step in range(steps):
        x, y = micro_batch(kind, step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _diff(model: nn.Module, state: dict[str, torch.Tensor]) -> float:
    return max((v.double() - state[k].double()).abs().max().item()
               for k, v in model.state_dict().items())


def _data_parallel_group() -> tuple[dist.ProcessGroup | None, int, int]:
    """At d = 3: ranks 0 and 1 in one group and rank 2 alone; else the default group. The
    group, this rank's place in it and its size."""
    if dist.get_world_size() != 3:
        return None, dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # every rank creates both
    group = groups[0] if dist.get_rank() < 2 else groups[1]
    return group, dist.get_rank(group), dist.get_world_size(group)


def _sync_bn_ddp(kind: str, group: dist.ProcessGroup | None):
    torch.manual_seed(0)
    model = with_sync_batchnorm(MODELS[kind][0]())
    ddp = distopt.DistributedDataParallel(model, process_group=group, bucket_size=64)
    return model, ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)


def _sync_bn_steps(kind: str, model, ddp, opt, steps: range, group_rank: int, group_size: int,
                   reference: list[dict[str, torch.Tensor]]) -> tuple[float, list[torch.Tensor]]:
    worst, after = 0.0, []
    for step in steps:
        x, y = (rank_slice(t, group_rank, group_size) for t in micro_batch(kind, step))
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        ddp.finish_param_sync()
        worst = max(worst, _diff(model, reference[step]))
        after.append(flat_buffers(model))
    return worst, after


def sync_batchnorm(kind: str, path: str | None) -> dict:
    """SyncBatchNorm under distopt against plain BatchNorm in one process on the global batch;
    at d = 3 over a group of ranks 0 and 1 (rank 2 trains alone on the whole batch). With
    ``path``, a checkpoint saved at SAVE_AT and the final state written for a resume."""
    group, group_rank, group_size = _data_parallel_group()
    model, ddp, opt = _sync_bn_ddp(kind, group)
    layers = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    found = all(m.process_group is ddp.process_group for m in layers) and len(layers) == 2
    reference = _one_process_reference(kind, STEPS)
    worst, after = _sync_bn_steps(kind, model, ddp, opt, range(SAVE_AT), group_rank,
                                  group_size, reference)
    if path is not None:
        distopt.save_checkpoint(path, ddp, opt)
    more, later = _sync_bn_steps(kind, model, ddp, opt, range(SAVE_AT, STEPS), group_rank,
                                 group_size, reference)
    if path is not None and dist.get_rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{path}-final.pt")
    return {"found_group": found, "max_diff": max(worst, more), "after": after + later,
            "group_size": group_size}


def sync_batchnorm_resumed(kind: str, path: str) -> dict:
    """The SyncBatchNorm checkpoint resumed here (d = 3), trained to STEPS."""
    model, ddp, opt = _sync_bn_ddp(kind, None)
    distopt.load_checkpoint(path, ddp, opt)
    reference = _one_process_reference(kind, STEPS)
    worst, after = _sync_bn_steps(kind, model, ddp, opt, range(SAVE_AT, STEPS), dist.get_rank(),
                                  dist.get_world_size(), reference)
    return {"max_diff": worst, "after": after,
            "from_saved_run": _diff(model, torch.load(f"{path}-final.pt"))}


def sync_batchnorm_groups() -> dict:
    """Which group the layers get: a chosen one is kept; on a (d, 1) hierarchical mesh the
    default group; and the error where no one group spans the DP ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chosen = dist.new_group(list(range(world)))
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model[1].process_group = chosen
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    distopt.DistributedDataParallel(model, device_mesh=mesh)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates each
    partial = ParallelGroups.of(singles[rank], None, replicate_group=singles[rank])
    try:
        sync_batchnorm_group(partial)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"kept": model[1].process_group is chosen,
            "hierarchical": model[3].process_group is dist.group.WORLD, "error": error}


# ---------------------------------------------------------------------- checkpoints


def _bn_run(**ddp_options):
    torch.manual_seed(0)
    model = bn_mlp()
    ddp = distopt.DistributedDataParallel(model, bucket_size=64, **ddp_options)
    return model, ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)


def _train(ddp, opt, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = (rank_slice(t, rank, world) for t in micro_batch("mlp", step))
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_saved(path: str, shard_grads: bool) -> dict:
    """Train to SAVE_AT, save, train on to STEPS; each rank writes its buffers at the save
    and its final state, for the resume to compare with."""
    model, ddp, opt = _bn_run(shard_grads=shard_grads)
    _train(ddp, opt, range(SAVE_AT))
    distopt.save_checkpoint(path, ddp, opt)
    at_save = flat_buffers(model)
    _train(ddp, opt, range(SAVE_AT, STEPS))
    torch.save({"at_save": at_save, "final": _state(model)},
               f"{path}-rank{dist.get_rank()}.pt")
    return {"at_save": at_save}


def checkpoint_resumed(path: str, shard_grads: bool) -> dict:
    """Load, compare the loaded buffers with rank 0's at the save, train to STEPS."""
    model, ddp, opt = _bn_run(shard_grads=shard_grads)
    distopt.load_checkpoint(path, ddp, opt)
    loaded = flat_buffers(model)
    _train(ddp, opt, range(SAVE_AT, STEPS))
    ddp.finish_param_sync()
    mine = torch.load(f"{path}-rank{dist.get_rank()}.pt")
    first = torch.load(f"{path}-rank0.pt")
    final = mine["final"]
    return {"loaded_rank0s": torch.equal(loaded, first["at_save"]),
            "rank0_differed": not torch.equal(mine["at_save"], first["at_save"]),
            "bitwise": all(torch.equal(v, final[k]) for k, v in model.state_dict().items())}


# ---------------------------------------------------------------------- the grid

TORCH_RUNS = {
    "mlp": Run(), "cnn": Run(model="cnn"),
    "mlp-no-sync": Run(micro=2), "cnn-no-sync": Run(model="cnn", micro=2),
    "mlp-off": Run(broadcast=False), "cnn-off": Run(model="cnn", broadcast=False),
}
TWO_ONLY = {
    "mlp-no-sync-shard-grads": Run(micro=2, shard_grads=True),
    "mlp-mesh-2x1": Run(micro=2, mesh=(2, 1)),
}
RUNS = {**TORCH_RUNS, **TWO_ONLY}


def _cases(world: int, tmp: str) -> list:
    runs = {**TORCH_RUNS, **(TWO_ONLY if world == 2 else {})}
    cases = [(name, against_torch_ddp, (run,)) for name, run in runs.items()]
    cases += [("sync-bn-mlp", sync_batchnorm, ("mlp", None)),
              ("sync-bn-groups", sync_batchnorm_groups, ())]
    if world == 2:
        cases += [("sync-bn-cnn-save", sync_batchnorm, ("cnn", f"{tmp}/sync-bn")),
                  ("tensor-parallel", tensor_parallel_keeps_its_own, ())]
        for sharded in (False, True):
            path = f"{tmp}/bn-{sharded}"
            cases += [(f"save-{sharded}", checkpoint_saved, (path, sharded)),
                      (f"resume-{sharded}", checkpoint_resumed, (path, sharded))]
    else:
        cases += [("sync-bn-cnn-resumed", sync_batchnorm_resumed, ("cnn", f"{tmp}/sync-bn"))]
    return cases


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("buffers")


@pytest.fixture(scope="module")
def two(tmp):
    return run_cases(2, _cases(2, str(tmp)))


@pytest.fixture(scope="module")
def three(tmp, two):
    case_result(two, "sync-bn-cnn-save")  # the checkpoint it resumes
    return run_cases(3, _cases(3, str(tmp)))


@pytest.fixture(params=world_params([2, 3]))
def world(request):
    d = request.param
    return d, request.getfixturevalue("two" if d == 2 else "three")


def _spread(tensors: list[torch.Tensor]) -> float:
    """How far apart the ranks' copies of one tensor are."""
    return max((t - tensors[0]).abs().max().item() for t in tensors)


def _runs_at(d: int) -> list[str]:
    return list(TORCH_RUNS) + (list(TWO_ONLY) if d == 2 else [])


def test_params_and_buffers_match_torch_ddp(world):
    d, results = world
    for name in _runs_at(d):
        for v in case_result(results, name):
            assert v["max_diff"] <= FP32_TOL, (name, v["max_diff"])
            for after in v["after"]:
                assert (after["distopt"] - after["torch"]).abs().max() <= FP32_TOL, name


def test_each_forward_reads_the_first_ranks_buffers_where_torch_ddp_broadcasts(world):
    """With one micro-batch every forward starts from rank 0's buffers; with two, the first
    micro-batch's does and the one after a no_sync() forward does not, as with torch DDP."""
    d, results = world
    for name in _runs_at(d):
        run = RUNS[name]
        values = case_result(results, name)
        if not run.broadcast:
            continue
        for wrapper in ("distopt", "torch"):
            seen = [v["seen"][wrapper] for v in values]
            for forward in range(STEPS * run.micro):
                spread = _spread([s[forward] for s in seen])
                if forward % run.micro == 0:
                    assert spread == 0.0, (name, wrapper, forward, spread)
                else:  # torch DDP does not broadcast here: each rank's own update shows
                    assert spread > 1e-3, (name, wrapper, forward, spread)
        # distopt's forwards start where torch DDP's do, rank for rank.
        for v in values:
            for a, b in zip(v["seen"]["distopt"], v["seen"]["torch"], strict=True):
                assert (a - b).abs().max() <= FP32_TOL, name


def test_without_broadcast_the_ranks_keep_their_own_buffers_as_with_torch_ddp(world):
    d, results = world
    for name in ("mlp-off", "cnn-off"):
        values = case_result(results, name)
        for wrapper in ("distopt", "torch"):
            assert _spread([v["after"][-1][wrapper] for v in values]) > 1e-2, (name, wrapper)
        assert all(c == {} for v in values for c in v["calls"] + [v["eval_calls"]])


def test_one_broadcast_per_dtype_per_forward(world):
    d, results = world
    for name in _runs_at(d):
        run = RUNS[name]
        if not run.broadcast:
            continue
        op = "broadcast_buffers" if run.mesh is None else "replicate_broadcast_buffers"
        for v in case_result(results, name):
            assert v["buffer_dtypes"] == 2  # fp32 statistics, int64 counters of 2 layers
            for forward, (calls, sent) in enumerate(zip(v["calls"], v["bytes"], strict=True)):
                broadcasts = {k: n for k, n in calls.items() if k in BROADCAST_OPS}
                syncs = forward % run.micro == 0
                assert broadcasts == ({op: v["buffer_dtypes"]} if syncs else {}), (name, forward)
                # Every buffer once: one flat tensor per dtype.
                assert sent.get(op, 0) == (v["buffer_bytes"] if syncs else 0), (name, forward)
                # Nothing else is sent in a forward (sharded grads wait for backward's end).
                assert calls == broadcasts, (name, forward, calls)
            assert v["eval_calls"] == {op: v["buffer_dtypes"]}, name


def test_evaluation_after_training_is_the_same_on_every_rank(world):
    d, results = world
    for name in _runs_at(d):
        values = case_result(results, name)
        if RUNS[name].broadcast:
            assert _spread([v["eval"]["distopt"] for v in values]) == 0.0, name
        for v in values:
            assert (v["eval"]["distopt"] - v["eval"]["torch"]).abs().max() <= FP32_TOL, name


def test_tensor_parallel_ranks_keep_their_own_buffers(two):
    """Broadcasts run over the DP groups alone: with one DP rank there is none, and each TP
    rank's running mean keeps the offset it started with (the same batch updates both)."""
    values = case_result(two, "tensor-parallel")
    for v in values:
        assert not any(k in BROADCAST_OPS for k in v["calls"]), v["calls"]
    for forward in range(2):
        gap = values[1]["means"][forward] - values[0]["means"][forward]
        assert torch.allclose(gap, torch.full_like(gap, 0.9**forward), atol=1e-6), gap


def test_sync_batchnorm_reduces_over_the_data_parallel_group(world):
    """Within FP32_TOL of plain BatchNorm on the whole batch in one process, params and buffers,
    after every step; the statistics the same on every rank of the group. At d = 3 the group is
    ranks 0 and 1 (rank 2 alone): the default group would mix rank 2's batch in."""
    d, results = world
    values = case_result(results, "sync-bn-mlp")
    for v in values:
        assert v["found_group"]
        assert v["max_diff"] <= FP32_TOL, v["max_diff"]
    members = values[:2] if d == 3 else values
    assert [v["group_size"] for v in values] == ([2, 2, 1] if d == 3 else [d] * d)
    for step in range(STEPS):
        assert _spread([v["after"][step] for v in members]) == 0.0, step


def test_sync_batchnorm_groups(world):
    d, results = world
    for v in case_result(results, "sync-bn-groups"):
        assert v["kept"] and v["hierarchical"]
        assert "are not the default group" in v["error"] and "convert_sync_batchnorm" in v["error"]


@pytest.mark.slow  # a group of 3 ranks, as world_params marks them
def test_sync_batchnorm_saved_at_2_resumes_at_3_within_1e_5(three):
    for v in case_result(three, "sync-bn-cnn-resumed"):
        assert v["max_diff"] <= FP32_TOL and v["from_saved_run"] <= FP32_TOL, v
    values = case_result(three, "sync-bn-cnn-resumed")
    for step in range(STEPS - SAVE_AT):
        assert _spread([v["after"][step] for v in values]) == 0.0, step


def test_sync_batchnorm_checkpointed_run_matches_one_process(two):
    for v in case_result(two, "sync-bn-cnn-save"):
        assert v["found_group"] and v["max_diff"] <= FP32_TOL, v["max_diff"]


@pytest.mark.parametrize("shard_grads", [False, True], ids=["full-grads", "shard-grads"])
def test_checkpoint_resumed_at_2_ends_bitwise_buffers_included(two, shard_grads):
    """Right after a training forward the ranks' statistics differ by their own update; the
    checkpoint holds rank 0's, which every rank loads and the next forward would broadcast."""
    case_result(two, f"save-{shard_grads}")
    values = case_result(two, f"resume-{shard_grads}")
    assert values[1]["rank0_differed"]
    for v in values:
        assert v["loaded_rank0s"] and v["bitwise"], v
