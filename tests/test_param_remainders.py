"""store_param_remainders: bf16 params + int16 remainders instead of fp32 main params, d = 1..4.

Two optimizers step side by side on identical grads: one keeps fp32 main params, the other
remainders. The grads come from a loss linear in the params, so they do not depend on the
params' values (which differ at rounding ties, see [Note: param remainders]), and both runs see
the same grads at every step. The fp32 masters and the optimizer state must stay equal bit for
bit; the model params must be the documented split of the masters. Checkpoints hold the fp32
masters either way: a run with remainders resumes bit for bit, and loads into and from the
fp32-master path.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt.memory import bytes_per_param_breakdown
from distopt.optim.remainders import bf16_of_fp32, join_fp32, split_fp32

from dist_harness import case_result, run_cases
from helpers import (
    REMAINDER_OPTIMIZERS,
    STEP_FILES,
    adversarial_init,
    files_run_by,
    linear_loss,
    remainders_model,
    shared_tmpdir,
    world_params,
)
from models import mlp

WORLDS = [1, 2, 3, 4]
STEPS = 6
OPTION = "store_param_remainders"
OPTIMIZERS = REMAINDER_OPTIMIZERS


def _low_half(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) & 0xFFFF


def remainders_vs_fp32_master(opt_name: str, kind: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = remainders_model()
    if kind == "adversarial":
        adversarial_init(base)
    opt_cls, kwargs = OPTIMIZERS[opt_name]
    runs = {}
    for remainders in (True, False):
        model = copy.deepcopy(base)
        ddp = distopt.DistributedDataParallel(model, grad_dtype=torch.float32, bucket_size=600)
        opt = distopt.DistributedOptimizer(ddp, opt_cls, **kwargs, **{OPTION: remainders})
        runs[remainders] = (model, ddp, opt)
    (_, ddp_r, opt_r), (_, _, opt_f) = runs[True], runs[False]
    out = {"masters_equal": [], "state_equal": [], "params_split": [], "differ": [],
           "ties": [], "differ_off_tie": 0, "buckets": len(ddp_r.buckets)}
    for step in range(STEPS):
        for model, ddp, opt in runs.values():
            opt.zero_grad()
            linear_loss(model, kind, step, rank, world).backward()
            opt.step()
            ddp.finish_param_sync()
        masters = opt_r.main_param_values()
        refs = [m.detach() for m in opt_f.main_params]
        out["masters_equal"].append(all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(masters, refs, strict=True)))
        out["state_equal"].append(all(
            set(opt_r.state[a]) == set(opt_f.state[b]) and all(
                torch.equal(opt_r.state[a][k], opt_f.state[b][k]) for k in opt_r.state[a])
            for a, b in zip(opt_r.main_params, opt_f.main_params, strict=True)))
        split_ok, differ, ties, off_tie = True, 0, 0, 0
        for main_r, main_f, ref in zip(opt_r.main_params, opt_f.main_params, refs, strict=True):
            param_r, piece = opt_r.piece_info(main_r)
            param_f, _ = opt_f.piece_info(main_f)
            lo, hi = piece.param_range.start, piece.param_range.end
            got = param_r.detach().reshape(-1)[lo:hi]
            cast = param_f.detach().reshape(-1)[lo:hi]  # the fp32-master path's RNE cast
            want = torch.empty_like(got)
            split_fp32(ref.clone(), want, torch.empty(ref.shape, dtype=torch.int16))
            split_ok &= torch.equal(got.view(torch.int16), want.view(torch.int16))
            mismatch = got.view(torch.int16) != cast.view(torch.int16)
            tie = _low_half(ref) == 0x8000
            differ += int(mismatch.sum())
            ties += int(tie.sum())
            off_tie += int((mismatch & ~tie).sum())
        out["params_split"].append(split_ok)
        out["differ"].append(differ)
        out["ties"].append(ties)
        out["differ_off_tie"] += off_tie
    return out


def memory() -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = mlp([64, 96, 80, 33], dtype=torch.bfloat16)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=torch.bfloat16, bucket_size=6000)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3, **{OPTION: True})
    opt.zero_grad()
    ddp(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    report = distopt.measure_state_bytes(opt)
    padded = sum(buf.layout.numel for buf in ddp.flat_buffers)
    theory = distopt.theoretical_bytes_per_param(torch.bfloat16, torch.bfloat16, world,
                                                 **{OPTION: True})
    return {"report": report, "padded": padded, "theory": theory,
            "without": distopt.theoretical_bytes_per_param(torch.bfloat16, torch.bfloat16,
                                                           world)}


def _masters(opt) -> list[torch.Tensor]:
    return [m.view(torch.int32).clone() for m in opt.main_param_values()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _states(opt) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state[m].items()} for m in opt.main_params]


def _same_states(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True))


def checkpoints() -> dict:
    """Checkpoints hold fp32 masters with or without the option: a run with remainders saved
    and resumed continues bit for bit, and loads into and from the fp32-master path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = shared_tmpdir("distopt-remainders-")
    base = _adversarial_init_copy()
    opt_cls, kwargs = OPTIMIZERS["adamw"]

    def build(remainders: bool):
        model = copy.deepcopy(base)
        ddp = distopt.DistributedDataParallel(model, grad_dtype=torch.float32, bucket_size=600)
        return ddp, distopt.DistributedOptimizer(ddp, opt_cls, **kwargs, **{OPTION: remainders})

    def train(ddp, opt, steps) -> None:
        for step in steps:
            opt.zero_grad()
            linear_loss(ddp.module, "random", step, rank, world).backward()
            opt.step()
        ddp.finish_param_sync()

    ddp, opt = build(True)
    train(ddp, opt, range(3))
    distopt.save_checkpoint(path, ddp, opt)
    saved_masters, saved_states = _masters(opt), _states(opt)
    in_memory = opt.sharded_state_dict()
    train(ddp, opt, range(3, 5))
    out = {"placeholders_kept": all(m.stride() == (0,) for m in opt.main_params)}

    resumed_ddp, resumed = build(True)
    distopt.load_checkpoint(path, resumed_ddp, resumed)
    out["loaded_masters"] = _equal(_masters(resumed), saved_masters)
    out["loaded_states"] = _same_states(_states(resumed), saved_states)
    train(resumed_ddp, resumed, range(3, 5))
    out["resumed_masters"] = _equal(_masters(resumed), _masters(opt))
    out["resumed_params"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b
                                in zip(resumed_ddp.module.parameters(), ddp.module.parameters(),
                                       strict=True))

    fp32_ddp, fp32_opt = build(False)  # the same checkpoint, into the fp32-master path
    distopt.load_checkpoint(path, fp32_ddp, fp32_opt)
    out["into_fp32_masters"] = _equal(_masters(fp32_opt), saved_masters)
    back_ddp, back = build(True)  # and the fp32-master path's state dict back into remainders
    back.load_state_dict(fp32_opt.sharded_state_dict())
    out["from_fp32_masters"] = _equal(_masters(back), saved_masters)
    out["from_fp32_states"] = _same_states(_states(back), saved_states)
    memory_ddp, from_memory = build(True)
    from_memory.load_state_dict(in_memory)
    out["in_memory_masters"] = _equal(_masters(from_memory), saved_masters)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return out


def _adversarial_init_copy() -> nn.Module:
    model = remainders_model()
    adversarial_init(model)
    return model


def _cases() -> list:
    cases = [(f"{o}-{k}", remainders_vs_fp32_master, (o, k))
             for o in OPTIMIZERS for k in ("random", "adversarial")]
    return cases + [("memory", memory, ()), ("checkpoints", checkpoints, ())]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


# ---------------------------------------------------------------- tests (no processes)


def test_split_and_join_are_exact_and_round_ties_away_from_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.exp2(
        torch.randint(-149, 127, (50_000,), generator=g).float())
    ties = torch.tensor([1.00390625, -1.00390625, 1.01171875, 0.0, -0.0, float("inf")])
    x = torch.cat([x, ties])
    high = torch.empty(x.shape, dtype=torch.bfloat16)
    remainder = torch.empty(x.shape, dtype=torch.int16)
    split_fp32(x, high, remainder)
    assert torch.equal(join_fp32(high, remainder).view(torch.int32), x.view(torch.int32))
    cast = x.to(torch.bfloat16)
    differ = high.view(torch.int16) != cast.view(torch.int16)
    # Only exact ties with an even high half differ from round-to-nearest-even, one ulp
    # further from zero.
    bits = x.view(torch.int32)
    even_ties = ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)
    assert torch.equal(differ, even_ties) and int(even_ties.sum()) >= 2
    ours, nearest_even = high.view(torch.int16)[differ], cast.view(torch.int16)[differ]
    assert torch.equal(ours & 0x7FFF, (nearest_even & 0x7FFF) + 1)  # magnitude: one ulp more
    assert torch.equal(ours < 0, nearest_even < 0)  # same sign
    assert high[-6:-4].tolist() == [1.0078125, -1.0078125]
    assert high[-4].item() == 1.015625  # odd high half: the same as round-to-nearest-even


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_refused_for_other_param_dtypes(dtype):
    ddp = distopt.DistributedDataParallel(mlp([4, 3], dtype=dtype), grad_dtype=torch.float32)
    with pytest.raises(ValueError, match=OPTION) as error:
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **{OPTION: True})
    assert "model.to(torch.bfloat16)" in str(error.value)
    with pytest.raises(ValueError, match=OPTION):
        bytes_per_param_breakdown(dtype, torch.float32, **{OPTION: True})


def test_memory_formula():
    breakdown = bytes_per_param_breakdown(torch.bfloat16, torch.bfloat16, **{OPTION: True})
    assert breakdown.main_params == 2
    assert breakdown.main_grads == 0  # fp32 copies of the bf16 grads only during the step
    for d in (1, 2, 4, 8):
        assert distopt.theoretical_bytes_per_param(
            torch.bfloat16, torch.bfloat16, d, **{OPTION: True}) == 4 + 10 / d
        assert distopt.theoretical_bytes_per_param(
            torch.bfloat16, torch.float16, d, **{OPTION: True}) == 4 + 10 / d
        assert distopt.theoretical_bytes_per_param(
            torch.bfloat16, torch.float32, d, **{OPTION: True}) == 6 + 10 / d


def test_a_step_with_remainders_touches_only_the_step_modules():
    ddp = distopt.DistributedDataParallel(mlp([8, 16, 4], dtype=torch.bfloat16),
                                          grad_dtype=torch.bfloat16, bucket_size=100)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, clip_grad=1.0, lr=1e-2,
                                       **{OPTION: True})
    x = torch.randn(5, 8, dtype=torch.bfloat16)

    def train_step() -> None:
        opt.zero_grad()
        ddp(x).float().sum().backward()
        assert opt.step().updated

    train_step()
    touched = files_run_by(train_step)
    assert "optim/step.py" in touched and touched <= STEP_FILES, sorted(touched)


def test_plain_checkpoint_of_fp32_masters_loads_exactly():
    """A plain file's fp32 weights become the masters bit for bit, and the model params their
    split (ties rounded away from zero, not to even)."""
    ddp = distopt.DistributedDataParallel(mlp([40, 30], dtype=torch.bfloat16),
                                          grad_dtype=torch.bfloat16)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **{OPTION: True})
    g = torch.Generator().manual_seed(3)
    masters = {n: torch.randn(p.shape, generator=g) for n, p in ddp.module.named_parameters()}
    for value in masters.values():  # a third of the elements exactly on a tie
        bits = value.view(torch.int32).view(-1)
        bits[::3] = (bits[::3] & ~0xFFFF) | 0x8000
    state = {i: {"step": torch.tensor(4.0), "exp_avg": torch.randn(v.shape, generator=g),
                 "exp_avg_sq": torch.rand(v.shape, generator=g)}
             for i, v in enumerate(masters.values())}
    plain = {"model": masters, "optimizer": {"state": state, "param_groups": [
        {**opt.param_groups[0], "params": list(range(len(masters)))}]}}
    distopt.load_plain_checkpoint(plain, ddp, opt)
    for (param, piece, main), value in zip(opt.pieces(), opt.main_param_values(), strict=True):
        name = next(n for n, p in ddp.module.named_parameters() if p is param)
        lo, hi = piece.param_range.start, piece.param_range.end
        want = masters[name].reshape(-1)[lo:hi]
        assert torch.equal(value.view(torch.int32), want.view(torch.int32))
        index = list(masters).index(name)
        assert torch.equal(opt.state[main]["exp_avg"], state[index]["exp_avg"].reshape(-1)[lo:hi])
    differ = 0
    for name, param in ddp.module.named_parameters():
        got = param.detach().view(torch.int16)
        assert torch.equal(got, bf16_of_fp32(masters[name]).view(torch.int16))
        differ += int((got != masters[name].to(torch.bfloat16).view(torch.int16)).sum())
    # The split, not load_state_dict's cast: they differ at the ties with an even high half.
    assert differ > 100


# ---------------------------------------------------------------- distributed tests


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_masters_and_state_equal_the_fp32_master_path(world, opt_name, kind):
    d, results = world
    for value in case_result(results, f"{opt_name}-{kind}"):
        assert value["buckets"] >= 2
        assert value["masters_equal"] == [True] * STEPS, value
        assert value["state_equal"] == [True] * STEPS, value
        assert value["params_split"] == [True] * STEPS, value
        assert value["differ_off_tie"] == 0, value
        if kind == "random":
            assert sum(value["differ"]) <= sum(value["ties"])
    if kind == "adversarial" and opt_name == "sgd":
        # The first step puts masters on ties, and the model params there differ from the
        # fp32-master path's cast (on some rank).
        firsts = [v["differ"][0] for v in case_result(results, f"{opt_name}-{kind}")]
        ties = [v["ties"][0] for v in case_result(results, f"{opt_name}-{kind}")]
        assert sum(ties) > 100 and sum(firsts) > 0, (ties, firsts)


def test_checkpoints_hold_fp32_masters_and_resume_bit_for_bit(world):
    _, results = world
    for value in case_result(results, "checkpoints"):
        assert value == {k: True for k in value}, value


def test_memory_follows_the_formula(world):
    d, results = world
    for value in case_result(results, "memory"):
        report = value["report"]
        assert report.main_params == 2 * value["padded"] // d  # int16 remainders only
        assert report.main_grads == 0  # bf16 grads: fp32 copies only during the step
        assert value["theory"] <= report.bytes_per_param < value["theory"] * 1.1
        assert value["theory"] == pytest.approx(value["without"] - 6 / d, rel=1e-12)
