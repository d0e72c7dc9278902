"""torch's own training-loop patterns under distopt: exact, or refused on every rank.

``torch.amp.GradScaler`` steps a distopt optimizer through torch's protocol for optimizers that
unscale themselves ([Note: torch's GradScaler] in optim/amp.py): the run must follow the same
recipe under plain torch (one process, the ranks' micro-batches accumulated and averaged as
torch DDP averages them), skip an inf that only one rank's shard holds on every rank, move the
scale as torch moves it, and end bit for bit where distopt's own DynamicLossScaler with the same
rules ends; torch's recipe for clipping, ``scaler.unscale_(opt)`` then
``clip_grad_norm_(model.parameters())``, clips the unscaled grads. torch's grad utilities on the
model's params (``clip_grad_norm_``, ``clip_grad_value_``, ``get_total_norm``) read the reduced
grads, agreeing with the optimizer's own ``clip_grad=`` norm, while a read of ``p.grad`` that
needs the whole tensor raises one error naming what works ([Note: p.grad under distopt] in
ddp/grads/grad_marker.py), and a ``zero_grad()`` of the model itself zeroes a step's grads as
``opt.zero_grad()`` does.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import distopt

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, NORM_RTOL, markov_loss, max_diff, same, snapshot, world_params
from models import TinyTransformer, markov_batch, mlp

LR = 1e-2  # AdamW: within helpers.FP32_TOL, the drift of its fp32 roundoff
CLIP = 0.05  # below the grad norms of the first steps, so clipping acts
STEPS = 20
# torch's GradScaler settings, and distopt's DynamicLossScaler with the same rules.
SCALER = dict(init_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
DISTOPT_SCALER = dict(initial_scale=2.0**12, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=4, hysteresis=1, min_scale=2.0**-24)
# Steps whose grads get an inf in one element on one rank: by the rank whose shard holds the
# element after the reduction, or by another one (the owner then sees the inf, the injector
# does not).
POISONED = {6: "owner", 13: "other"}


def _owner(ddp: distopt.DistributedDataParallel, param: nn.Parameter, index: int) -> int:
    """The DP rank whose shard holds element ``index`` of ``param`` after the reduction."""
    buf = ddp.buffer_of[param]
    slot = next(s for p, s in zip(buf.params, buf.layout.params, strict=True) if p is param)
    return (slot.bucket_range.start + index) // buf.layout.buckets[slot.bucket].shard_size


def _poison_hook(index: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad

    return hook


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------- distributed cases


def grad_scaler_run(kind: str) -> dict:
    """fp16 autocast on fp32 params for STEPS steps, scaled by torch.amp.GradScaler (``step``:
    scaler.step(opt); ``unscale-clip``: scaler.unscale_(opt) first, clip_grad= clipping;
    ``unscale-torch-clip``: scaler.unscale_(opt), then torch's clip_grad_norm_ on the model's
    params, torch's recipe; ``basic``: BasicOptimizer over all-reduced grads) or by distopt's
    DynamicLossScaler (``distopt-scaler``), against the same recipe under plain torch on one
    process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    clip = CLIP if kind.startswith("unscale") else None
    torch_clip = kind == "unscale-torch-clip"
    if kind == "basic":
        ddp = distopt.DistributedDataParallel(model, bucket_size=5000,
                                              use_distributed_optimizer=False)
        opt = distopt.BasicOptimizer(ddp, torch.optim.AdamW, lr=LR)
    else:
        ddp = distopt.DistributedDataParallel(model, bucket_size=5000)
        loss_scaler = (distopt.DynamicLossScaler(**DISTOPT_SCALER)
                       if kind == "distopt-scaler" else None)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR,
                                           clip_grad=None if torch_clip else clip,
                                           loss_scaler=loss_scaler)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER)
    params, ref_params = list(model.parameters()), list(ref.parameters())

    out = {"scales": [], "ref_scales": [], "updated": [], "ref_updated": [], "unchanged": [],
           "max_diff": 0.0, "owner_is_injector": [], "norms": [], "ref_norms": []}
    for step in range(STEPS):
        handle = poison = None
        if step in POISONED:
            which = (7 * step) % len(params)
            index = (131 * step) % params[which].numel()
            owner = 0 if kind == "basic" else _owner(ddp, params[which], index)
            injector = owner if POISONED[step] == "owner" else (owner + 1) % world
            out["owner_is_injector"].append(owner == injector)
            poison = (which, index)
            if rank == injector:
                handle = params[which].register_hook(_poison_hook(index))
        before = snapshot(ddp, opt)
        # fp16 compute amplifies a one-ulp weight difference step after step (the clip norm
        # summed in another order, the average over 3 ranks rounded otherwise): the reference
        # starts each step from distopt's weights, so that each step's update is compared.
        ddp.finish_param_sync()
        with torch.no_grad():
            for p, q in zip(ref_params, params, strict=True):
                p.copy_(q)

        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = markov_loss(ddp, step, rank, world)
        if kind == "distopt-scaler":
            opt.scale_loss(loss).backward()
            result = opt.step()
        else:
            scaler.scale(loss).backward()
            if kind.startswith("unscale"):
                scaler.unscale_(opt)
            if torch_clip:
                out["norms"].append(nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            result = scaler.step(opt)
            scaler.update()
        if handle is not None:
            handle.remove()
        out["updated"].append(result.updated)
        out["scales"].append(opt.loss_scaler.scale if kind == "distopt-scaler"
                             else scaler.get_scale())
        if poison is not None:
            out["unchanged"].append(same(before, snapshot(ddp, opt)))

        if kind == "distopt-scaler":
            continue  # compared with the GradScaler run, bit for bit
        # The reference: every rank's micro-batch on this process, averaged as DDP averages.
        ref_opt.zero_grad()
        for r in range(world):
            with torch.autocast("cpu", dtype=torch.float16):
                ref_loss = markov_loss(ref, step, r, world)
            ref_scaler.scale(ref_loss).backward()
        for p in ref_params:
            p.grad /= world
        if poison is not None:
            ref_params[poison[0]].grad.view(-1)[poison[1]] = float("inf")
        if clip is not None:
            ref_scaler.unscale_(ref_opt)
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref_params, clip).item())
        scale_before = ref_scaler.get_scale()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        out["ref_scales"].append(ref_scaler.get_scale())
        out["ref_updated"].append(not ref_scaler.get_scale() < scale_before)
        ddp.finish_param_sync()
        out["max_diff"] = max(out["max_diff"], max_diff(model, ref))
    out["params"] = _flat(model)
    out["steps"] = {int(s["step"]) for s in opt.state.values()}
    return out


def grad_utilities_and_clip_grad(shard_grads: bool) -> dict:
    """torch's grad utilities on the model's params between backward and step read the reduced
    grads (``clip_grad_norm_`` with a bound it does not reach, so that it changes nothing),
    the step's own ``clip_grad=`` clips after them and reports the same global norm, and a read
    that needs the whole tensor raises on this rank, naming what works, while the run goes on
    (nothing was left half-communicated)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ddp = distopt.DistributedDataParallel(model, bucket_size=5000, shard_grads=shard_grads)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1, clip_grad=CLIP)
    opt.zero_grad()
    markov_loss(ddp, 0, rank, world).backward()
    have_grad = all(p.grad is not None for p in model.parameters())
    norms = {
        "clip_grad_norm_": nn.utils.clip_grad_norm_(model.parameters(), 1e9).item(),
        "get_total_norm": nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]).item(),
    }
    nn.utils.clip_grad_value_(model.parameters(), 1e9)  # changes nothing
    try:
        model.head.weight.grad.abs().max().item()
        refused = None
    except RuntimeError as error:
        refused = str(error)
    result = opt.step()
    return {"norms": norms, "refused": refused, "have_grad": have_grad,
            "updated": result.updated, "norm": result.grad_norm}


def zero_grad_ways(way: str) -> torch.Tensor:
    """Three steps of two micro-batches, the grads zeroed before each step by ``way``: the
    params at the end (equal, bit for bit, whichever way)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ddp = distopt.DistributedDataParallel(model, bucket_size=5000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    zero = {
        "optimizer": opt.zero_grad,
        "ddp": ddp.zero_grad,
        "module": model.zero_grad,
        "module-keep": lambda: model.zero_grad(set_to_none=False),
    }[way]
    for step in range(3):
        zero()
        with ddp.no_sync():
            markov_loss(ddp, 2 * step, rank, world).backward()
        markov_loss(ddp, 2 * step + 1, rank, world).backward()
        opt.step()
    ddp.finish_param_sync()
    return _flat(model)


def grad_readers_written_distopts_way(shard_grads: bool) -> dict:
    """What torch users read off p.grad, the distopt way: clip_grad_value= as torch's
    clip_grad_value_ on the averaged grads, and log_grad_norms= as each p.grad.norm() after
    it, against plain torch on the whole batch (with clip_grad_norm_ after both)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ddp = distopt.DistributedDataParallel(model, bucket_size=5000, shard_grads=shard_grads)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=LR, clip_grad=CLIP,
                                       clip_grad_value=0.02, log_grad_norms=True)
    worst_norm, clamped = 0.0, 0
    def loss(forward, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(forward(tokens).float().flatten(0, 1),
                                           targets.flatten())

    for step in range(4):
        tokens, targets = markov_batch(step, global_batch=12)  # divides by 1, 2 and 3
        per = 12 // world
        opt.zero_grad()
        loss(ddp, tokens[rank * per:(rank + 1) * per],
             targets[rank * per:(rank + 1) * per]).backward()
        result = opt.step()
        ref_opt.zero_grad()
        loss(ref, tokens, targets).backward()
        clamped += sum(int((p.grad.abs() > 0.02).sum()) for p in ref.parameters())
        nn.utils.clip_grad_value_(ref.parameters(), 0.02)
        norms = {n: p.grad.norm().item() for n, p in ref.named_parameters()}
        nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        assert result.grad_norms is not None and result.grad_norms.keys() == norms.keys()
        worst_norm = max(worst_norm, *(abs(result.grad_norms[n] - v) / max(v, 1e-12)
                                       for n, v in norms.items() if v > 1e-6))
    ddp.finish_param_sync()
    return {"norm_rtol": worst_norm, "clamped": clamped,
            "max_diff": max_diff(model, ref)}


KINDS = ["step", "unscale-clip", "unscale-torch-clip", "basic", "distopt-scaler"]
ZERO_WAYS = ["optimizer", "ddp", "module", "module-keep"]


def _cases() -> list:
    cases = [(f"scaler-{kind}", grad_scaler_run, (kind,)) for kind in KINDS]
    cases += [(f"utilities-{s}", grad_utilities_and_clip_grad, (s,)) for s in (False, True)]
    cases += [(f"zero-{way}", zero_grad_ways, (way,)) for way in ZERO_WAYS]
    cases += [(f"readers-{s}", grad_readers_written_distopts_way, (s,)) for s in (False, True)]
    return cases


@pytest.fixture(scope="module", params=world_params([1, 2, 3]))
def world(request):
    return request.param, run_cases(request.param, _cases())


@pytest.mark.parametrize("kind", ["step", "unscale-clip", "unscale-torch-clip", "basic"])
def test_torch_grad_scaler_follows_plain_torch(world, kind):
    d, results = world
    skipped = [step in POISONED for step in range(STEPS)]
    for value in case_result(results, f"scaler-{kind}"):
        # The inf steps are skipped on every rank, and only they.
        assert value["updated"] == [not s for s in skipped]
        assert value["ref_updated"] == value["updated"]
        assert value["unchanged"] == [True] * len(POISONED)
        # The scale moves as torch's: halved at each inf, doubled after 4 good steps.
        assert value["scales"] == value["ref_scales"]
        assert value["scales"][6] == value["scales"][5] / 2
        assert max(value["scales"]) > SCALER["init_scale"]  # it grew too
        assert value["steps"] == {STEPS - len(POISONED)}
        assert value["max_diff"] <= FP32_TOL, value["max_diff"]
        if kind == "unscale-torch-clip":
            # clip_grad_norm_ read the unscaled grads: torch's norms (inf at the inf steps),
            # to the fp32 rounding of sums in another order (of grads averaged otherwise).
            for step, (ours, theirs) in enumerate(zip(value["norms"], value["ref_norms"],
                                                      strict=True)):
                assert (ours == theirs == math.inf) == skipped[step], step
                assert ours == pytest.approx(theirs, rel=1e-5), step
    if d > 1 and kind != "basic":
        # One inf came from a rank that does not hold the element: only the owner saw it.
        assert case_result(results, f"scaler-{kind}")[0]["owner_is_injector"] == [True, False]


def test_torch_grad_scaler_is_bitwise_distopts_scaler(world):
    _, results = world
    torch_runs = case_result(results, "scaler-step")
    distopt_runs = case_result(results, "scaler-distopt-scaler")
    for a, b in zip(torch_runs, distopt_runs, strict=True):
        assert a["scales"] == b["scales"]
        assert a["updated"] == b["updated"]
        assert torch.equal(a["params"], b["params"])


@pytest.mark.parametrize("shard_grads", [False, True])
def test_torch_grad_utilities_read_what_clip_grad_clips(world, shard_grads):
    _, results = world
    values = case_result(results, f"utilities-{shard_grads}")
    for value in values:
        assert value["have_grad"]
        # torch's utilities and the optimizer's clip_grad= take one global norm (to the
        # rounding of one fp32 sum of squares in another order), the same on every rank.
        for norm in value["norms"].values():
            assert norm == pytest.approx(value["norm"], rel=1e-6)
        assert value["norms"] == values[0]["norms"]
        assert value["updated"] and value["norm"] > CLIP
        message = value["refused"]
        assert message.startswith("p.grad of parameter 'head.weight' cannot be used by aten.")
        assert "clip_grad_norm_" in message and "clip_grad=" in message


def test_zero_grad_of_the_model_is_opt_zero_grad(world):
    _, results = world
    for rank_values in zip(*(case_result(results, f"zero-{w}") for w in ZERO_WAYS),
                           strict=True):
        reference = rank_values[0]
        for way, params in zip(ZERO_WAYS[1:], rank_values[1:], strict=True):
            assert torch.equal(params, reference), way


# ---------------------------------------------------------------- one process


def _trained_once() -> tuple[nn.Sequential, distopt.DistributedDataParallel,
                             distopt.DistributedOptimizer]:
    torch.manual_seed(0)
    model = mlp([4, 8, 2])
    ddp = distopt.DistributedDataParallel(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    opt.zero_grad()
    ddp(torch.randn(3, 4)).sum().backward()
    return model, ddp, opt


def test_clearing_some_grads_but_not_others_raises():
    model, ddp, opt = _trained_once()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match=r"'0\.weight' was cleared .* zero_grad\(\)"):
        ddp(torch.randn(3, 4)).sum().backward()
    opt.zero_grad()
    ddp(torch.randn(3, 4)).sum().backward()
    assert opt.step().updated


def test_marker_prints_copies_and_zeroes():
    model, ddp, opt = _trained_once()
    marker = model[0].weight.grad
    assert "0.weight" in repr(marker) and tuple(marker.shape) == (8, 4)
    copied = copy.deepcopy(model)
    assert all(p.grad is None for p in copied.parameters())
    assert opt.step().updated
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_grad_scaler_and_loss_scaler_together_are_refused():
    torch.manual_seed(0)
    ddp = distopt.DistributedDataParallel(mlp([4, 2]))
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1,
                                       loss_scaler=distopt.DynamicLossScaler())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(ddp(torch.randn(3, 4)).sum()).backward()
    with pytest.raises(ValueError, match="use one of the two"):
        scaler.step(opt)


def test_main_params_have_no_grad_outside_the_step():
    """So GradScaler.unscale_ (or anything iterating the optimizer's params) cannot act on
    grads that are not reduced yet; the step gives them their grads while it runs."""
    model, ddp, opt = _trained_once()
    assert all(m.grad is None for m in opt.main_params)
    seen = []
    hook = register_optimizer_step_post_hook(
        lambda o, *_: seen.append(all(m.grad is not None for m in opt.main_params)))
    try:
        opt.step()
    finally:
        hook.remove()
    # The inner optimizer stepped on the exposed grads; distopt's own step ended without them.
    assert seen == [True, False]
    assert all(m.grad is None for m in opt.main_params)
    assert all(opt.main_grad(m) is not None for m in opt.main_params)


@pytest.mark.parametrize("shard_grads", [False, True])
def test_clip_grad_value_and_per_param_norms_as_torch(world, shard_grads):
    for value in case_result(world[1], f"readers-{shard_grads}"):
        assert value["clamped"] > 0  # the bound acts
        # Each param's grad norm, at weights within FP32_TOL: as the total's.
        assert value["norm_rtol"] <= NORM_RTOL, value
        assert value["max_diff"] <= FP32_TOL, value
