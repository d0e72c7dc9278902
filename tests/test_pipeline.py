"""distopt's DDP as the stage module of torch.distributed.pipelining, against one plain process.

A tiny language model (an embedding, tanh layers, a head tied to the embedding) is split into
pipeline stages that keep the whole model's names; each stage is a distopt DDP over its DP
group (the "dp" dimension of a (pp, dp) mesh) inside ``distopt.pipelining.PipelineStage``, and
torch's schedules run 4 micro-batches per step. In the same process a plain copy of the whole
model trains on the whole batch with torch.optim.AdamW and clip_grad_norm_. The cases compare
every stage's params after every step, count the collectives, and check that the tie's two
copies stay identical. The 2-rank pool runs (pp, dp) = (2, 1); the 4-rank pool (2, 2), (4, 1),
bf16 params at (2, 2) against fp32 master weights, and (pp, dp, tp) = (2, 1, 2), each stage's
layers tensor-parallel (DTensor) over its two TP ranks.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch_resume_stages import stage_of

import distopt
from distopt.checkpoint import AsyncCheckpoint
from distopt.memory import bytes_per_param_breakdown
from distopt.pipelining import PipelineStage
from distopt.train.config import parse_args

from dist_harness import case_result, run_cases
from helpers import (
    BF16_TOL,
    BF16_U,
    FP32_TOL,
    LOSS_RTOL,
    NORM_RTOL,
    SMALL_TRAIN,
    WEIGHTS_TO_RELATIVE,
    error_of,
    fp32_master_step,
    full,
    muon_weights_tol,
    train_in_pool,
)

VOCAB, DIM, SEQ, BATCH = 16, 8, 3, 8
MICRO_BATCHES = 4
STEPS = 4
CLIP = 0.05  # below every step's grad norm here, so every step clips
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble,  # a split backward: I, then W
             "zbv": ScheduleZBVZeroBubble}  # V-shaped: rank 0 holds the first and last stage


class StagedLM(nn.Module):
    """The whole model, or one stage of it: the layers another stage runs are left out (the
    first stage alone has the embedding, the last alone the head), names unchanged."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.wte: nn.Embedding | None = nn.Embedding(VOCAB, DIM)
        # Two positions more than any batch uses: rows of zero grads for log_num_zeros.
        self.wpe: nn.Embedding | None = nn.Embedding(SEQ + 2, DIM)
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in range(layers)})
        self.head: nn.Linear | None = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            h = self.wte(h) + self.wpe(torch.arange(h.shape[-1]))
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


def pipeline_step(sched: Any, pp_rank: int, pp: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of the schedule ``sched``: the first stage gives the inputs, the last the
    targets."""
    sched.step(*((x,) if pp_rank == 0 else ()), **({"target": y} if pp_rank == pp - 1 else {}))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # In fp32 whatever the model's dtype, as a bf16 run computes its loss.
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


MUON = {"lr": 0.02, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
VARIANTS = {"": {}, "shard_grads": {"shard_grads": True}, "shard_params": {"shard_params": True},
            "muon": {}, "bf16": {"grad_dtype": torch.bfloat16}, "tp": {}}
# bf16 params and grads: the grads of 4 micro-batches are summed in bf16 (and reduced over DP
# in bf16), the reference's are of the whole batch: rounded once per micro-batch and per sum,
# as test_mixed_precision.py bounds bf16 grads (a wrong micro-batch scale is a factor of 4).
BF16_NORM_RTOL = 4 * BF16_U  # 2**-6


def muon_groups(module: StagedLM) -> list[dict]:
    """Muon for the matrices (the tied embedding included), AdamW for the rest."""
    named = dict(module.named_parameters())
    matrices = [p for n, p in named.items() if n.startswith("layers.") and p.dim() == 2]
    matrices += [p for n, p in named.items() if n in ("wte.weight", "head.weight")]
    rest = [p for p in named.values() if all(p is not m for m in matrices)]
    return [{"params": matrices, **MUON},
            {"params": rest, "optimizer": torch.optim.AdamW, **ADAMW}]


def held_params(modules: list[StagedLM], ddps: list) -> list[tuple[str, torch.Tensor]]:
    """Copies of this rank's stages' params, whole (gathered under sharded params)."""
    with contextlib.ExitStack() as gathered:
        for ddp in ddps:
            gathered.enter_context(ddp.gathered_params())
        # full(): a tensor-parallel layer's DTensor gathered over its stage's TP ranks.
        return [(n, full(p).clone()) for m in modules for n, p in m.named_parameters()]


def tensor_parallel(module: StagedLM, mesh: DeviceMesh) -> None:
    """The stage's layers over the mesh's "tp" dimension, in pairs: column-wise (each TP rank
    a slice of the outputs, tanh on its slice), then row-wise (the partial sums all-reduced)."""
    names = sorted(module.layers, key=int)
    parallelize_module(module, mesh["tp"], {
        f"layers.{name}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        for i, name in enumerate(names)})


def parity(pp: int, dp: int, schedule: str, chunks: int = 1, variant: str = "") -> dict:
    """STEPS steps of AdamW + clip (or Muon and AdamW, ``variant="muon"``; or with sharded
    grads or params; or bf16 params and grads, against fp32 master weights) on a (pp, dp) mesh
    with ``chunks`` stages per rank; ``variant="tp"``: a (pp, dp, tp) mesh over every rank, each
    stage's layers tensor-parallel over its "tp" dimension."""
    tp = dist.get_world_size() // (pp * dp) if variant == "tp" else 1
    shape, names = ((pp, dp, tp), ("pp", "dp", "tp")) if variant == "tp" else ((pp, dp),
                                                                                ("pp", "dp"))
    mesh = DeviceMesh("cpu", torch.arange(pp * dp * tp).reshape(shape), mesh_dim_names=names)
    pp_rank, dp_rank = mesh.get_coordinate()[:2]
    stages = pp * chunks
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    torch.manual_seed(0)
    # Tensor parallel: two layers per stage, a column-wise and a row-wise one.
    whole = StagedLM(layers=stages * (2 if tp > 1 else 1)).to(dtype)
    ref = copy.deepcopy(whole)
    # Interleaved: rank r runs stages r, r + pp, ...; V-shaped: r and 2 pp - 1 - r.
    indices = ([pp_rank, 2 * pp - 1 - pp_rank] if schedule == "zbv"
               else [pp_rank + pp * c for c in range(chunks)])
    modules, ddps, pipeline_stages = [], [], []
    for index in indices:
        module, tied = stage_of(whole, index, stages)
        if tp > 1:
            tensor_parallel(module, mesh)
        ddp = distopt.DistributedDataParallel(module, device_mesh=mesh, bucket_size=64,
                                              tied_params=tied, **VARIANTS[variant])
        modules.append(module)
        ddps.append(ddp)
        pipeline_stages.append(PipelineStage(ddp, index, stages, torch.device("cpu")))
    models = ddps if chunks > 1 else ddps[0]
    if variant == "muon":
        params = [g for module in modules for g in muon_groups(module)]
        # One group per class: the stages' groups joined.
        params = [{**params[0], "params": [p for g in params[::2] for p in g["params"]]},
                  {**params[1], "params": [p for g in params[1::2] for p in g["params"]]}]
        opt = distopt.DistributedOptimizer(models, torch.optim.Muon, params=params,
                                           clip_grad=CLIP, log_num_zeros=True)
        ref_groups = muon_groups(ref)
        ref_opts = [torch.optim.Muon(ref_groups[0]["params"], **MUON),
                    torch.optim.AdamW(ref_groups[1]["params"], **ADAMW)]
    else:
        opt = distopt.DistributedOptimizer(models, torch.optim.AdamW, clip_grad=CLIP,
                                           log_num_zeros=True, **ADAMW)
        ref_opts = [torch.optim.AdamW(ref.parameters(), **ADAMW)]
    masters = None
    if dtype != torch.float32:  # the reference steps fp32 masters and casts them into ref
        masters = [nn.Parameter(p.detach().float()) for p in ref.parameters()]
        ref_opts = [torch.optim.AdamW(masters, **ADAMW)]
    cls = SCHEDULES[schedule]
    sched = cls(pipeline_stages if chunks > 1 else pipeline_stages[0],
                n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    first = 0 in indices
    last = stages - 1 in indices
    per = BATCH // dp
    worst = worst_norm = 0.0
    calls, zeros, held = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        opt.zero_grad()
        for ddp in ddps:
            ddp.comm_stats.reset()
            for pool in (*ddp.grad_pools.values(), *ddp.param_pools.values()):
                pool.reset_peak()
        kwargs = {}
        if last:
            kwargs["target"] = y[mine]
        sched.step(*((x[mine],) if first else ()), **kwargs)
        held.append([(sum(p.peak_buffers for p in ddp.grad_pools.values()),
                      sum(p.peak_bytes for p in ddp.param_pools.values())) for ddp in ddps])
        result = opt.step()
        calls.append([dict(ddp.comm_stats.calls) for ddp in ddps])

        if masters is not None:
            ref_norm = fp32_master_step(list(ref.parameters()), masters, ref_opts[0],
                                        loss_fn(ref(x), y), clip=CLIP).item()
        else:
            ref.zero_grad()
            loss_fn(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
            for ref_opt in ref_opts:
                ref_opt.step()
        zeros.append((result.num_zeros,
                      sum(int((p.grad == 0).sum()) for p in ref.parameters())))

        for ddp in ddps:
            ddp.finish_param_sync()
        ref_params = dict(ref.named_parameters())
        for name, value in held_params(modules, ddps):
            target = ref_params["wte.weight" if name == "head.weight" else name]
            worst = max(worst, (value.float() - target.detach().float()).abs().max().item())
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norm - 1))
    tie = [v for n, v in held_params(modules, ddps) if n in ("wte.weight", "head.weight")]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tie)
    copies = [t for held in gathered for t in held]
    tie_equal = all(torch.equal(copies[0], t) for t in copies[1:])
    return {
        "max_diff": worst,
        "norm_diff": worst_norm,
        "calls": calls,
        "buckets": [len(ddp.buckets) for ddp in ddps],
        # During each step: grad pool buffers, and bytes of gathered params (sharded params);
        # the whole buckets' param bytes of each stage.
        "held": held,
        "param_bytes": [sum(b.numel * b.param_shard.dtype.itemsize for b in ddp.buckets)
                        for ddp in ddps],
        "tie_equal": tie_equal,
        "tie_copies": len(copies),
        "zeros": zeros,
        "dtypes": {p.dtype for m in modules for p in m.parameters()},
        "tensor_parallel": sorted(n for m in modules for n, p in m.named_parameters()
                                  if isinstance(p, DTensor)),
    }


def inf_on_one_stage_skips_every_stage() -> dict:
    """fp16's verdict spans the stages: an inf in the last stage's grads skips the step on
    the first stage too."""
    mesh = DeviceMesh("cpu", torch.arange(2).reshape(2, 1), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    module, tied = stage_of(StagedLM(layers=2), pp_rank, 2)
    ddp = distopt.DistributedDataParallel(module, device_mesh=mesh, tied_params=tied)
    scaler = distopt.DynamicLossScaler(initial_scale=2.0**8, hysteresis=1)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, loss_scaler=scaler, lr=1e-2)
    sched = ScheduleGPipe(PipelineStage(ddp, pp_rank, 2, torch.device("cpu")),
                          n_microbatches=MICRO_BATCHES,
                          loss_fn=lambda out, y: opt.scale_loss(loss_fn(out, y)))
    updated, changed = [], []
    for step in range(3):
        x, y = batch(step)
        before = [p.detach().clone() for p in module.parameters()]
        opt.zero_grad()
        pipeline_step(sched, pp_rank, 2, x, y)
        if step == 1 and pp_rank == 1:
            module.layers["1"].weight.main_grad[0, 0] = float("inf")
        updated.append(opt.step().updated)
        ddp.finish_param_sync()
        changed.append(any(not torch.equal(b, a)
                           for b, a in zip(before, module.parameters(), strict=True)))
    return {"updated": updated, "changed": changed, "scale": scaler.scale}


def stage_memory() -> dict:
    """What each stage holds after a step at (pp, dp) = (2, 1): bf16 params, fp32 grads."""
    mesh = DeviceMesh("cpu", torch.arange(2).reshape(2, 1), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    module, tied = stage_of(StagedLM(layers=2).to(torch.bfloat16), pp_rank, 2)
    ddp = distopt.DistributedDataParallel(module, device_mesh=mesh, bucket_size=64,
                                          tied_params=tied, grad_dtype=torch.float32)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    sched = ScheduleGPipe(PipelineStage(ddp, pp_rank, 2, torch.device("cpu")),
                          n_microbatches=MICRO_BATCHES,
                          loss_fn=lambda out, y: loss_fn(out.float(), y))
    x, y = batch(0)
    opt.zero_grad()
    pipeline_step(sched, pp_rank, 2, x, y)
    opt.step()  # the optimizer state exists from the first step on
    return {"report": distopt.measure_state_bytes(opt),
            "stage_params": sum(p.numel() for p in module.parameters()),
            "padded": sum(buf.layout.numel for buf in ddp.flat_buffers),
            "owned": sum(m.numel() for m in opt.main_params)}


def refusals_on_every_stage() -> dict:
    """What one stage refuses, both refuse, and neither hangs."""
    mesh = DeviceMesh("cpu", torch.arange(2).reshape(2, 1), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_coordinate()[0]

    def stage(tie: bool = True) -> tuple[StagedLM, distopt.DistributedDataParallel]:
        torch.manual_seed(0)
        module, tied = stage_of(StagedLM(layers=2), pp_rank, 2)
        return module, distopt.DistributedDataParallel(
            module, device_mesh=mesh, tied_params=tied if tie else None)

    def tie_on_one_stage() -> None:
        _, ddp = stage(tie=pp_rank == 0)
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)

    def tie_of_another_module() -> None:
        torch.manual_seed(0)
        module, _ = stage_of(StagedLM(layers=2), pp_rank, 2)
        tied = {"wte.weight": nn.Parameter(torch.zeros(VOCAB, DIM))} if pp_rank else {}
        distopt.DistributedDataParallel(module, device_mesh=mesh, tied_params=tied)

    def grads_not_zeroed() -> None:
        _, ddp = stage()
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
        sched = ScheduleGPipe(PipelineStage(ddp, pp_rank, 2, torch.device("cpu")),
                              n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        x, y = batch(0)
        for _ in range(2):  # no opt.zero_grad() between the steps
            pipeline_step(sched, pp_rank, 2, x, y)
            opt.step()

    def not_a_distopt_module() -> None:
        PipelineStage(nn.Linear(2, 2), pp_rank, 2, torch.device("cpu"))

    def torch_stage() -> None:  # torch's own class, refused while it is built
        _, ddp = stage()
        TorchPipelineStage(ddp, pp_rank, 2, torch.device("cpu"), group=ddp.parallel.pp_group)

    return {name: error_of(fn) for name, fn in [
        ("tie_on_one_stage", tie_on_one_stage), ("tie_of_another_module", tie_of_another_module),
        ("grads_not_zeroed", grads_not_zeroed), ("not_a_distopt_module", not_a_distopt_module),
        ("torch_stage", torch_stage)]}


def experts_in_stages(schedule: str, variant: str = "") -> float:
    """A GPT with a mixture of experts in 2 stages over (pp, dp) = (2, 2), each stage's 2 DP
    ranks one expert-parallel group of 2 (their expert mesh a ("dp", "ep") = (1, 2) slice of a
    (pp, dp, ep) mesh): the largest difference from one process's AdamW (clipped) on the whole
    batch, every expert local, over 3 steps. find_unused_parameters: an expert no token reached
    is left out of the step, as torch.optim leaves a param whose grad is None."""
    from distopt.train.model import GPT, GPTConfig
    from distopt.train.stages import GPTStage, stage_loss

    pp, ep = 2, 2
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(pp, 2), mesh_dim_names=("pp", "dp"))
    experts_mesh = DeviceMesh("cpu", torch.arange(4).reshape(pp, 1, ep),
                              mesh_dim_names=("pp", "dp", "ep"))["dp", "ep"]
    pp_rank, dp_rank = mesh.get_coordinate()
    cfg = GPTConfig(seq_len=8, n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_experts=4,
                    top_k=2)
    torch.manual_seed(7)
    stage = GPTStage(GPT(cfg, ep_group=experts_mesh["ep"].get_group()), pp_rank, pp)
    torch.manual_seed(7)
    ref = GPT(cfg)
    ddp = distopt.DistributedDataParallel(
        stage, device_mesh=mesh, tied_params=stage.tied_params(), bucket_size=2000,
        find_unused_parameters=True, **VARIANTS[variant],
        experts=distopt.ExpertParallel(experts_mesh, stage.expert_lists()))
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    sched = SCHEDULES[schedule](PipelineStage(ddp, pp_rank, pp, torch.device("cpu")),
                                n_microbatches=2, loss_fn=stage_loss)
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, 32, (8, 8), generator=g)
        y = torch.roll(x, -1, dims=1)
        mine = slice(dp_rank * 4, dp_rank * 4 + 4)
        opt.zero_grad()
        pipeline_step(sched, pp_rank, pp, x[mine], y[mine])
        opt.step()
        ddp.finish_param_sync()
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        want = dict(ref.named_parameters())
        with ddp.gathered_params():
            for name, param in stage.named_parameters():
                name = ddp.experts.global_name(name)
                target = want["wte.weight" if name == "lm_head.weight" else name]
                worst = max(worst, (param.detach() - target.detach()).abs().max().item())
    return worst


EXPERT_STAGES = [("1f1b", ""), ("gpipe", ""), ("1f1b", "shard_grads")]

PARITY_2 = [(2, 1, "gpipe"), (2, 1, "1f1b"), (2, 1, "interleaved", 2),
            (2, 1, "zero-bubble", 2), (2, 1, "zbv", 2), (2, 1, "1f1b", 1, "muon")]
PARITY_4 = [(2, 2, "gpipe"), (2, 2, "1f1b"), (4, 1, "1f1b"), (4, 1, "interleaved", 2),
            (2, 2, "1f1b", 1, "muon"), (2, 2, "1f1b", 1, "shard_grads"),
            (2, 2, "1f1b", 1, "shard_params"), (2, 2, "1f1b", 1, "bf16"),
            (2, 1, "1f1b", 1, "tp"),  # (pp, dp, tp) = (2, 1, 2)
            # Sharded grads and params under every kind of schedule: the step held whole.
            *[(2, 2, schedule, chunks, variant)
              for schedule, chunks in (("gpipe", 1), ("interleaved", 2), ("zero-bubble", 2))
              for variant in ("shard_grads", "shard_params")]]
SHARDED_COUNTED = [c for c in PARITY_4 if len(c) > 4 and c[4].startswith("shard")]


def _name(config: tuple) -> str:
    return "parity-" + "-".join(map(str, config))


@pytest.fixture(scope="module")
def results_2():
    return run_cases(2, [(_name(c), parity, c) for c in PARITY_2]
                     + [("inf", inf_on_one_stage_skips_every_stage, ()),
                        ("refusals", refusals_on_every_stage, ()),
                        ("memory", stage_memory, ())])


@pytest.fixture(scope="module")
def results_4():
    return run_cases(4, [(_name(c), parity, c) for c in PARITY_4]
                     + [(f"experts-{s}-{v}", experts_in_stages, (s, v))
                        for s, v in EXPERT_STAGES])


@pytest.mark.slow
@pytest.mark.parametrize("schedule,variant", EXPERT_STAGES)
def test_experts_in_stages_train_like_one_process(results_4, schedule, variant):
    for worst in case_result(results_4, f"experts-{schedule}-{variant}"):
        assert worst < FP32_TOL, worst


# variant -> (param tolerance, grad-norm tolerance); fp32 otherwise. In bf16, a wrong tie moves
# the params by several bf16 ulps (and breaks the copies' equality); a wrong micro-batch scale
# leaves clipped AdamW's params nearly unchanged but multiplies the grad norm by 4.
# Muon: the pipelined grads are sums in another order, whose last bits can flip a rounding of
# its bf16 Newton-Schulz (helpers.muon_weights_tol; torch scales the lr of the (16, 8) embedding
# by sqrt(2)), and the norms are those of weights that far apart.
MUON_TOL = muon_weights_tol([MUON["lr"]] * STEPS, lr_ratio=2**0.5)  # 1.8e-3
TOLERANCES = {"bf16": (BF16_TOL, BF16_NORM_RTOL),
              "muon": (MUON_TOL, WEIGHTS_TO_RELATIVE * MUON_TOL)}


def _check_parity(ranks: list[dict], config: tuple) -> None:
    variant = config[4] if len(config) > 4 else ""
    tol, norm_tol = TOLERANCES.get(variant, (FP32_TOL, NORM_RTOL))
    for rank in ranks:
        assert rank["max_diff"] < tol, rank["max_diff"]
        assert rank["norm_diff"] < norm_tol, rank["norm_diff"]
        assert rank["tie_equal"] and rank["tie_copies"] >= 2
        assert all(got == want > 0 for got, want in rank["zeros"]), rank["zeros"]
        assert rank["dtypes"] == {torch.bfloat16 if variant == "bf16" else torch.float32}
        # Every rank's stage holds a column-wise and a row-wise tensor-parallel layer.
        assert len(rank["tensor_parallel"]) == (4 if variant == "tp" else 0)


@pytest.mark.parametrize("config", PARITY_2, ids=_name)
def test_two_stages_train_like_one_process(results_2, config):
    _check_parity(case_result(results_2, _name(config)), config)


@pytest.mark.slow
@pytest.mark.parametrize("config", PARITY_4, ids=_name)
def test_four_ranks_train_like_one_process(results_4, config):
    _check_parity(case_result(results_4, _name(config)), config)


@pytest.mark.slow
@pytest.mark.parametrize("config", [(2, 2, "gpipe"), (2, 2, "1f1b"), *SHARDED_COUNTED],
                         ids=_name)
def test_one_reduce_scatter_and_all_gather_per_bucket_per_step(results_4, config):
    # On each stage's DP group, whatever the micro-batches: no reduction per non-last one, and
    # with sharded params no gather per micro-batch ([Note: a step held whole]).
    for rank in case_result(results_4, _name(config)):
        for step_calls in rank["calls"]:
            for calls, buckets in zip(step_calls, rank["buckets"], strict=True):
                assert calls["reduce_scatter"] == buckets, calls
                assert calls["all_gather"] == buckets, calls
            # The tie's shard, over the stages, once per step.
            assert sum(c.get("tied_all_reduce", 0) for c in step_calls) == 1, step_calls
            # With sharded params one forward check a step per model chunk, not one per
            # micro-batch's forward and backward: the schedule orders them alike on every rank.
            for calls in step_calls:
                assert calls.get("forward_check", 0) == (1 if "shard_params" in config else 0)
        # A sharded stage held its step whole: a grad buffer per bucket, every param gathered
        # (what `distopt memory --pp` states for the step).
        variant = config[4] if len(config) > 4 else ""
        for step_held in rank["held"]:
            for (grad_buffers, gathered), buckets, whole in zip(
                    step_held, rank["buckets"], rank["param_bytes"], strict=True):
                if variant.startswith("shard"):
                    assert grad_buffers == buckets, (grad_buffers, buckets)
                assert gathered == (whole if variant == "shard_params" else 0), gathered


def test_inf_on_one_stage_skips_the_step_on_every_stage(results_2):
    for rank in case_result(results_2, "inf"):
        assert rank["updated"] == [True, False, True]
        assert rank["changed"] == [True, False, True]


def test_memory_per_rank_of_each_stage_is_the_table_for_its_params(results_2):
    table = bytes_per_param_breakdown(torch.bfloat16, torch.float32).per_rank(1)
    counts = []
    for rank in case_result(results_2, "memory"):
        report, padded = rank["report"], rank["padded"]
        # The tied embedding/head is a param of both stages: each holds a copy.
        assert report.num_params == rank["stage_params"] == rank["owned"]
        counts.append(rank["stage_params"])
        # The table times the stage's params plus the padding of its buckets, which the
        # buffers hold; at dp = 1 the one rank owns (and keeps state for) every element.
        assert padded >= report.num_params
        assert report.params == table["params"] * padded
        assert report.grads == table["grads"] * padded
        assert report.main_params == table["main_params"] * padded
        assert report.main_grads == table["main_grads"] == 0
        assert report.optimizer_state == table["optimizer_state"] * rank["owned"]
    whole = sum(p.numel() for p in StagedLM(layers=2).parameters())
    assert sum(counts) == whole + VOCAB * DIM  # the tie, once on each end


REFUSALS = {
    "tie_on_one_stage": "held by one pipeline stage only",
    "tie_of_another_module": "is not a trainable parameter of the stage module",
    "grads_not_zeroed": "call optimizer.zero_grad() before each schedule.step()",
    "not_a_distopt_module": "takes a distopt.DistributedDataParallel stage module",
    "torch_stage": "Use distopt.pipelining.PipelineStage(ddp, stage_index, num_stages, device)",
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refusal_on_one_stage_is_raised_on_every_stage(results_2, name):
    messages = [rank[name] for rank in case_result(results_2, "refusals")]
    for message in messages:
        assert REFUSALS[name] in message, messages


# ---------------------------------------------------------------- checkpoints

def pp_dp_mesh(pp: int, dp: int) -> tuple[DeviceMesh, int, int]:
    """A (pp, dp) mesh over the ranks (pp = 1: a "dp" mesh alone, for the whole model), and this
    rank's stage and DP index."""
    if pp == 1:
        mesh = DeviceMesh("cpu", torch.arange(dp), mesh_dim_names=("dp",))
        return mesh, 0, mesh.get_local_rank()
    mesh = DeviceMesh("cpu", torch.arange(pp * dp).reshape(pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_coordinate()
    return mesh, pp_rank, dp_rank


def train_steps(pp: int, dp: int, start: int, stop: int, load: str | None = None,
                save: str | None = None, save_after: int | None = None
                ) -> dict[str, torch.Tensor]:
    """Steps ``start`` to ``stop`` on a (pp, dp) mesh (pp = 1: the whole model under a plain
    DDP), from the checkpoint ``load`` if given, saving into ``save`` at the end, or
    asynchronously after step ``save_after`` while the later steps train (waited for at the
    end); the params this rank holds, by the whole model's names."""
    mesh, pp_rank, dp_rank = pp_dp_mesh(pp, dp)
    torch.manual_seed(0)
    module, tied = stage_of(StagedLM(layers=max(pp, 2)), pp_rank, pp)
    ddp = distopt.DistributedDataParallel(module, device_mesh=mesh, bucket_size=64,
                                          tied_params=tied)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
                                       weight_decay=0.1)
    if load is not None:
        distopt.load_checkpoint(load, ddp, opt)
    sched = None
    if pp > 1:
        sched = ScheduleGPipe(PipelineStage(ddp, pp_rank, pp, torch.device("cpu")),
                              n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
    per = BATCH // dp
    pending = None
    for step in range(start, stop):
        x, y = batch(step)
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        opt.zero_grad()
        if sched is None:
            loss_fn(ddp(x[mine]), y[mine]).backward()
        else:
            pipeline_step(sched, pp_rank, pp, x[mine], y[mine])
        opt.step()
        if save is not None and step + 1 == save_after:
            # The steps after it change the params while the save writes what it staged.
            pending = distopt.save_checkpoint(save, ddp, opt, async_save=True)
            assert isinstance(pending, AsyncCheckpoint), pending
    if pending is not None:
        pending.wait()
    elif save is not None:
        distopt.save_checkpoint(save, ddp, opt)
    ddp.finish_param_sync()
    return {("wte.weight" if n == "head.weight" else n): p.detach().clone()
            for n, p in module.named_parameters()}


def saved_at_2x2(directory: str) -> dict:
    """Four steps at (2, 2), saved asynchronously after the second while the others train; and
    four uninterrupted steps, without a save: where each run ends."""
    return {"saving": train_steps(2, 2, 0, 4, save=directory, save_after=2),
            "uninterrupted": train_steps(2, 2, 0, 4)}


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pipeline-ckpt"))
    unpipelined = str(tmp_path_factory.mktemp("pipeline-ckpt-1x2"))
    four = str(tmp_path_factory.mktemp("pipeline-ckpt-4x1"))
    # First at (4, 1): the tie's group holds ranks 0 and 3 only, so the ranks belong to
    # different numbers of groups when the async saves make their writer group.
    saved = run_cases(4, [("saved-4x1", train_steps, (4, 1, 0, 2, None, four, 1)),
                          ("saved", saved_at_2x2, (directory,))])
    resumed = run_cases(2, [(f"resumed-{pp}x{dp}", train_steps, (pp, dp, 2, 4, directory))
                            for pp, dp in [(2, 1), (1, 2)]]
                        # and the other way: two unpipelined steps, saved, resumed in stages
                        + [("saved-1x2", train_steps, (1, 2, 0, 2, None, unpipelined)),
                           ("resumed-2x1-from-1x2", train_steps, (2, 1, 2, 4, unpipelined))])
    return saved, resumed


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x1", "1x2", "2x1-from-1x2"])
def test_a_checkpoint_resumes_at_another_layout(checkpoint_runs, layout):
    """A checkpoint of (pp, dp) = (2, 2) resumed at (2, 1) and at (1, 2), unpipelined; and one
    of (1, 2) resumed at (2, 1), in stages: each ends where the uninterrupted run ends."""
    saved, resumed = checkpoint_runs
    uninterrupted = {n: p for rank in case_result(saved, "saved")
                     for n, p in rank["uninterrupted"].items()}
    ended = {n: p for rank in case_result(resumed, f"resumed-{layout}") for n, p in rank.items()}
    assert sorted(ended) == sorted(uninterrupted)
    worst = max((ended[n] - uninterrupted[n]).abs().max().item() for n in ended)
    assert worst < FP32_TOL, worst


@pytest.mark.slow
def test_an_async_save_of_the_stages_leaves_their_run_unchanged(checkpoint_runs):
    # The save staged its copy of every stage's part: the steps after it are the same steps.
    saved, _ = checkpoint_runs
    case_result(saved, "saved-4x1")  # four stages, the tie over two ranks of four: saved
    for rank in case_result(saved, "saved"):
        assert sorted(rank["saving"]) == sorted(rank["uninterrupted"])
        for name, value in rank["saving"].items():
            assert torch.equal(value, rank["uninterrupted"][name]), name


# ---------------------------------------------------------------- distopt train --pp

def train_resumed_from(checkpoint: str, out: str, *args: str) -> str:
    """``distopt train ARGS --out OUT --resume`` from ``checkpoint``, another run's, copied
    into OUT's checkpoints as the latest; what this rank printed."""
    if dist.get_rank() == 0:
        run_dir = Path(out) / "checkpoints"
        shutil.copytree(checkpoint, run_dir / Path(checkpoint).name)
        (run_dir / "latest").write_text(Path(checkpoint).name)
    dist.barrier()  # the copy is complete before any rank looks for it
    return train_in_pool(*args, "--out", out, "--resume")


# The checkpoint of step 4 of 8 (--save-every 4): the first a run writes.
HALFWAY = "ckpt-000001"
# Each resumed run -> the run whose step-4 checkpoint it starts from, and its own flags. (An
# unpipelined checkpoint loaded into stages: test_a_checkpoint_resumes_at_another_layout.)
RESUMED = {"flat-from-pp": ("pp", ()),
           "flat-moe-from-pp-moe": ("pp-moe", ("--moe", "4", "--ep", "2"))}


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory) -> dict[str, dict]:
    """distopt train at 4 ranks, 2 micro-batches per step: 2 stages x 2 DP ranks, and the
    unpipelined run with the same global batch, each also with a mixture of experts; then the
    unpipelined run resumed at step 4 from the pipelined run's checkpoint. Each run's final
    held-out loss, and the step it resumed at (None: it did not)."""
    runs = {"pp": ("--pp", "2"), "flat": (), "pp-moe": ("--pp", "2", "--moe", "4", "--ep", "2"),
            "flat-moe": ("--moe", "4", "--ep", "2")}
    outs = {name: tmp_path_factory.mktemp(f"train-{name}") for name in [*runs, *RESUMED]}
    run_cases(4, [(name, train_in_pool, (*SMALL_TRAIN, "--out", str(outs[name]),
                                         "--grad-accum", "2", *extra))
                  for name, extra in runs.items()]
              + [(name, train_resumed_from, (str(outs[source] / "checkpoints" / HALFWAY),
                                             str(outs[name]), *SMALL_TRAIN, "--grad-accum",
                                             "2", *extra))
                 for name, (source, extra) in RESUMED.items()])
    ended = {}
    for name in [*runs, *RESUMED]:
        records = [json.loads(line)
                   for line in (outs[name] / "metrics.jsonl").read_text().splitlines()]
        ended[name] = {
            "heldout": json.loads((outs[name] / "summary.json").read_text())["heldout_loss_end"],
            "resumed_at": next((r["step"] for r in records if r.get("resumed")), None)}
    return ended


@pytest.mark.slow
def test_train_pp_2_learns_what_the_unpipelined_run_learns(train_runs):
    # fp32 and the same global batch: equal up to the order of the sums, which AdamW carries
    # (helpers.LOSS_RTOL).
    assert train_runs["pp"]["heldout"] == pytest.approx(train_runs["flat"]["heldout"],
                                                        rel=LOSS_RTOL)


@pytest.mark.slow
def test_train_pp_2_with_experts_learns_what_the_unpipelined_run_learns(train_runs):
    # Experts inside the stages: each stage's two DP ranks one expert-parallel group.
    assert train_runs["pp-moe"]["heldout"] == pytest.approx(train_runs["flat-moe"]["heldout"],
                                                            rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("resumed", sorted(RESUMED))
def test_train_resumed_at_another_pp_ends_where_the_uninterrupted_run_ends(train_runs, resumed):
    # The pipelined run's checkpoint is the whole model's, and loads without --pp. fp32:
    # equal up to the order of the sums.
    source = RESUMED[resumed][0]
    assert train_runs[source]["resumed_at"] is None
    assert train_runs[resumed]["resumed_at"] == 4
    for uninterrupted in (source, "flat" + source.removeprefix("pp")):
        assert train_runs[resumed]["heldout"] == pytest.approx(
            train_runs[uninterrupted]["heldout"], rel=LOSS_RTOL)


@pytest.mark.parametrize(("args", "message"), [
    (["--pp", "3"], "--pp 3 does not divide the 2 blocks of --model tiny"),
    (["--pp", "2", "--schedule", "zb"], "--schedule must be one of gpipe, 1f1b"),
    (["--pp", "2", "--no-shard"], "--pp does not compose with --no-shard"),
    (["--pp", "2", "--dtype", "fp16"], "--pp does not compose with --dtype fp16"),
])
def test_train_pp_refuses_what_it_cannot_run(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(args)


def test_train_pp_needs_a_divisor_of_the_ranks():
    with pytest.raises(ValueError, match="--pp 2 does not divide the 3 ranks"):
        parse_args(["--pp", "2"]).check_world_size(3)
