"""Loss scaling, skipped steps, inf/nan handling, grad statistics and autocast, d = 2 and 4.

Unit tests of the scaler rules run without processes. The distributed cases inject an inf or
nan into one element of one rank's grad (a tensor hook, so it enters before the bucket's
reduction) and check that every rank reaches the same decision. Trajectories are compared
with plain torch on the full batch, in the same process, as in test_parity.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import distopt
from distopt.optim import grad_stats as clip

from dist_harness import case_result, run_cases
from helpers import (
    BF16_U,
    FP16_U,
    FP32_TOL,
    FP32_U,
    NORM_RTOL,
    markov_loss,
    max_diff,
    same,
    snapshot,
    sum_tol,
    world_params,
)
from models import TT_USED, TT_VOCAB, TinyTransformer, markov_batch, mlp, rank_slice

# SGD does not amplify the roundoff of near-zero grads as Adam does: each of its 3 steps rounds a
# weight (below 2, where one fp32 ulp is 2**-23 = 2 * FP32_U) once, and the grads' roundoff, a
# few FP32_U of grads below 1, moves it by lr = 0.1 times that. Allow a few ulps a step.
SGD_TOL = 3 * 4 * 2 * FP32_U  # 1.4e-6
CLIP = 0.05  # below the grad norms of the first steps, so clipping really acts

# The scaler of the scripted test and the overflow (O) / good (G) series it sees.
SCRIPT_SCALER = dict(initial_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, hysteresis=2, min_scale=128.0)
SCRIPT = "OGGOGOOGGGOOOOGGGO"
# Worked out by hand from the rules in optim/loss_scalers.py: the scale after each step of SCRIPT.
#   1 O  hysteresis 2->1, keep 1024     10 G  3rd good step: grow to 256, hysteresis back to 2
#   4 O  hysteresis 1->0: 512 (good     11 O  hysteresis 2->1, keep 256
#        steps 2-3 did not refill it)   12 O  hysteresis 1->0: 128
#   6 O  512 -> 256; 7 O  256 -> 128    13-14 O  64 is below min_scale: stays 128
#   8-9 G  good steps 1 and 2           15-17 G  3 good steps: grow to 256;  18 O  keep 256
SCRIPT_SCALES = [1024, 1024, 1024, 512, 512, 256, 128, 128, 128, 256,
                 256, 128, 128, 128, 128, 128, 256, 256]


def _lr_lambda(update: int) -> float:
    return 1.0 / (1.0 + 0.2 * update)


# ---------------------------------------------------------------- unit tests (no processes)


def test_dynamic_scaler_follows_the_documented_rule():
    scaler = distopt.DynamicLossScaler(**SCRIPT_SCALER)
    scales = []
    for verdict in SCRIPT:
        scaler.update(verdict == "O")
        scales.append(scaler.scale)
    assert scales == SCRIPT_SCALES


def test_dynamic_scaler_defaults_and_state_round_trip():
    scaler = distopt.DynamicLossScaler()
    assert scaler.scale == 2.0**16
    scaler.update(True)
    assert scaler.scale == 2.0**16  # hysteresis=2: the first overflow is tolerated
    scaler.update(True)
    assert scaler.scale == 2.0**15
    for _ in range(999):
        scaler.update(False)
    assert scaler.scale == 2.0**15
    scaler.update(False)
    assert scaler.scale == 2.0**16  # growth after growth_interval=1000 good steps

    a = distopt.DynamicLossScaler(**SCRIPT_SCALER)
    for verdict in SCRIPT[:5]:
        a.update(verdict == "O")
    b = distopt.DynamicLossScaler(**SCRIPT_SCALER)
    b.load_state_dict(a.state_dict())
    rest_a, rest_b = [], []
    for verdict in SCRIPT[5:]:
        a.update(verdict == "O")
        b.update(verdict == "O")
        rest_a.append(a.scale)
        rest_b.append(b.scale)
    assert rest_a == rest_b == SCRIPT_SCALES[5:]


def test_constant_scaler_never_changes():
    scaler = distopt.ConstantLossScaler(256)
    for verdict in "OOGO":
        scaler.update(verdict == "O")
    assert scaler.scale == 256.0


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: distopt.ConstantLossScaler(0), ValueError, "scale must be positive"),
        (lambda: distopt.ConstantLossScaler(math.inf), ValueError, "finite"),
        (lambda: distopt.ConstantLossScaler("8"), TypeError, "scale must be a number"),
        (lambda: distopt.DynamicLossScaler(growth_factor=1.0), ValueError, "growth_factor"),
        (lambda: distopt.DynamicLossScaler(backoff_factor=1.5), ValueError, "backoff_factor"),
        (lambda: distopt.DynamicLossScaler(hysteresis=0), ValueError, "hysteresis"),
        (lambda: distopt.DynamicLossScaler(growth_interval=2.5), TypeError, "growth_interval"),
        (lambda: distopt.DynamicLossScaler(initial_scale=2, min_scale=4), ValueError,
         "min_scale"),
        (lambda: distopt.DynamicLossScaler(initial_scale=math.nan), ValueError, "initial_scale"),
    ],
)
def test_scaler_rejects_bad_settings(make, error, words):
    with pytest.raises(error, match=words):
        make()


def _unscale_and_check(grads: list[torch.Tensor], inv_scale: float) -> bool:
    cpu = torch.device("cpu")
    found_inf = clip.inf_flag(cpu)
    clip.unscale_(grads, found_inf, clip.inverse_scale(inv_scale, cpu))
    return clip.any_rank_found_inf(found_inf, [])


def test_unscale_and_check_on_cpu_fp32():
    grads = [torch.tensor([3.0, -6.0, 1e-30]), torch.tensor([2.0**20])]
    expected = [g / 1024 for g in grads]
    assert _unscale_and_check(grads, 1 / 1024) is False
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert grads[1].item() == 1024.0
    for bad in (math.inf, -math.inf, math.nan):
        grads = [torch.tensor([1.0, 2.0]), torch.tensor([0.5, bad, 4.0])]
        assert _unscale_and_check(grads, 0.5) is True
    assert _unscale_and_check([], 0.5) is False


def test_single_process_skip_changes_nothing():
    torch.manual_seed(0)
    model = mlp([4, 8, 3])
    opt = distopt.BasicOptimizer(model, torch.optim.AdamW, lr=0.1,
                                 loss_scaler=distopt.ConstantLossScaler(8.0))
    x = torch.randn(5, 4)
    for poison in (False, True):
        before = [p.detach().clone() for p in model.parameters()]
        state = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
        opt.zero_grad()
        loss = model(x).square().mean() * (math.inf if poison else 1.0)
        opt.scale_loss(loss).backward()
        result = opt.step()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                         strict=True))
        assert result.updated is (not poison)
        assert moved is (not poison)
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_dynamic_scaler_and_nan_check_are_refused_together():
    ddp = distopt.DistributedDataParallel(mlp([4, 3]), check_for_nan_in_grad=True)
    with pytest.raises(ValueError, match="check_for_nan_in_grad"):
        distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1,
                                     loss_scaler=distopt.DynamicLossScaler())
    with pytest.raises(TypeError, match="loss_scaler must be"):
        distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1, loss_scaler=2.0**16)


# ---------------------------------------------------------------- distributed case helpers


def _owner(ddp: distopt.DistributedDataParallel, param: nn.Parameter, index: int) -> int:
    """The DP rank whose shard holds element ``index`` of ``param`` after the reduction."""
    buf = ddp.buffer_of[param]
    slot = next(s for p, s in zip(buf.params, buf.layout.params, strict=True) if p is param)
    return (slot.bucket_range.start + index) // buf.layout.buckets[slot.bucket].shard_size


def _poison(param: nn.Parameter, index: int, value: float, on_rank: bool):
    """Set one element of the grad that this rank's backward computes for ``param``."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[index] = value
        return grad

    return param.register_hook(hook) if on_rank else None


def _full_loss(model: TinyTransformer, step: int) -> torch.Tensor:
    return model.loss(*markov_batch(step))


# ---------------------------------------------------------------- distributed cases


def scripted_skips(bad_value: float) -> dict:
    """SCRIPT's O steps get ``bad_value`` in one element of one rank's grad; the run must equal
    plain torch trained on the G steps only, with the LR scheduler stepped per update."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=5000)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
        loss_scaler=distopt.DynamicLossScaler(**SCRIPT_SCALER),
    )
    sched = LambdaLR(opt, _lr_lambda)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = LambdaLR(ref_opt, _lr_lambda)
    params = list(model.parameters())

    scales, updated, unchanged, owners_differ, worst, worst_norm = [], [], [], 0, 0.0, 0.0
    for step, verdict in enumerate(SCRIPT):
        handle = None
        if verdict == "O":
            param = params[(7 * step) % len(params)]
            index = (131 * step) % param.numel()
            owner = _owner(ddp, param, index)
            injector = owner if step % 2 else (owner + 1) % world
            owners_differ += injector != owner
            handle = _poison(param, index, bad_value, rank == injector)
        before = snapshot(ddp, opt)
        opt.zero_grad()
        opt.scale_loss(markov_loss(ddp, step, rank, world)).backward()
        result = opt.step()
        if handle is not None:
            handle.remove()
        if result.updated:
            sched.step()  # the recipe of docs/mixed-precision.md: schedule per update
        scales.append(opt.loss_scaler.scale)
        updated.append(result.updated)
        if verdict == "O":
            unchanged.append(same(before, snapshot(ddp, opt))
                             and result.grad_norm is None and result.num_zeros is None)
            continue
        ref_opt.zero_grad()
        _full_loss(ref, step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_sched.step()
        ddp.finish_param_sync()
        worst = max(worst, max_diff(model, ref))
        worst_norm = max(worst_norm, abs(result.grad_norm / ref_norm.item() - 1))
    steps = {int(s["step"]) for s in opt.state.values()}
    return {"scales": scales, "updated": updated, "unchanged": unchanged,
            "owners_differ": owners_differ, "max_diff": worst, "norm_diff": worst_norm,
            "steps": steps, "lr": opt.param_groups[0]["lr"],
            "ref_lr": ref_opt.param_groups[0]["lr"]}


def fp16_reduction_overflow(grad_dtype: torch.dtype | None) -> dict:
    """Every rank's grad holds 40000 (finite in fp16); their fp16 sum does not fit."""
    torch.manual_seed(0)
    model = mlp([8, 16, 4], dtype=torch.float16)
    # Reduce in step(), so that the local grads can be looked at before.
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, overlap_grad_reduce=False)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=1e-3,
                                       loss_scaler=distopt.ConstantLossScaler(1.0))
    weight = model[0].weight
    handle = _poison(weight, 5, 40000.0, True)
    before = snapshot(ddp, opt)
    opt.zero_grad()
    model_in = torch.randn(4, 8, dtype=torch.float16)
    opt.scale_loss(ddp(model_in).float().mean()).backward()
    local_finite = bool(torch.isfinite(weight.main_grad).all()) and weight.main_grad.max() > 3e4
    result = opt.step()
    handle.remove()
    return {"updated": result.updated, "unchanged": same(before, snapshot(ddp, opt)),
            "local_finite": local_finite}


def nan_check(param_dtype: torch.dtype) -> dict:
    """check_for_nan_in_grad names the first bad param in registration order and the rank
    whose backward produced it, on every rank; a sum that overflows only in the reduction is
    named as such; the next clean step trains normally."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer().to(param_dtype)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=None, bucket_size=5000,
                                          check_for_nan_in_grad=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2, clip_grad=1.0)
    fc1, head = model.blocks[1].fc1.weight, model.head.weight
    plans = [
        [(head, 7, math.inf, 0), (fc1, 100, math.nan, world - 1)],  # fc1 registered first
        [(head, 300, -math.inf, world - 1)],
        [(head, 5, 3e38, None)],  # finite on every rank; the sum of d of them is not
        [],
    ]
    messages, unchanged, updated = [], [], []
    for step, plan in enumerate(plans):
        handles = [_poison(p, i, v, r is None or rank == r) for p, i, v, r in plan]
        before = snapshot(ddp, opt)
        opt.zero_grad()
        markov_loss(ddp, step, rank, world).backward()
        try:
            updated.append(opt.step().updated)
            messages.append(None)
        except FloatingPointError as error:
            messages.append(str(error))
        for h in handles:
            if h is not None:
                h.remove()
        unchanged.append(same(before, snapshot(ddp, opt)))
    return {"messages": messages, "unchanged": unchanged, "updated": updated}


def norm_and_zeros(scale: float | None) -> dict:
    """grad_norm and num_zeros against plain torch on the full batch's unsharded grads; the
    embedding rows of unused tokens have grads that are exactly zero."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=3000)
    scaler = None if scale is None else distopt.ConstantLossScaler(scale)
    # SGD is linear in the grads, so the weights show any error in the clipped grads as is.
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, clip_grad=CLIP, lr=0.1,
                                       momentum=0.9, log_num_zeros=True, loss_scaler=scaler)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows, small_reductions = [], []
    for step in range(3):
        opt.zero_grad()
        ddp.comm_stats.reset()
        opt.scale_loss(markov_loss(ddp, step, rank, world)).backward()
        result = opt.step()
        small_reductions.append(ddp.comm_stats.calls["all_reduce_small"])
        ref_opt.zero_grad()
        _full_loss(ref, step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        ref_zeros = sum(int((p.grad == 0).sum()) for p in ref.parameters())
        ref_opt.step()
        unseen = TT_VOCAB - len(markov_batch(step)[0].unique())  # embedding rows with zero grad
        rows.append((result.grad_norm, ref_norm, result.num_zeros, ref_zeros, unseen))
    ddp.finish_param_sync()
    split = sum(1 for p in model.parameters()
                if len({_owner(ddp, p, 0), _owner(ddp, p, p.numel() - 1)}) > 1)
    return {"rows": rows, "max_diff": max_diff(model, ref), "split_params": split,
            "small_reductions": small_reductions}


def grad_dtype_paths(param_dtype: torch.dtype, grad_dtype: torch.dtype) -> dict:
    """fp32 grads: main grads are views of the reduced buffer; other dtypes: reduced in that
    dtype, then copied once into fp32 main grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer().to(param_dtype)
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=5000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.0)
    opt.zero_grad()
    ddp.comm_stats.reset()
    markov_loss(ddp, 0, rank, world).backward()
    opt.step()
    # The average of every rank's grads, as each rank's backward computes it, summed in fp64.
    expected = {p: torch.zeros(p.shape, dtype=torch.float64) for p in ref.parameters()}
    magnitude = {p: torch.zeros(p.shape, dtype=torch.float64) for p in ref.parameters()}
    for r in range(world):
        ref.zero_grad()
        markov_loss(ref, 0, r, world).backward()
        for p in ref.parameters():
            expected[p] += p.grad.to(torch.float64) / world
            magnitude[p] += p.grad.to(torch.float64).abs() / world
    expected_of = dict(zip(model.parameters(), expected.values(), strict=True))
    magnitude_of = dict(zip(model.parameters(), magnitude.values(), strict=True))
    grad_storages = {buf.grad_data.untyped_storage().data_ptr() for buf in ddp.flat_buffers}
    views, dtypes, exact_copy, worst_rel = 0, set(), True, 0.0
    for main in opt.main_params:
        param, piece = opt.piece_info(main)
        main_grad = opt.main_grad(main)
        views += main_grad.untyped_storage().data_ptr() in grad_storages
        dtypes.add(main_grad.dtype)
        lo, hi = piece.param_range.start, piece.param_range.end
        reduced = param.main_grad.reshape(-1)[lo:hi]
        exact_copy &= torch.equal(main_grad, reduced.float())
        want = expected_of[param].reshape(-1)[lo:hi]
        # Rounding errors of a sum scale with its terms, not with the result.
        size = magnitude_of[param].reshape(-1)[lo:hi].max()
        worst_rel = max(worst_rel, ((main_grad.double() - want).abs().max() / size).item())
    padded = sum(buf.layout.numel for buf in ddp.flat_buffers)
    return {"views": views, "pieces": len(opt.main_params), "dtypes": dtypes,
            "exact_copy": exact_copy, "worst_rel": worst_rel,
            "rs_bytes": ddp.comm_stats.bytes["reduce_scatter"],
            "expected_rs_bytes": padded * grad_dtype.itemsize if world > 1 else 0}


def model_parallel_group() -> dict:
    """d = 4 as 2 model parts x 2 data-parallel replicas. Part A (ranks 0, 1) and part B
    (ranks 2, 3) are separate models with one joint clip; an inf in part B's grads on rank 3
    must skip the step of part A too. Without the group, part A would step."""
    rank = dist.get_rank()
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    part, dp_rank = divmod(rank, 2)
    dp_group, mp_group = dp_groups[part], mp_groups[dp_rank]
    errors = []
    probe = distopt.DistributedDataParallel(mlp([2, 2]), process_group=dp_group)
    for bad in (dp_group, "group"):
        try:
            distopt.DistributedOptimizer(probe, torch.optim.SGD, lr=0.1, model_parallel_group=bad)
        except (TypeError, ValueError) as error:
            errors.append(type(error).__name__)

    torch.manual_seed(0)
    parts = [TinyTransformer(), TinyTransformer()]  # both seeded here, identical on all ranks
    refs = copy.deepcopy(parts)
    inf_step = 2
    out = {"errors": errors}
    for use_group in (True, False):
        model = copy.deepcopy(parts[part])
        ddp = distopt.DistributedDataParallel(model, process_group=dp_group, bucket_size=5000)
        opt = distopt.DistributedOptimizer(
            ddp, torch.optim.AdamW, clip_grad=CLIP, lr=1e-2,
            loss_scaler=distopt.ConstantLossScaler(64.0),
            model_parallel_group=mp_group if use_group else None,
        )
        ref_params = [p for r in refs for p in r.parameters()] if use_group else None
        ref_opt = torch.optim.AdamW(ref_params, lr=1e-2) if use_group else None
        updated, norms, worst = [], [], 0.0
        for step in range(4 if use_group else inf_step + 1):
            handle = None
            if step == inf_step:
                handle = _poison(model.blocks[0].qkv.weight, 9, math.inf, rank == 3)
            opt.zero_grad()
            ddp.comm_stats.reset()
            opt.scale_loss(markov_loss(ddp, step, dp_rank, 2)).backward()
            result = opt.step()
            if handle is not None:
                handle.remove()
            if use_group and step == 0:
                out["small_reductions"] = ddp.comm_stats.calls["all_reduce_small"]
            updated.append(result.updated)
            norms.append(result.grad_norm)
            if use_group and step != inf_step:
                ref_opt.zero_grad()
                for r in refs:
                    _full_loss(r, step).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, CLIP).item()
                ref_opt.step()
                norms[-1] = (result.grad_norm, ref_norm)
                ddp.finish_param_sync()
                worst = max(worst, max_diff(model, refs[part]))
        if use_group:
            out.update(updated=updated, norms=norms, max_diff=worst)
        else:
            part_norm = []
            for r in copy.deepcopy(parts):
                _full_loss(r, 0).backward()
                part_norm.append(torch.nn.utils.get_total_norm(
                    [p.grad for p in r.parameters()]).item())
            out.update(updated_without=updated, norm_without=norms[0],
                       part_norm=part_norm[part])
    return out


def autocast_parity() -> dict:
    """fp32 params, bf16 compute under torch.autocast. At every step the reduced fp32 grads of
    each shard must equal those of plain torch under autocast, run from the same weights on the
    same per-rank micro-batches. (Whole trajectories are not compared: a one-ulp difference in
    an fp32 weight flips a bf16 rounding, and bf16 compute amplifies it.)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    initial = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(model, bucket_size=5000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2,
                                       overlap_param_gather=True)
    logits_dtypes, worst, losses = set(), 0.0, []
    for step in range(6):
        ddp.finish_param_sync()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters(), strict=True):
                p.copy_(q)
        ref.zero_grad()
        for r in range(world):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = markov_loss(ref, step, r, world)
            ref_loss.backward()
        ref_grads = [p.grad / world for p in ref.parameters()]
        scale = max(g.abs().max().item() for g in ref_grads)

        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tokens, targets = markov_batch(step)
            logits = ddp(rank_slice(tokens, rank, world))
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                               rank_slice(targets, rank, world).flatten())
        logits_dtypes.add(logits.dtype)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        index = {p: i for i, p in enumerate(model.parameters())}
        for main in opt.main_params:  # no clipping: .grad still holds the reduced grads
            param, piece = opt.piece_info(main)
            want = ref_grads[index[param]].reshape(-1)[piece.param_range.start:
                                                       piece.param_range.end]
            worst = max(worst, (opt.main_grad(main) - want).abs().max().item() / scale)
    ddp.finish_param_sync()
    return {"logits_dtypes": logits_dtypes, "grad_rel_diff": worst,
            "param_dtypes": {p.dtype for p in model.parameters()},
            "moved": max_diff(model, initial), "losses": losses}


def _cases(world: int) -> list:
    cases = [
        ("scripted-inf", scripted_skips, (math.inf,)),
        ("scripted-nan", scripted_skips, (math.nan,)),
        ("fp16-reduce-fp16", fp16_reduction_overflow, (None,)),
        ("fp16-reduce-fp32", fp16_reduction_overflow, (torch.float32,)),
        ("nan-check-fp32", nan_check, (torch.float32,)),
        ("nan-check-bf16", nan_check, (torch.bfloat16,)),
        ("norm-zeros", norm_and_zeros, (None,)),
        ("norm-zeros-scaled", norm_and_zeros, (2.0**12,)),
        ("autocast", autocast_parity, ()),
    ]
    for pd, gd in GRAD_PATHS:
        cases.append((f"grad-path-{pd}-{gd}", grad_dtype_paths, (pd, gd)))
    if world == 4:
        cases.append(("model-parallel", model_parallel_group, ()))
    return cases


GRAD_PATHS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]
WORLDS = [2, 4]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases(request.param))


@pytest.mark.parametrize("case", ["scripted-inf", "scripted-nan"])
def test_overflow_skips_on_every_rank_and_follows_the_scale_rule(world, case):
    d, results = world
    values = case_result(results, case)
    overflow = [v == "O" for v in SCRIPT]
    for value in values:
        assert value["scales"] == SCRIPT_SCALES
        assert value["updated"] == [not o for o in overflow]
        assert value["unchanged"] == [True] * sum(overflow)
        assert value["steps"] == {SCRIPT.count("G")}  # skipped steps count no optimizer step
        assert value["lr"] == pytest.approx(value["ref_lr"], rel=1e-12)
        assert value["max_diff"] <= FP32_TOL, value
        assert value["norm_diff"] <= NORM_RTOL, value
    # Half the overflows came from a rank that does not own the bad element: it learned of
    # them only through the all-reduced flag.
    assert values[0]["owners_differ"] == sum(overflow) // 2


def test_fp16_reduction_overflow_is_caught(world):
    _, results = world
    for value in case_result(results, "fp16-reduce-fp16"):
        assert value["local_finite"]
        assert value["updated"] is False
        assert value["unchanged"]
    for value in case_result(results, "fp16-reduce-fp32"):
        assert value["local_finite"]
        assert value["updated"] is True  # the same grads reduced in fp32 fit
        assert not value["unchanged"]


@pytest.mark.parametrize("case", ["nan-check-fp32", "nan-check-bf16"])
def test_nan_check_names_the_parameter_on_every_rank(world, case):
    d, results = world
    for value in case_result(results, case):
        first, second, overflow, clean = value["messages"]
        assert f"parameter 'blocks.1.fc1.weight' produced on rank {d - 1} " in first
        assert f"parameter 'head.weight' produced on rank {d - 1} " in second
        assert ("parameter 'head.weight' after the data-parallel reduction, though every "
                "rank's own gradient was finite") in overflow
        assert clean is None
        assert value["updated"] == [True]
        assert value["unchanged"] == [True, True, True, False]


@pytest.mark.parametrize("case", ["norm-zeros", "norm-zeros-scaled"])
def test_grad_norm_and_num_zeros_match_unsharded_torch(world, case):
    _, results = world
    dim = TinyTransformer().tok.embedding_dim
    for value in case_result(results, case):
        assert value["split_params"] >= 2  # some params really are cut between ranks
        assert value["max_diff"] <= SGD_TOL, value
        # One all-reduce each for the inf flag (with a scaler), the norm and the zero count.
        assert value["small_reductions"] == [3 if case.endswith("scaled") else 2] * 3
        for norm, ref_norm, zeros, ref_zeros, unseen in value["rows"]:
            assert norm == pytest.approx(ref_norm, rel=NORM_RTOL)
            assert ref_norm > CLIP  # clipping acted: the zeros counted are of clipped grads
            assert zeros == ref_zeros
            # The only zero grads are the embedding rows of tokens absent from the batch.
            assert unseen >= TT_VOCAB - TT_USED
            assert ref_zeros == unseen * dim


@pytest.mark.parametrize("param_dtype,grad_dtype", GRAD_PATHS)
def test_grad_dtype_paths(world, param_dtype, grad_dtype):
    _, results = world
    # Relative to the terms' size: fp32, d - 1 additions in another order (sum_tol, d <= 4);
    # bf16/fp16 grads are rounded once per rank and once per sum of the reduction: 4 u.
    rel = {torch.float32: sum_tol(4, 1.0), torch.bfloat16: 4 * BF16_U,
           torch.float16: 4 * FP16_U}[grad_dtype]
    for value in case_result(results, f"grad-path-{param_dtype}-{grad_dtype}"):
        assert value["dtypes"] == {torch.float32}
        assert value["views"] == (value["pieces"] if grad_dtype == torch.float32 else 0)
        assert value["exact_copy"]
        assert value["worst_rel"] <= rel, value
        assert value["rs_bytes"] == value["expected_rs_bytes"]


def test_model_parallel_group_shares_the_skip_and_the_norm(world):
    d, results = world
    if d != 4:
        pytest.skip("2 model parts x 2 replicas need 4 ranks")
    for rank, value in enumerate(case_result(results, "model-parallel")):
        assert value["errors"] == ["ValueError", "TypeError"]
        assert value["small_reductions"] == 4  # the inf flag and the norm, over both groups
        assert value["updated"] == [True, True, False, True]
        assert value["max_diff"] <= FP32_TOL, value
        for step, pair in enumerate(value["norms"]):
            if step == 2:
                assert pair is None
            else:
                assert pair[0] == pytest.approx(pair[1], rel=NORM_RTOL)
        # Without the group, part A (ranks 0, 1) never hears of part B's inf, and its norm
        # is its own part's only.
        assert value["updated_without"] == [True, True, rank < 2]
        assert value["norm_without"] == pytest.approx(value["part_norm"], rel=NORM_RTOL)


def test_autocast_matches_plain_torch_autocast(world):
    _, results = world
    for value in case_result(results, "autocast"):
        assert value["logits_dtypes"] == {torch.bfloat16}
        assert value["param_dtypes"] == {torch.float32}
        # The same bf16 products on both sides; only the fp32 sums over ranks may differ: d - 1
        # additions in another order, within sum_tol(d, size of the ranks' terms) = 6 FP32_U at
        # d = 4; measured against the largest grad, allow terms up to three times that.
        assert value["grad_rel_diff"] <= sum_tol(4, 3.0), value
        assert value["moved"] > 1e-2
        assert value["losses"][-1] < value["losses"][0] - 0.1  # it trains
