"""What several test modules share: tolerances, losses, the fp32-master reference step and the
parity grid's trajectory, comparisons and snapshots of models and optimizers, parameter groups,
the arithmetic of fp32-accumulated reductions, and ``distopt train`` runs in the pool. Models and
batches live in models.py."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import CosineAnnealingLR

import distopt
from distopt.comm import collectives as comm

from dist_harness import session_tmp
from models import AwkwardLM, batches, markov_batch, mlp, rank_slice

# ---------------------------------------------------------------- world sizes


def world_params(worlds: list[int]) -> list:
    """The world sizes of a module's grid as pytest params "d<n>"; those above 2 are slow (the
    inner loop, ``pytest -m "not slow"``, runs d = 1 and 2)."""
    return [pytest.param(w, id=f"d{w}", marks=[pytest.mark.slow] if w > 2 else [])
            for w in worlds]


# ---------------------------------------------------------------- tolerances
#
# A tolerance follows from the arithmetic, not from one machine's run: another CPU (AVX-512,
# AMX's bf16 tiles, another MKL or oneDNN kernel) groups the terms of its sums otherwise, and
# every rounding that two orders can make differently may go the other way there. A tolerance
# is at least the bound derived for the values compared, relative where their size matters,
# and far below what a bug moves (a lost grad or a stale param moves weights by lr-sized
# steps). CONTRIBUTING.md, "Tolerances and CPUs", says how to derive one and how to check a
# test under other kernels.

# Unit roundoff: the largest relative error of one rounding (half the spacing above 1).
FP32_U = 2.0**-24
BF16_U = 2.0**-8
FP16_U = 2.0**-11

# AdamW carries fp32 roundoff far above FP32_U: it steps each element by lr * m / (sqrt(v) +
# eps), whatever the grad's scale, so a grad whose terms cancel (an AwkwardLM embedding row is
# 2e-6 made of terms of 0.1, good to 1%) or that sits near eps moves its weight by a fraction
# of lr. How far is a property of the trajectory, not of the CPU: the same steps run in fp64
# are exact to fp32's eyes, and an fp32 run of them, whatever the order its batch's grads are
# summed in (whole, or in 2 to 16 chunks either way), stays within this of the fp64 run: 1.03e-5
# for the parity grid's AwkwardLM (AdamW at lr 1e-2, 20 steps), 1.18e-5 for TinyTransformer's
# runs (lr 1e-2, 10 and 20 steps); its grad norms within 1.54e-5 relative (AwkwardLM; 1.3e-7
# for TinyTransformer).
ADAMW_FP32_DRIFT = 1.2e-5
ADAMW_NORM_DRIFT = 1.6e-5
# Two fp32 runs (distopt's order and the reference's) each lie within the drift of the exact
# run, so within twice of each other; twice that again for orders not tried. SGD and Adagrad,
# whose steps scale with the grad, drift 25x less (under 5e-7): this bounds them too.
FP32_TOL = 2 * 2 * ADAMW_FP32_DRIFT  # 4.8e-5
# The grad norms, each a sum of squares in its own order (a few FP32_U more), at those weights.
NORM_RTOL = 2 * 2 * ADAMW_NORM_DRIFT  # 6.4e-5
# bf16 params: each rank computes its grads on a slice of the batch in bf16, so rounding
# differs from the full-batch reference and a weight next to a rounding boundary can land on
# the neighbouring bf16 value. The weights here stay below 4 in magnitude, where one bf16 ulp
# is 2**-6 (2 * BF16_U relative to 2); allow two ulps.
BF16_TOL = 2 * 2**-6


def sum_tol(n: int, magnitude: float, u: float = FP32_U) -> float:
    """The most two float sums of the same ``n`` terms, in any two orders, can differ by:
    each is within (n - 1) * u of the exact sum, relative to ``magnitude``, the sum of the
    terms' magnitudes (Higham's bound for recursive summation; blocked and pairwise sums stay
    within it)."""
    return 2 * (n - 1) * u * magnitude


# torch.optim.Muon orthogonalizes each update by Newton-Schulz in bf16: grads that differ in
# their last fp32 bits (summed in another order) round apart there, and so may the same grads
# under another kernel's fp32 sums (AMX's bf16 tiles accumulate a matmul in their own order).
# An orthogonalized update's elements are below 1 (its singular values are about 1), and one
# step's update then differs by a few bf16 roundings: up to 2.5 * BF16_U over random grads of
# the shapes used here, whose last bits are perturbed or whose matmuls are summed otherwise.
MUON_UPDATE_ULPS = 4  # in units of BF16_U, per step and unit learning rate


def muon_weights_tol(lrs: list[float], lr_ratio: float = 1.0) -> float:
    """The most weights stepped by Muon at learning rates ``lrs`` can differ by when each
    step's update differs by MUON_UPDATE_ULPS; ``lr_ratio``: the largest of torch's scalings
    of the learning rate, sqrt(max(1, rows / cols)), over the matrices."""
    return MUON_UPDATE_ULPS * BF16_U * lr_ratio * sum(lrs)


# Autocast (bf16 or fp16) rounds every matmul input to the low-precision dtype, so two runs
# whose fp32 weights differ in a last bit (a clip coefficient reduced in another order) can
# round an input apart in the next forward. A flipped input moves the products it enters by one
# ulp (2 u relative), in the forward and again in the backward's matmuls, and AdamW's
# normalized step can double a grad's relative change: up to 8 u of each step's learning rate.
# bf16's u bounds fp16's flips too.
AUTOCAST_ULPS = 8


def autocast_weights_tol(lrs: list[float]) -> float:
    """The most AdamW weights trained under autocast at learning rates ``lrs`` can differ by
    when roundings of the matmuls' inputs flip."""
    return AUTOCAST_ULPS * BF16_U * sum(lrs)


# What the weights' difference does to values computed from them (a loss, a grad norm): the
# parity trajectory's fp64 runs put its norms 1.5x the weights' drift away, relative; allow 2x.
WEIGHTS_TO_RELATIVE = 2.0
# The losses of two fp32 AdamW runs whose sums differ in order, relative to their size.
LOSS_RTOL = WEIGHTS_TO_RELATIVE * FP32_TOL  # 9.6e-5

# ---------------------------------------------------------------- the parity runs

CLIP = 0.5  # the clipping of the AwkwardLM parity runs
PARITY_STEPS = 20

# name -> (class, options of AwkwardLM's second param group, optimizer options)
PARITY_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"betas": (0.8, 0.95)}, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"dampening": 0.0}, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {}, {"lr": 0.05}),
}


def parity_groups(model: AwkwardLM, opt_name: str) -> list[dict]:
    """AwkwardLM's two param groups, the second with ``opt_name``'s own options."""
    groups = model.param_groups(wd_lr=2e-2, other_lr=1e-2)
    groups[1].update(PARITY_OPTIMIZERS[opt_name][1])
    return groups


def muon_groups(model: AwkwardLM, muon: dict, adamw: dict, embedding: bool = True
                ) -> list[dict]:
    """Muon (options ``muon``) for the matrices of AwkwardLM, the tied embedding included
    unless ``embedding`` is False; AdamW (options ``adamw``) for the rest."""
    matrices = [model.l1.weight, model.l2.weight, model.sometimes.weight]
    rest = [model.l1.bias, model.l2.bias, model.norm.weight, model.norm.bias]
    if embedding:
        matrices.insert(0, model.emb.weight)
    else:
        rest.insert(0, model.emb.weight)
    return [{"params": matrices, **muon},
            {"params": rest, "optimizer": torch.optim.AdamW, **adamw}]


# ---------------------------------------------------------------- losses and the reference step


def lm_loss(forward, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
    """AwkwardLM's loss at ``step`` (its sometimes-used layer runs on even steps)."""
    logits = forward(tokens, use_sometimes=step % 2 == 0)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def markov_loss(forward, step: int, rank: int, world: int) -> torch.Tensor:
    """The loss of ``rank``'s slice of the Markov batch of ``step``."""
    tokens, targets = markov_batch(step)
    logits = forward(rank_slice(tokens, rank, world))
    return F.cross_entropy(logits.float().flatten(0, 1),
                           rank_slice(targets, rank, world).flatten())


def fp32_master_step(trainable: list[nn.Parameter], masters: list[nn.Parameter],
                     ref_opt: torch.optim.Optimizer, loss: torch.Tensor,
                     clip: float = CLIP) -> torch.Tensor:
    """One step of the reference for low-precision params: the grads of ``loss`` go to
    the fp32 ``masters`` (one per trainable param), are clipped to ``clip`` and stepped, and
    the masters are cast back into the params. Returns the grad norm before clipping."""
    for p in trainable:
        p.grad = None
    loss.backward()
    for master, p in zip(masters, trainable, strict=True):
        master.grad = None if p.grad is None else p.grad.float()
    norm = torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], clip)
    ref_opt.step()
    with torch.no_grad():
        for master, p in zip(masters, trainable, strict=True):
            p.copy_(master)
    return norm


# ---------------------------------------------------------------- comparisons and snapshots


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered), or the tensor itself; detached."""
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def max_diff(a: nn.Module, b: nn.Module | dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between the params of two models (or of a model and
    a {name: tensor} copy, see ``params_of``), in fp32 on the CPU; nan if any element is nan."""
    if isinstance(b, dict):
        pairs = [(p, b[name]) for name, p in a.named_parameters()]
    else:
        pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    diffs = [(full(x).cpu().float() - full(y).cpu().float()).abs().max() for x, y in pairs]
    return torch.stack(diffs).max().item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of a model's params by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every number the model (params and buffers) and the optimizer (main params, state,
    learning rates) hold on this rank, copied. A DDP's pending param gathers finish first."""
    if isinstance(model, distopt.DistributedDataParallel):
        state = model.full_state_dict()  # sharded params gathered, gathers in flight waited
    else:
        state = model.state_dict()
    values = [v.detach().clone() for v in state.values()]
    values += [m.detach().clone() for m in opt.main_params]
    for main in opt.main_params:
        values += [v.clone() for v in opt.state.get(main, {}).values()
                   if isinstance(v, torch.Tensor)]
    values.append(torch.tensor([g["lr"] for g in opt.param_groups]))
    return values


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Two snapshots hold the same numbers, bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def numbers_by_name(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every number the model and this rank's optimizer state hold, copied, by name (the
    names of the optimizer's state dict: an order-free comparison across a save and load)."""
    values = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    sd = opt.sharded_state_dict()
    values |= {f"main/{k}": s.local.clone() for k, s in sd["main_params"].items()}
    for name, entries in sd["state"].items():
        values |= {f"state/{name}/{k}": v.local.clone() if hasattr(v, "local") else v.clone()
                   for k, v in entries.items()}
    return values


def same_by_name(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Two ``numbers_by_name`` hold the same names and numbers, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_diff(opt, saved: dict) -> float:
    """The largest difference between this rank's main params and optimizer state and those of
    a merged state dict ``saved``; inf if their keys or shapes differ."""
    from distopt.checkpoint.format import owned_pieces, piece_of

    worst = 0.0
    for owned in owned_pieces(opt):
        main = piece_of(saved["main_params"][owned.name], owned, "main")
        worst = max(worst, (owned.main.detach() - main).abs().max().item())
        entries, mine = saved["state"].get(owned.name, {}), opt.state.get(owned.main, {})
        if set(entries) != set(mine):
            return float("inf")
        for key, value in entries.items():
            theirs = value if isinstance(value, torch.Tensor) else piece_of(value, owned, key)
            if mine[key].shape != theirs.shape:
                return float("inf")
            worst = max(worst, (mine[key].float() - theirs.float()).abs().max().item())
    return worst


def shared_tmpdir(prefix: str) -> str:
    """A fresh directory, the same on every rank of the default group, inside the session's
    temporary directory where there is one."""
    box = [tempfile.mkdtemp(prefix=prefix, dir=session_tmp())
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------- reduced grads


def owned_grad_pieces(ddp: distopt.DistributedDataParallel
                      ) -> Iterator[tuple[nn.Parameter, slice]]:
    """(param, flat slice) of every piece of a grad this rank holds reduced."""
    for bucket in ddp.buckets:
        for param, slot in zip(bucket.params, bucket.param_ranges, strict=True):
            owned = slot.intersect(bucket.owned_range)
            if owned is not None:
                yield param, slice(owned.start - slot.start, owned.end - slot.start)


MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}  # implicit bit included


def ulp_of(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers around each fp64 value of ``exact``."""
    _, exponent = torch.frexp(exact)  # exact = m * 2**e with 0.5 <= |m| < 1
    spacing = torch.pow(2.0, (exponent - MANTISSA_BITS[dtype]).to(torch.float64))
    return spacing.clamp_min(torch.finfo(dtype).smallest_normal * 2.0 ** (1 - MANTISSA_BITS[dtype]))


def fp32_average(rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What fp32 accumulation promises: the rows added in fp32 in rank order, divided, rounded
    once."""
    total = rows[0].float()
    for row in rows[1:]:
        total = total + row.float()
    return (total / len(rows)).to(dtype)


def exact_average(rows: list[torch.Tensor]) -> torch.Tensor:
    return sum(row.double() for row in rows) / len(rows)


def error_report(result: torch.Tensor, rows: list[torch.Tensor]) -> dict:
    """Errors of ``result`` against the exact average: in ulps of the exact value, and how far
    over half an ulp, after allowing the fp32 sum's own roundoff (d fp32 roundings of the
    summed magnitudes)."""
    exact = exact_average(rows)
    ulps = (result.double() - exact).abs() / ulp_of(exact, result.dtype)
    magnitude = sum(row.double().abs() for row in rows) / len(rows)
    slack = len(rows) * FP32_U * magnitude / ulp_of(exact, result.dtype)
    return {"max_ulps": ulps.max().item(), "mean_ulps": ulps.mean().item(),
            "over_half_ulp": (ulps - slack - 0.5).max().item()}


# ---------------------------------------------------------------- launching distopt train

# A small `distopt train` run: 8 steps of the tiny GPT, evaluated and saved every 4 steps.
SMALL_TRAIN = ["--model", "tiny", "--steps", "8", "--batch-size", "8", "--seq-len", "32",
               "--max-bytes", "300000", "--eval-every", "4", "--eval-batches", "2",
               "--save-every", "4", "--no-progress", "--warmup", "2"]


def train_in_pool(*args: str) -> str:
    """The ranks of a ``distopt train ARGS`` run as a case of the harness's pool (only the
    launcher left out: the same worker code, one thread per rank, the same numbers), for the
    runs whose tests are not about launching; what this rank printed."""
    from distopt.train.config import parse_args
    from distopt.train.worker import Trainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Trainer(parse_args(list(args))).run()
    return printed.getvalue()


def error_of(fn, kinds: tuple[type[BaseException], ...] = (ValueError, TypeError)) -> str:
    """``"Type: message"`` of the error of one of ``kinds`` that calling ``fn`` raises, or
    ``"no error"``: refusals as values a case can return from every rank."""
    try:
        fn()
    except kinds as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def train_in_pool_streams(*args: str) -> tuple[str, str]:
    """``train_in_pool`` that also returns what this rank wrote to stderr (warnings)."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        out = train_in_pool(*args)
    return out, printed.getvalue()


def train_in_pool_killed(step: int, rank: int, *args: str) -> str:
    """``train_in_pool`` whose rank ``rank`` kills itself (SIGKILL) when it reaches step
    ``step``: the crash of a run, with nothing to catch it. The pool sees its worker die, fails
    the case on every rank and starts fresh workers for the next case, which can resume the
    run from its checkpoints as a relaunched ``distopt train --resume`` would."""
    from distopt.train import elastic

    os.environ[elastic.FAIL_AT_STEP_ENV] = str(step)
    os.environ[elastic.FAIL_RANK_ENV] = str(rank)
    try:
        return train_in_pool(*args)
    finally:  # the ranks that survive go back to the pool
        del os.environ[elastic.FAIL_AT_STEP_ENV], os.environ[elastic.FAIL_RANK_ENV]


# ---------------------------------------------------------------- which files a call runs

STEP_FILES = {
    "comm/collectives.py",
    "comm/errors.py",
    "comm/gate.py",
    "comm/gloo.py",
    "comm/handles.py",
    "comm/stats.py",
    "ddp/buffers/bucket.py",
    "ddp/buffer_layout.py",
    "ddp/grads/grad_marker.py",
    "ddp/grads/grad_markers.py",
    "ddp/buffers/grad_pool.py",
    "ddp/grads/grad_reads.py",
    "ddp/buffers/grad_storage.py",
    "ddp/grads/grad_sync.py",
    "ddp/module_buffers.py",
    "ddp/grads/nan_check.py",
    "ddp/params/param_gather.py",
    "ddp/buffers/param_storage.py",
    "ddp/params/param_unshard.py",
    "ddp/buffers/rebound_params.py",
    "ddp/state.py",
    "ddp/torch_compat/torch_ddp_methods.py",
    "ddp/torch_compat/trainable.py",
    "ddp/grads/unused_params.py",
    "ddp/params/whole_module.py",
    "ddp/wrapper.py",
    "optim/amp.py",
    "optim/base.py",
    "optim/block_scaling.py",
    "optim/grad_stats.py",
    "optim/loss_scalers.py",
    "optim/main_params.py",
    "optim/optimizers.py",
    "optim/remainders.py",
    "optim/state_precision.py",
    "optim/step.py",
    "options.py",
}
PACKAGE = Path(distopt.__file__).parent


def files_run_by(fn) -> set[str]:
    """Files of the distopt package whose Python functions run while ``fn()`` runs."""
    seen: set[str] = set()

    def profile(frame, event, _arg) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {
        str(Path(name).relative_to(PACKAGE)) for name in seen
        if Path(name).is_relative_to(PACKAGE)
    }


# ---------------------------------------------------------------- collectives that check waits


class _Deferred:
    """A handle whose work runs when it is first waited for."""

    def __init__(self, run) -> None:
        self._run = run

    def wait(self) -> bool:
        run, self._run = self._run, None
        if run is not None:
            run()
        return True

    def is_completed(self) -> bool:
        return self._run is None


class StrictCollectives:
    """Patch distopt's collectives to make the ordering contract observable instead of hoping a
    race shows: an async reduction is only run when it is waited for, and records a violation
    if its bucket's grads changed after launch (a grad accumulated after its bucket was sent);
    an async gather fills the bucket's other ranks' chunks with NaN until it is waited for, so a
    module reading a param it did not wait for poisons the loss."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.launched_before_sync = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> StrictCollectives:
        for name in ("reduce_scatter_avg", "all_gather"):
            self._saved[name] = getattr(comm, name)
        comm.reduce_scatter_avg = self._reduce_scatter_avg
        comm.all_gather = self._all_gather
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(comm, name, fn)

    def _reduce_scatter_avg(self, shard, full, group, *, async_op, stats=None):
        real = self._saved["reduce_scatter_avg"]
        if not async_op:
            return real(shard, full, group, async_op=False, stats=stats)
        self.launched_before_sync += 1
        snapshot = full.clone()

        def run() -> None:
            if not torch.equal(full, snapshot):
                self.violations.append("a grad was accumulated into a bucket after its launch")
            real(shard, full, group, async_op=False, stats=stats)

        return _Deferred(run)

    def _all_gather(self, full, shard, group, *, async_op, stats=None):
        real = self._saved["all_gather"]
        if not async_op:
            return real(full, shard, group, async_op=False, stats=stats)
        mine = shard.clone()
        full.fill_(float("nan"))  # others' chunks are unknown until the gather is waited for
        shard.copy_(mine)
        return _Deferred(lambda: real(full, shard, group, async_op=False, stats=stats))


# ---------------------------------------------------------------- bf16 params with remainders

# name -> (class, options) of the param-remainder runs
REMAINDER_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
    # lr = 1: the first step moves each param by exactly its averaged grad (see grad_coefficients).
    "sgd": (torch.optim.SGD, dict(lr=1.0, momentum=0.9)),
}


def remainders_model() -> nn.Module:
    """The bf16 MLP of the param-remainder tests."""
    torch.manual_seed(0)
    return mlp([24, 40, 17], dtype=torch.bfloat16)


def adversarial_init(model: nn.Module) -> None:
    """Params of every sign and scale: bf16 subnormals, huge values, zeros and -0.0."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            exponents = torch.randint(-132, 100, p.shape, generator=g).float()
            values = torch.randn(p.shape, generator=g) * torch.exp2(exponents)
            values.view(-1)[::11] = 0.0
            values.view(-1)[5::11] = -0.0
            p.copy_(values.to(torch.bfloat16))


def grad_coefficients(p: nn.Parameter, kind: str, step: int, rank: int, world: int,
                  index: int) -> torch.Tensor:
    """This rank's grad of ``p`` at ``step``: fixed by (kind, step, rank, index) alone."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * index + rank)
    c = torch.randn(p.shape, generator=g)
    if kind == "random":
        return c
    if step == 0:
        # Every rank gives minus half a bf16 ulp of the initial param: with SGD at lr = 1 the
        # fp32 master lands exactly on a tie (low half 0x8000) of every nonzero element.
        _, exponent = torch.frexp(p.detach().float())
        return -torch.exp2((exponent - 9).float()) * (p.detach() != 0)
    # Later: grads of wildly different scales that nearly cancel over the ranks.
    scale = torch.exp2(torch.randint(-30, 30, p.shape, generator=g).float())
    sign = 1.0 if rank % 2 == 0 else -1.0
    return c * scale + sign * 1e4 * (rank < world - world % 2)


def linear_loss(model: nn.Module, kind: str, step: int, rank: int, world: int):
    terms = [(p.float() * grad_coefficients(p, kind, step, rank, world, i)).sum()
             for i, p in enumerate(model.parameters())]
    return torch.stack(terms).sum()


# ---------------------------------------------------------------- the parity grid's trajectory


@dataclass(frozen=True)
class ParityRun:
    """One point of the parity grid: how AwkwardLM is trained by distopt on this rank's slice of
    every global batch, while a single-process torch reference trains on the whole batch."""

    optimizer: str = "adamw"  # a PARITY_OPTIMIZERS name
    dtype: torch.dtype = torch.float32  # of the params; low precision: fp32 masters in the ref
    grad_dtype: torch.dtype = torch.float32
    fp32_accumulation: bool = False  # reduce_scatter_with_fp32_accumulation
    mesh: tuple[int, int] | None = None  # (replicate, shard); None: flat over every rank
    find_unused: bool = True  # else zero grads for unused params (set_to_none=False in the ref)
    overlap_grad: bool = True  # overlap_grad_reduce
    overlap_gather: bool = True  # overlap_param_gather
    groups: bool = True  # AwkwardLM's two param groups and a cosine schedule, else one group
    steps: int = PARITY_STEPS
    shard_grads: bool = False  # keep only the reduced grad shards between steps
    shard_params: bool = False  # keep only the param shards between uses
    reshard_after_forward: bool = True


@functools.cache
def reference_trajectory(optimizer: str, dtype: torch.dtype, groups: bool, find_unused: bool,
                         steps: int) -> tuple[tuple[dict[str, torch.Tensor], ...],
                                              tuple[float, ...]]:
    """The single-process torch reference of the parity grid: AwkwardLM's params (by name)
    and grad norm after each step of the whole batches. It depends on none of distopt's
    options, nor on the rank or the world size, so a test process trains each one once and
    every run of the grid that shares it compares against the same copy."""
    torch.manual_seed(0)
    ref = AwkwardLM().to(dtype)
    opt_cls, _, kwargs = PARITY_OPTIMIZERS[optimizer]
    trainable = [p for p in ref.parameters() if p.requires_grad]
    if dtype == torch.float32:
        masters = trainable  # the reference steps the params themselves
    else:  # the reference keeps fp32 master weights and casts them into the model each step
        masters = [nn.Parameter(p.detach().float()) for p in trainable]
    index = {p: i for i, p in enumerate(trainable)}
    ref_params = ([{**g, "params": [masters[index[p]] for p in g["params"]]}
                   for g in parity_groups(ref, optimizer)] if groups else masters)
    ref_opt = opt_cls(ref_params, **kwargs)
    sched = CosineAnnealingLR(ref_opt, T_max=steps) if groups else None
    params, norms = [], []
    for step in range(steps):
        tokens, targets = batches(step)
        ref_loss = lm_loss(ref, tokens, targets, step)
        if dtype == torch.float32:
            ref_opt.zero_grad(set_to_none=find_unused)
            ref_loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in trainable if p.grad is not None], CLIP)
            ref_opt.step()
        else:
            norm = fp32_master_step(trainable, masters, ref_opt, ref_loss)
        if sched is not None:
            sched.step()
        params.append(params_of(ref))
        norms.append(norm.item())
    return tuple(params), tuple(norms)


def parity_trajectory(run: ParityRun) -> dict:
    """Train ``run`` beside its reference (``reference_trajectory``); the largest difference of
    the params and of the grad norm seen after any step, and what the last step sent and each
    rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_params, ref_norms = reference_trajectory(run.optimizer, run.dtype, run.groups,
                                                 run.find_unused, run.steps)
    torch.manual_seed(0)
    model = AwkwardLM().to(run.dtype)
    initial = copy.deepcopy(model)
    opt_cls, _, kwargs = PARITY_OPTIMIZERS[run.optimizer]
    mesh = None if run.mesh is None else init_device_mesh(
        "cpu", run.mesh, mesh_dim_names=("dp_replicate", "dp_shard"))
    ddp = distopt.DistributedDataParallel(
        model, grad_dtype=run.grad_dtype, bucket_size=40, device_mesh=mesh,
        overlap_grad_reduce=run.overlap_grad, find_unused_parameters=run.find_unused,
        reduce_scatter_with_fp32_accumulation=run.fp32_accumulation,
        shard_grads=run.shard_grads, shard_params=run.shard_params,
        reshard_after_forward=run.reshard_after_forward,
    )
    params = parity_groups(model, run.optimizer) if run.groups else None
    opt = distopt.DistributedOptimizer(ddp, opt_cls, params=params, clip_grad=CLIP,
                                       overlap_param_gather=run.overlap_gather, **kwargs)
    sched = CosineAnnealingLR(opt, T_max=run.steps) if run.groups else None

    worst, worst_norm = 0.0, 0.0
    for step in range(run.steps):
        tokens, targets = batches(step)
        ddp.comm_stats.reset()
        opt.zero_grad()
        lm_loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world),
                step).backward()
        result = opt.step()
        calls, nbytes = dict(ddp.comm_stats.calls), dict(ddp.comm_stats.bytes)
        if sched is not None:
            sched.step()
        with ddp.gathered_params():  # sharded params: their full values, for the comparison
            worst = max(worst, max_diff(model, ref_params[step]))
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norms[step] - 1))
    with ddp.gathered_params():
        moved = max_diff(model, initial)
    return {
        "max_diff": worst, "norm_diff": worst_norm, "moved": moved,
        "dtypes": {p.dtype for p in model.parameters()},
        "calls": calls, "bytes": nbytes, "buckets": len(ddp.buckets),
        "fp32_buckets": sum(b.fp32_accumulation for b in ddp.buckets),
        "padded": sum(buf.layout.numel for buf in ddp.flat_buffers),
        "owned_padded": sum(b.owned_grad.numel() for b in ddp.buckets),
        "dp_size": ddp.dp_size, "report": distopt.measure_state_bytes(opt),
        "owned": sum(m.numel() for m in opt.main_params),
        "num_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def assert_within_adamw_drift(ends: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                              tol: float = FP32_TOL) -> None:
    """A run's params and AdamW state (keys ``param/``, ``exp_avg/``, ``exp_avg_sq/``,
    ``step/`` and a param's name) against a reference run's: within ``tol`` (AdamW's fp32 drift
    between two runs, FP32_TOL) on values of size about 1, and relative to its size on
    ``exp_avg_sq``, the square of grads of about 0.1, whose relative error is twice the grads'."""
    assert set(ends) == set(reference)
    for key, value in reference.items():
        diff = (ends[key].double() - value.double()).abs().max().item()
        scale = value.double().abs().max().item()
        bound = tol * max(scale, 1.0) if not key.startswith("exp_avg_sq") else 2 * tol * scale
        assert diff <= bound, (key, diff, scale)
