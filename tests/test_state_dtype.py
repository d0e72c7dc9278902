"""Optimizer state held in bf16 between steps (``state_dtype``), d = 1, 2 and 4; fp16 and fp8,
held with block scales, are tested in tests/test_state_scaled.py.

Each rank's grads are fixed coefficients with few significant bits, the same on every rank,
so the averaged grads are exact at any d and in any grad dtype: a distopt run then equals plain
torch.optim on the full params step for step, and with ``state_dtype`` it equals plain
torch.optim whose state is rounded to that dtype after every step, bit for bit
([Note: state precision] in distopt/optim/state_precision.py). One spawned group per world
size runs every case.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt.optim.param_groups import CLASS_KEY
from distopt.parallel.dtensor import local_tensor
from distopt.plan.ownership import plan_of, predict_plan

from dist_harness import case_result, run_cases
from helpers import shared_tmpdir, world_params
from models import mlp

WORLDS = [1, 2, 4]
STEPS = 4
BF16, FP16 = torch.bfloat16, torch.float16
ADAMW = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return mlp([24, 40, 17], dtype=dtype)


def _coefficients(shape: torch.Size, step: int, index: int) -> torch.Tensor:
    """The grad of param ``index`` at ``step`` on every rank: 4 significant bits, so sums of
    up to 4 of them are exact even in bf16, over exponents from 2**-20 to 2**2."""
    g = torch.Generator().manual_seed(1000 * step + index)
    mantissa = torch.randint(1, 16, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return sign * mantissa * torch.exp2(torch.randint(-24, -2, shape, generator=g).float())


def _linear_loss(params: list[nn.Parameter], step: int) -> torch.Tensor:
    return torch.stack([(p.float() * _coefficients(p.shape, step, i)).sum()
                        for i, p in enumerate(params)]).sum()


def _muon_groups(model: nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": matrices, "lr": 0.02},
            {"params": rest, CLASS_KEY: torch.optim.AdamW, "lr": 1e-2, "betas": (0.8, 0.95)}]


def _build(kind: str, state_dtype, *, bucket_size: int = 700, **options):
    """(model, ddp, opt) of one configuration of the grid; ``options``: more optimizer
    options (``state_block_size``)."""
    params_dtype = BF16 if kind in ("remainders", "fp16-scaler") else torch.float32
    if kind == "fp16-scaler":
        params_dtype = FP16
    model = _model(params_dtype)
    grad_dtype = BF16 if kind == "remainders" else torch.float32
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=bucket_size)
    extra = dict(options)
    if kind == "muon":
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=_muon_groups(model),
                                           state_dtype=state_dtype, lr=0.02, **extra)
        return model, ddp, opt
    if kind == "sgd":
        return model, ddp, distopt.DistributedOptimizer(
            ddp, torch.optim.SGD, state_dtype=state_dtype, lr=0.5, momentum=0.9, **extra)
    if kind == "remainders":
        extra["store_param_remainders"] = True
    if kind == "fp16-scaler":
        extra["loss_scaler"] = distopt.DynamicLossScaler(initial_scale=2.0**10)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, state_dtype=state_dtype,
                                       **extra, **ADAMW)
    return model, ddp, opt


def _reference(model: nn.Module, opt) -> tuple[list[nn.Parameter], list[torch.optim.Optimizer]]:
    """Plain torch.optim over fp32 copies of the full params (of this rank's TP shard of a
    DTensor param), with distopt's group options (its kernel choice included), one optimizer
    per class."""
    masters = [nn.Parameter(local_tensor(p).detach().float().clone())
               for p in model.parameters()]
    of = dict(zip(model.parameters(), masters, strict=True))
    per_class: dict[type, list[dict]] = {}
    for group, params in zip(opt.param_groups, opt.model_param_groups, strict=True):
        inner = next(o for o in opt.optimizers if group in o.param_groups)
        options = {k: v for k, v in group.items() if k not in ("params", CLASS_KEY)}
        per_class.setdefault(type(inner), []).append(
            {**options, "params": [of[p] for p in params]})
    return masters, [cls(groups) for cls, groups in per_class.items()]


def _round_state(ref_opts: list[torch.optim.Optimizer], dtypes: dict[str, torch.dtype]) -> None:
    for ref in ref_opts:
        for state in ref.state.values():
            for key, dtype in dtypes.items():
                if key in state:
                    state[key] = state[key].to(dtype).float()


def _pieces_equal(opt, masters: list[nn.Parameter], ref_opts, model: nn.Module,
                  dtypes: dict[str, torch.dtype]) -> dict[str, bool]:
    """Every piece's fp32 master and state against the reference's elements, bit for bit;
    the state in its held dtype."""
    index = {p: i for i, p in enumerate(model.parameters())}
    ref_state = {p: s for ref in ref_opts for p, s in ref.state.items()}
    masters_ok = state_ok = dtypes_ok = True
    for (param, piece, main), value in zip(opt.pieces(), opt.main_param_values(), strict=True):
        lo, hi = piece.param_range.start, piece.param_range.end
        ref = masters[index[param]]
        masters_ok &= torch.equal(value.reshape(-1), ref.detach().reshape(-1)[lo:hi])
        for key, held in opt.state[main].items():
            want = ref_state[ref][key]
            if key == "step":
                state_ok &= float(held) == float(want)
                continue
            dtypes_ok &= held.dtype == dtypes.get(key, torch.float32)
            state_ok &= torch.equal(held.float().reshape(-1), want.reshape(-1)[lo:hi])
    return {"masters": masters_ok, "state": state_ok, "dtypes": dtypes_ok}


def step_both(model, ddp, opt, masters: list[nn.Parameter],
              ref_opts: list[torch.optim.Optimizer], step: int) -> None:
    """One step of distopt (its params gathered) and of the reference on the same grads."""
    opt.zero_grad()
    _linear_loss(list(model.parameters()), step).backward()
    opt.step()
    ddp.finish_param_sync()
    for index, master in enumerate(masters):
        master.grad = _coefficients(master.shape, step, index)
    for ref in ref_opts:
        ref.step()


def trajectory(kind: str, state_dtype) -> list[dict[str, bool]]:
    """distopt with ``state_dtype`` against torch.optim with the state rounded after each
    step; one verdict per step."""
    model, ddp, opt = _build(kind, state_dtype)
    dtypes = dict(opt.state_precision.dtypes)
    masters, ref_opts = _reference(model, opt)
    out = []
    for step in range(STEPS):
        step_both(model, ddp, opt, masters, ref_opts, step)
        _round_state(ref_opts, dtypes)
        out.append(_pieces_equal(opt, masters, ref_opts, model, dtypes))
    return out


def fp32_state_is_today() -> bool:
    """state_dtype=torch.float32 is the step without the option, bit for bit."""
    runs = [_build("adamw", dtype) for dtype in (None, torch.float32)]
    for step in range(STEPS):
        for model, ddp, opt in runs:
            opt.zero_grad()
            _linear_loss(list(model.parameters()), step).backward()
            opt.step()
            ddp.finish_param_sync()
    (a_model, _, a), (b_model, _, b) = runs
    return all(torch.equal(x, y) for x, y in zip(a_model.parameters(), b_model.parameters(),
                                                  strict=True)) and all(
        all(torch.equal(a.state[x][k], b.state[y][k]) for k in a.state[x])
        for x, y in zip(a.main_params, b.main_params, strict=True))


def skipped_step() -> dict[str, bool]:
    """fp16 loss scaling: a step whose grads overflow leaves the bf16 state as it was."""
    model, ddp, opt = _build("fp16-scaler", BF16)
    params = list(model.parameters())

    def step(overflow: bool):
        opt.zero_grad()
        loss = _linear_loss(params, 0) * (float("inf") if overflow else 1.0)
        opt.scale_loss(loss).backward()
        return opt.step()

    step(False)
    before = {m: {k: v.clone() for k, v in opt.state[m].items()} for m in opt.main_params}
    result = step(True)
    same = all(all(torch.equal(before[m][k], v) and v.dtype == before[m][k].dtype
                   for k, v in opt.state[m].items()) for m in opt.main_params)
    held = all(opt.state[m]["exp_avg"].dtype == BF16 for m in opt.main_params)
    return {"skipped": not result.updated, "state_untouched": same, "bf16": held}


def memory(kind: str) -> dict:
    """What a rank holds by component, after a step (torch creates state at the first)."""
    if kind == "remainders":
        model = mlp([64, 96, 80, 33], dtype=BF16)
        ddp = distopt.DistributedDataParallel(model, grad_dtype=BF16, bucket_size=6000)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3,
                                           store_param_remainders=True, state_dtype=BF16)
        theory = distopt.theoretical_bytes_per_param(BF16, BF16, dist.get_world_size(),
                                                     store_param_remainders=True,
                                                     state_dtype=BF16)
    elif kind == "muon":
        model = mlp([64, 96, 80, 33])
        ddp = distopt.DistributedDataParallel(model, bucket_size=6000)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=_muon_groups(model),
                                           state_dtype=BF16, lr=0.02)
        theory = None
    else:
        model = mlp([64, 96, 80, 33])
        ddp = distopt.DistributedDataParallel(model, bucket_size=6000)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3, state_dtype=BF16)
        theory = distopt.theoretical_bytes_per_param(torch.float32, torch.float32,
                                                     dist.get_world_size(), state_dtype=BF16)
    opt.zero_grad()
    _linear_loss(list(model.parameters()), 0).backward()
    opt.step()
    # The ownership plan, from the optimizer and predicted from the module, in the same dtypes.
    plan = plan_of(opt)
    predicted = predict_plan(model, torch.optim.Muon if kind == "muon" else torch.optim.AdamW,
                             _muon_groups(model) if kind == "muon" else None,
                             dp_size=dist.get_world_size(), grad_dtype=ddp.options.grad_dtype,
                             bucket_size=6000, store_param_remainders=kind == "remainders",
                             state_dtype=BF16)
    return {"report": distopt.measure_state_bytes(opt), "theory": theory,
            "plan": plan.ranks[dist.get_rank()], "predicted_equal": predicted.ranks == plan.ranks,
            "owned": sum(m.numel() for m in opt.main_params),
            "state_elements": sum(v.numel() for s in opt.state.values() for k, v in s.items()
                                  if k != "step"),
            "padded": sum(buf.layout.numel for buf in ddp.flat_buffers)}


def _train(model, ddp, opt, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _linear_loss(list(model.parameters()), step).backward()
        opt.step()
        ddp.finish_param_sync()


def _state_by_name(opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's per-element state, whole, by param name (a collective)."""
    sd = opt.sharded_state_dict()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: {k: (v.offset, v.numel, v.local.clone())
                                          for k, v in e.items() if k != "step"}
                                      for n, e in sd["state"].items()})
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for per_rank in gathered:
        for name, entries in per_rank.items():
            for key, (offset, numel, local) in entries.items():
                t = whole.setdefault(name, {}).setdefault(
                    key, torch.full((numel,), float("nan"), dtype=local.dtype))
                t[offset:offset + local.numel()] = local
    return whole


def checkpoints() -> dict[str, bool]:
    """fp32 state loads into a bf16-state run rounded once, bf16 state into an fp32-state run
    widened, at another bucket layout; a bf16 run resumes bit for bit; the export holds fp32."""
    path = shared_tmpdir("distopt-state-dtype-")
    out = {}
    model, ddp, opt = _build("adamw", None)
    _train(model, ddp, opt, range(2))
    distopt.save_checkpoint(path, ddp, opt, name="fp32")
    fp32_state = _state_by_name(opt)

    model, ddp, opt = _build("adamw", BF16, bucket_size=300)  # resharded: other buckets
    distopt.load_checkpoint(f"{path}/fp32", ddp, opt)
    loaded = _state_by_name(opt)
    out["fp32_into_bf16_rounded_once"] = all(
        loaded[n][k].dtype == BF16 and torch.equal(loaded[n][k], fp32_state[n][k].to(BF16))
        for n in fp32_state for k in fp32_state[n])
    _train(model, ddp, opt, range(2, 3))
    distopt.save_checkpoint(path, ddp, opt, name="bf16")
    bf16_state = _state_by_name(opt)
    out["bf16_checkpoint_holds_bf16"] = all(
        v.local.dtype == BF16 for e in opt.sharded_state_dict()["state"].values()
        for k, v in e.items() if k != "step")

    resumed_model, resumed_ddp, resumed = _build("adamw", BF16)
    distopt.load_checkpoint(f"{path}/bf16", resumed_ddp, resumed)
    _train(model, ddp, opt, range(3, 5))
    _train(resumed_model, resumed_ddp, resumed, range(3, 5))
    got, want = _state_by_name(resumed), _state_by_name(opt)
    out["bf16_resumes_bit_for_bit"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(),
                                          strict=True)) and got.keys() == want.keys() and all(
        torch.equal(got[n][k], v) for n, e in want.items() for k, v in e.items())

    model, ddp, opt = _build("adamw", None, bucket_size=300)
    distopt.load_checkpoint(f"{path}/bf16", ddp, opt)
    widened = _state_by_name(opt)
    out["bf16_into_fp32_widened"] = all(
        widened[n][k].dtype == torch.float32 and torch.equal(widened[n][k], v.float())
        for n, e in bf16_state.items() for k, v in e.items())

    # In memory: a bf16 run's state_dict loads into an fp32-state run and back.
    model, ddp, opt = _build("adamw", BF16)
    _train(model, ddp, opt, range(2))
    sd = opt.sharded_state_dict()
    _, _, other = _build("adamw", None)
    other.load_state_dict(copy.deepcopy(sd))
    _, _, back = _build("adamw", BF16)
    back.load_state_dict(other.sharded_state_dict())
    got, want = _state_by_name(back), _state_by_name(opt)
    out["state_dict_round_trip"] = got.keys() == want.keys() and all(
        got[n][k].dtype == BF16 and torch.equal(got[n][k], v)
        for n, e in want.items() for k, v in e.items())

    if dist.get_rank() == 0:
        file = distopt.export_checkpoint(f"{path}/bf16", f"{path}/plain.pt")
        plain = torch.load(file, weights_only=True)
        names = [n for n, _ in _model().named_parameters()]
        states = plain["optimizer"]["state"]
        out["export_fp32"] = all(
            v.dtype == torch.float32 and torch.equal(v.reshape(-1), bf16_state[names[i]][k].float())
            for i, e in states.items() for k, v in e.items() if k != "step")
        ref_model = _model()
        ref_model.load_state_dict(plain["model"])
        ref = torch.optim.AdamW(ref_model.parameters(), **ADAMW)
        ref.load_state_dict(plain["optimizer"])
        out["export_loads_into_torch"] = True
    return out


def _cases() -> list:
    cases = [
        ("adamw-bf16", trajectory, ("adamw", BF16)),
        ("adamw-per-key", trajectory, ("adamw", {"exp_avg": BF16})),
        ("sgd-bf16", trajectory, ("sgd", BF16)),
        ("muon-adamw-bf16", trajectory, ("muon", BF16)),
        ("remainders-bf16", trajectory, ("remainders", BF16)),
        ("fp32-is-today", fp32_state_is_today, ()),
        ("skipped", skipped_step, ()),
        ("memory-remainders", memory, ("remainders",)),
        ("memory-fp32", memory, ("fp32",)),
        ("memory-muon", memory, ("muon",)),
        ("checkpoints", checkpoints, ()),
    ]
    return cases


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


TRAJECTORIES = ["adamw-bf16", "adamw-per-key", "sgd-bf16", "muon-adamw-bf16", "remainders-bf16"]


@pytest.mark.parametrize("case", TRAJECTORIES)
def test_state_equals_torch_with_state_rounded_after_each_step(world, case):
    for per_step in case_result(world[1], case):
        assert per_step == [{"masters": True, "state": True, "dtypes": True}] * STEPS, per_step


def test_fp32_state_is_the_step_without_the_option(world):
    assert all(case_result(world[1], "fp32-is-today"))


def test_a_skipped_step_leaves_the_state(world):
    for value in case_result(world[1], "skipped"):
        assert value == {"skipped": True, "state_untouched": True, "bf16": True}


@pytest.mark.parametrize("kind", ["remainders", "fp32", "muon"])
def test_memory_follows_the_new_rows(world, kind):
    d, results = world
    for value in case_result(results, f"memory-{kind}"):
        report = value["report"]
        assert value["plan"] == report and value["predicted_equal"]  # to the byte
        # Every state element in bf16: AdamW's two moments, Muon's one momentum.
        assert report.optimizer_state == 2 * value["state_elements"]
        if kind == "muon":
            continue
        assert value["state_elements"] == 2 * value["owned"]
        if kind == "remainders":
            assert value["theory"] == 4 + 6 / d
            assert report.params == report.grads == 2 * value["padded"]
            assert report.main_params == 2 * value["padded"] // d and report.main_grads == 0
        else:
            assert value["theory"] == 8 + 4 / d
            assert report.main_params == report.main_grads == 0  # views of the fp32 buffers
        # Padding aside: each rank owns at most one bucket padding beyond 1/d.
        assert value["theory"] <= report.bytes_per_param < value["theory"] * 1.05


def test_checkpoints_round_and_widen(world):
    for rank, value in enumerate(case_result(world[1], "checkpoints")):
        assert value and all(value.values()), (rank, value)


# ---------------------------------------------------------------- one process


def _one_process(**kwargs):
    ddp = distopt.DistributedDataParallel(_model())
    return distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3, **kwargs)


@pytest.mark.parametrize("bad, error, words", [
    (torch.int8, ValueError, "not a float type"),
    (torch.float8_e4m3fnuz, ValueError, "not supported"),
    ("bf16", TypeError, "torch.dtype"),
    ({"exp_avg": torch.int32}, ValueError, "not a float type"),
    ({"momentum_buffer": BF16}, ValueError, "not a state key of AdamW"),
    ({}, ValueError, "names no state key"),
])
def test_bad_state_dtype_raises_before_anything(bad, error, words):
    with pytest.raises(error, match=words):
        _one_process(state_dtype=bad)


def test_table_of_state_bytes():
    from distopt.optim.kinds import state_bytes

    assert state_bytes(torch.optim.AdamW, (10,), None, {"exp_avg": BF16}) == 60
    assert state_bytes(torch.optim.AdamW, (10,), {"amsgrad": True},
                       dict.fromkeys(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), BF16)) == 60
    assert state_bytes(torch.optim.SGD, (10,), {"momentum": 0.9},
                       {"momentum_buffer": FP16}) == 20 + 1  # and one block's exponent
    assert state_bytes(torch.optim.Adafactor, (4, 6), None, {"variance": BF16}) == 40  # rows+cols
    assert state_bytes(torch.optim.Adafactor, (6,), None, {"variance": BF16}) == 12


@pytest.mark.parametrize("args, total", [
    (["--dtype", "bf16", "--grad-dtype", "bf16", "--store-param-remainders"], 4 + 6 / 4),
    (["--dtype", "fp32"], 8 + 4 / 4),
])
def test_memory_command_prints_the_rows(capsys, args, total):
    from distopt.cli.memory_command import main

    assert main(["--params", "1e9", "--dp", "4", "--state-dtype", "bf16", *args]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip()}
    assert float(rows["total"][2]) == total
    assert float(rows["opt."][-2]) == 4 / 4  # "opt. state (bf16)": Adam's 4 B/param over d


def test_train_refuses_a_key_of_another_optimizer_before_any_rank_starts():
    from distopt.train.config import parse_args

    with pytest.raises(ValueError, match="--state-dtype momentum_buffer=bf16: .*not a state key"):
        parse_args(["--state-dtype", "momentum_buffer=bf16"])
    assert parse_args(["--state-dtype", "momentum_buffer=bf16", "--optimizer", "sgd"]
                      ).state_dtype == "momentum_buffer=bf16"
