"""Optimizer state held in fp16 or fp8 with block scales (``state_dtype``), d = 1, 2 and 4.

The grads are those of tests/test_state_dtype.py (exact at any d), so a distopt run with scaled
state equals plain torch.optim whose state is quantized after every step with the same blocks:
each main param's state cut into blocks of ``state_block_size`` from the piece's first element,
each block divided by the power of two that brings its largest magnitude within the format's
max and rounded to nearest ([Note: state precision] in distopt/optim/state_precision.py). The
quantizer here is written apart from the library's (a loop over blocks with Python floats).
One spawned group per world size runs every case.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt
from distopt.plan.ownership import plan_of, predict_plan

from dist_harness import case_result, run_cases
from helpers import shared_tmpdir, world_params
from models import mlp
from test_state_dtype import (
    ADAMW,
    STEPS,
    _build,
    _model,
    _one_process,
    _reference,
    _train,
    step_both,
)

WORLDS = [1, 2, 4]
E4M3, E5M2, FP16, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16
SCALED = (E4M3, E5M2, FP16)


def quantized(x: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """The fp32 numbers ``x`` (1-D) is held as: per block, ``round(x / 2**k) * 2**k`` with
    ``k`` the smallest integer that keeps the block's absmax within the format's max."""
    top = torch.finfo(dtype).max
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        part = x[lo:lo + block]
        absmax = float(part.abs().max())
        k = 0 if absmax == 0 else math.floor(math.log2(absmax / top))
        while absmax / 2.0**k > top:
            k += 1
        while absmax > 0 and absmax / 2.0**(k - 1) <= top:
            k -= 1
        out[lo:lo + block] = (part / 2.0**k).to(dtype).float() * 2.0**k
    return out


def held(x: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """fp32 ``x`` as ``state_dtype`` holds it: quantized with scales, or rounded."""
    return quantized(x, dtype, block) if dtype in SCALED else x.to(dtype).float()


def dequantized(entries: dict, key: str) -> torch.Tensor:
    """A state dict's entry ``key`` of one piece, in fp32 (values times their exponents)."""
    values = entries[key].local
    exponents = entries.get(key + ".exponents")
    if exponents is None:
        return values.float()
    return values.float() * torch.exp2(exponents.local.float())


def _ref_by_main(opt, model, masters, ref_opts):
    """Each piece's (flat reference state, param range) for the comparisons."""
    index = {p: i for i, p in enumerate(model.parameters())}
    ref_state = {p: s for ref in ref_opts for p, s in ref.state.items()}
    return [(piece, main, ref_state[masters[index[param]]], masters[index[param]])
            for param, piece, main in opt.pieces()]


def _quantize_reference(pieces, dtypes, block) -> None:
    """The reference's state, in the elements of this rank's pieces, as distopt holds it."""
    for piece, _, state, _ in pieces:
        lo, hi = piece.param_range.start, piece.param_range.end
        for key, dtype in dtypes.items():
            if key in state:
                flat = state[key].view(-1)
                flat[lo:hi] = held(flat[lo:hi].clone(), dtype, block)


def _state_equal(opt, pieces, dtypes) -> dict[str, bool]:
    sd = opt.sharded_state_dict()
    names = {main: name for name, main in _mains(opt).items()}
    masters_ok = state_ok = dtypes_ok = True
    for (piece, main, state, master), value in zip(pieces, opt.main_param_values(),
                                                    strict=True):
        lo, hi = piece.param_range.start, piece.param_range.end
        masters_ok &= torch.equal(value.reshape(-1), master.detach().reshape(-1)[lo:hi])
        entries = sd["state"][names[main]]
        for key, want in state.items():
            if key == "step":
                state_ok &= float(entries[key]) == float(want)
                continue
            dtypes_ok &= entries[key].local.dtype == dtypes.get(key, torch.float32)
            dtypes_ok &= (key + ".exponents" in entries) == (dtypes.get(key) in SCALED)
            state_ok &= torch.equal(dequantized(entries, key), want.reshape(-1)[lo:hi])
    return {"masters": masters_ok, "state": state_ok, "dtypes": dtypes_ok}


def _mains(opt) -> dict[str, nn.Parameter]:
    from distopt.checkpoint.format import owned_pieces

    return {o.name: o.main for o in owned_pieces(opt)}


def trajectory(kind: str, state_dtype, block: int | None = None) -> list[dict[str, bool]]:
    """distopt with scaled state against torch.optim with the state quantized after each
    step; one verdict per step."""
    options = {} if block is None else {"state_block_size": block}
    model, ddp, opt = _build(kind, state_dtype, **options)
    dtypes = dict(opt.state_precision.dtypes)
    masters, ref_opts = _reference(model, opt)
    out = []
    for step in range(STEPS):
        step_both(model, ddp, opt, masters, ref_opts, step)
        pieces = _ref_by_main(opt, model, masters, ref_opts)
        _quantize_reference(pieces, dtypes, opt.state_precision.block_size)
        out.append(_state_equal(opt, pieces, dtypes))
    return out


def one_step(state_dtype) -> bool:
    """After one step every element equals the fp32-state step's state quantized once."""
    runs = [_build("adamw", dtype) for dtype in (None, state_dtype)]
    for model, ddp, opt in runs:
        _train(model, ddp, opt, range(1))
    (_, _, fp32), (_, _, low) = runs
    block = low.state_precision.block_size
    want, got = fp32.sharded_state_dict()["state"], low.sharded_state_dict()["state"]
    return all(
        torch.equal(dequantized(got[name], key), quantized(want[name][key].local, state_dtype,
                                                           block))
        for name in want for key in ("exp_avg", "exp_avg_sq"))


def memory(kind: str, state_dtype) -> dict:
    """What a rank holds by component after a step, the plan, and the table's row."""
    d = dist.get_world_size()
    if kind == "remainders":
        model = mlp([64, 96, 80, 33], dtype=BF16)
        ddp = distopt.DistributedDataParallel(model, grad_dtype=BF16, bucket_size=6000)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3,
                                           store_param_remainders=True, state_dtype=state_dtype)
        theory = distopt.theoretical_bytes_per_param(BF16, BF16, d, store_param_remainders=True,
                                                     state_dtype=state_dtype)
    else:
        model = mlp([64, 96, 80, 33])
        ddp = distopt.DistributedDataParallel(model, bucket_size=6000)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3,
                                           state_dtype=state_dtype)
        theory = distopt.theoretical_bytes_per_param(torch.float32, torch.float32, d,
                                                     state_dtype=state_dtype)
    _train(model, ddp, opt, range(1))
    predicted = predict_plan(model, torch.optim.AdamW, dp_size=d,
                             grad_dtype=ddp.options.grad_dtype, bucket_size=6000,
                             store_param_remainders=kind == "remainders",
                             state_dtype=state_dtype)
    pieces = [m.numel() for m in opt.main_params]
    return {"report": distopt.measure_state_bytes(opt), "theory": theory,
            "plan": plan_of(opt).ranks[dist.get_rank()],
            "predicted_equal": predicted.ranks == plan_of(opt).ranks,
            # Two moments of one byte (two for fp16) per element and one per block of 32.
            "expected_state": sum(2 * (n * state_dtype.itemsize + -(-n // 32)) for n in pieces),
            "padded": sum(buf.layout.numel for buf in ddp.flat_buffers)}


def _state_by_name(opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's per-element state, whole, by param name (a collective); fp8 travels as
    its bytes (pickle does not hold fp8 tensors)."""
    sd = opt.sharded_state_dict()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {
        n: {k: (v.offset, v.numel, v.local.dtype, v.local.view(torch.uint8).clone()
                if v.local.dtype in (E4M3, E5M2) else v.local.clone())
            for k, v in e.items() if k != "step"}
        for n, e in sd["state"].items()})
    whole: dict[str, dict[str, torch.Tensor]] = {}
    dtypes = {}
    for per_rank in gathered:
        for name, entries in per_rank.items():
            for key, (offset, numel, dtype, local) in entries.items():
                t = whole.setdefault(name, {}).setdefault(
                    key, torch.zeros((numel,), dtype=local.dtype))
                t[offset:offset + local.numel()] = local
                dtypes[name, key] = dtype
    return {name: {key: t.view(dtypes[name, key]) for key, t in entries.items()}
            for name, entries in whole.items()}


def _full(opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's state, whole, by name, in fp32 (scaled values times their exponents)."""
    by_name = _state_by_name(opt)
    return {name: {key: (entries[key].float() * torch.exp2(entries[key + ".exponents"].float())
                         if key + ".exponents" in entries else entries[key].float())
                   for key in entries if not key.endswith(".exponents")}
            for name, entries in by_name.items()}


def _pieces_hold(opt, full, dtype) -> bool:
    """This rank's state equals ``full`` quantized with this rank's blocks."""
    sd = opt.sharded_state_dict()["state"]
    block = opt.state_precision.block_size
    ok = True
    for name, entries in sd.items():
        for key in ("exp_avg", "exp_avg_sq"):
            shard = entries[key]
            want = full[name][key][shard.offset:shard.end]
            ok &= shard.local.dtype == dtype
            ok &= torch.equal(dequantized(entries, key), held(want, dtype, block))
    return ok


def checkpoints() -> dict[str, bool]:
    """fp32 state into an e4m3 run (quantized once), e4m3 at another bucket size (the blocks
    move), e4m3 resumed bit for bit, e4m3 into an fp32 run (exact), state dicts round trip,
    and the export holds the fp32 numbers."""
    path = shared_tmpdir("distopt-state-scaled-")
    out = {}
    model, ddp, opt = _build("adamw", None)
    _train(model, ddp, opt, range(2))
    distopt.save_checkpoint(path, ddp, opt, name="fp32")
    fp32_state = _full(opt)

    model, ddp, opt = _build("adamw", E4M3, bucket_size=300)
    distopt.load_checkpoint(f"{path}/fp32", ddp, opt)
    out["fp32_into_e4m3_quantized_once"] = _pieces_hold(opt, fp32_state, E4M3)
    _train(model, ddp, opt, range(2, 3))
    distopt.save_checkpoint(path, ddp, opt, name="e4m3")
    saved = _full(opt)
    out["checkpoint_holds_e4m3_and_exponents"] = all(
        e[k].local.dtype == E4M3 and e[k + ".exponents"].local.dtype == torch.int8
        for e in opt.sharded_state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq"))

    resumed_model, resumed_ddp, resumed = _build("adamw", E4M3, bucket_size=300)
    distopt.load_checkpoint(f"{path}/e4m3", resumed_ddp, resumed)
    _train(model, ddp, opt, range(3, 5))
    _train(resumed_model, resumed_ddp, resumed, range(3, 5))
    got, want = _state_by_name(resumed), _state_by_name(opt)
    out["e4m3_resumes_bit_for_bit"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(),
                                          strict=True)) and got.keys() == want.keys() and all(
        torch.equal(got[n][k].view(torch.uint8) if got[n][k].dtype == E4M3 else got[n][k],
                    v.view(torch.uint8) if v.dtype == E4M3 else v)
        for n, e in want.items() for k, v in e.items())

    _, ddp, moved = _build("adamw", E4M3, bucket_size=700)  # other pieces, other blocks
    distopt.load_checkpoint(f"{path}/e4m3", ddp, moved)
    out["e4m3_resharded_requantized"] = _pieces_hold(moved, saved, E4M3)

    _, ddp, wide = _build("adamw", None, bucket_size=700)
    distopt.load_checkpoint(f"{path}/e4m3", ddp, wide)
    widened = _full(wide)
    out["e4m3_into_fp32_exact"] = all(
        torch.equal(widened[n][k], v) for n, e in saved.items() for k, v in e.items())

    # In memory: an e4m3 run's state_dict loads into an fp32-state run and back, exactly.
    model, ddp, opt = _build("adamw", E4M3)
    _train(model, ddp, opt, range(2))
    _, _, other = _build("adamw", None)
    other.load_state_dict(copy.deepcopy(opt.sharded_state_dict()))
    _, _, back = _build("adamw", E4M3)
    back.load_state_dict(other.sharded_state_dict())
    got, want = _full(back), _full(opt)
    out["state_dict_round_trip"] = got.keys() == want.keys() and all(
        torch.equal(got[n][k], v) for n, e in want.items() for k, v in e.items())

    if dist.get_rank() == 0:
        file = distopt.export_checkpoint(f"{path}/e4m3", f"{path}/plain.pt")
        plain = torch.load(file, weights_only=True)
        names = [n for n, _ in _model().named_parameters()]
        states = plain["optimizer"]["state"]
        out["export_fp32"] = set(states[0]) == {"step", "exp_avg", "exp_avg_sq"} and all(
            v.dtype == torch.float32 and torch.equal(v.reshape(-1), saved[names[i]][k])
            for i, e in states.items() for k, v in e.items() if k != "step")
        ref_model = _model()
        ref_model.load_state_dict(plain["model"])
        torch.optim.AdamW(ref_model.parameters(), **ADAMW).load_state_dict(plain["optimizer"])
    return out


def _grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, sorted."""
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    values = bits.to(torch.uint8 if dtype.itemsize == 1 else torch.int16).view(dtype).float()
    return values[torch.isfinite(values)].unique()


def on_either_side(got: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every element of ``got`` is one of the two values of ``dtype`` around ``x``."""
    grid = _grid(dtype)
    above = torch.searchsorted(grid, x).clamp(max=grid.numel() - 1)
    below = torch.searchsorted(grid, x, right=True).sub(1).clamp(min=0)
    return bool(((got == grid[above]) | (got == grid[below])).all())


def stochastic_trajectory(state_dtype) -> list[dict[str, bool]]:
    """With stochastic rounding, every step's state is one of the two values around the
    fp32 step's from the state held before (torch.optim restarted from it each step), and
    some elements are not the nearest."""
    model, ddp, opt = _build("adamw", state_dtype, state_rounding="stochastic")
    masters, ref_opts = _reference(model, opt)
    out = []
    for step in range(STEPS):
        step_both(model, ddp, opt, masters, ref_opts, step)
        pieces = _ref_by_main(opt, model, masters, ref_opts)
        sd = opt.sharded_state_dict()["state"]
        names = {main: name for name, main in _mains(opt).items()}
        verdict = {"masters": True, "either_side": True, "not_all_nearest": False}
        for (piece, main, state, master), value in zip(pieces, opt.main_param_values(),
                                                        strict=True):
            lo, hi = piece.param_range.start, piece.param_range.end
            verdict["masters"] &= torch.equal(value.reshape(-1),
                                              master.detach().reshape(-1)[lo:hi])
            for key in ("exp_avg", "exp_avg_sq"):
                entries = sd[names[main]]
                scale = torch.exp2(entries[key + ".exponents"].local.float())
                x = state[key].view(-1)[lo:hi]
                got = entries[key].local.float()
                verdict["either_side"] &= on_either_side(got, x / scale, state_dtype)
                nearest = (x / scale).to(state_dtype).float()
                verdict["not_all_nearest"] |= bool((got != nearest).any())
                x.copy_(got * scale)  # the next reference step starts from the held state
        out.append(verdict)
    return out


PER_KEY = {"exp_avg": E4M3, "exp_avg_sq": E5M2}
TRAJECTORIES = {
    "adamw-e4m3": ("adamw", E4M3),
    "adamw-e5m2-block128": ("adamw", E5M2, 128),
    "adamw-fp16": ("adamw", FP16),
    "adamw-e4m3-e5m2": ("adamw", PER_KEY),
    "sgd-fp16": ("sgd", FP16),
    "muon-adamw-e4m3": ("muon", E4M3),
    "remainders-e4m3": ("remainders", E4M3),
}


def _cases() -> list:
    return [
        *[(name, trajectory, args) for name, args in TRAJECTORIES.items()],
        ("stochastic-e5m2", stochastic_trajectory, (E5M2,)),
        ("stochastic-e4m3", stochastic_trajectory, (E4M3,)),
        ("one-step-e4m3", one_step, (E4M3,)),
        ("one-step-e5m2", one_step, (E5M2,)),
        ("memory-e4m3", memory, ("fp32", E4M3)),
        ("memory-fp16", memory, ("fp32", FP16)),
        ("memory-remainders-e5m2", memory, ("remainders", E5M2)),
        ("checkpoints", checkpoints, ()),
    ]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


@pytest.mark.parametrize("case", TRAJECTORIES)
def test_state_equals_torch_with_state_quantized_after_each_step(world, case):
    for per_step in case_result(world[1], case):
        assert per_step == [{"masters": True, "state": True, "dtypes": True}] * STEPS, per_step


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_stochastic_rounding_lands_on_either_side(world, dtype):
    d, results = world
    for per_step in case_result(results, f"stochastic-{dtype}"):
        assert all(v["masters"] and v["either_side"] for v in per_step), per_step
        # After the first step (whose state torch starts from zero) some element rounds away.
        assert any(v["not_all_nearest"] for v in per_step[1:]), per_step


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_one_step_is_the_fp32_step_quantized_once(world, dtype):
    assert all(case_result(world[1], f"one-step-{dtype}"))


@pytest.mark.parametrize("case", ["e4m3", "fp16", "remainders-e5m2"])
def test_memory_follows_the_scaled_rows(world, case):
    d, results = world
    itemsize = 2 if case == "fp16" else 1
    for value in case_result(results, f"memory-{case}"):
        report = value["report"]
        assert value["plan"] == report and value["predicted_equal"]  # to the byte
        assert report.optimizer_state == value["expected_state"]
        state_row = 2 * (itemsize + 1 / 32)
        if case == "remainders-e5m2":
            assert value["theory"] == 4 + (2 + state_row) / d
            assert report.main_params == 2 * value["padded"] // d
        else:
            assert value["theory"] == 8 + state_row / d
        assert value["theory"] <= report.bytes_per_param < value["theory"] * 1.05


def test_checkpoints_hold_values_and_scales(world):
    for rank, value in enumerate(case_result(world[1], "checkpoints")):
        assert value and all(value.values()), (rank, value)


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("kwargs, error, words", [
    ({"state_dtype": BF16, "state_block_size": 64}, ValueError, "needs no scales"),
    ({"state_block_size": 64}, ValueError, "needs no scales"),
    ({"state_dtype": {"exp_avg": BF16}, "state_block_size": 64}, ValueError, "needs no scales"),
    ({"state_dtype": E4M3, "state_block_size": 0}, ValueError, "positive"),
    ({"state_dtype": E4M3, "state_block_size": 1.5}, TypeError, "an int"),
    ({"state_dtype": torch.float8_e4m3fnuz}, ValueError, "not supported"),
    ({"state_dtype": torch.float8_e8m0fnu}, ValueError, "not supported"),
    ({"state_rounding": "stochastic"}, ValueError, "all state is held in fp32"),
    ({"state_dtype": E4M3, "state_rounding": "up"}, ValueError, "'nearest' or 'stochastic'"),
])
def test_bad_scales_raise_before_anything(kwargs, error, words):
    with pytest.raises(error, match=words):
        _one_process(**kwargs)


def test_block_quantizer_is_exact_and_stable():
    """The library's quantizer against the one above, and quantizing what it holds again,
    with the same blocks or blocks within them, changes nothing."""
    from distopt.optim.block_scaling import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-40, 10, (1000,), generator=g))
    for dtype in SCALED:
        once = dequantize(*quantize(x, dtype, 128), 128)
        assert torch.equal(once, quantized(x, dtype, 128))
        assert torch.equal(dequantize(*quantize(once, dtype, 128), 128), once)
        # Blocks within the old ones: [0, 77) and [77, 128) of the first, then the same.
        split = torch.cat([dequantize(*quantize(part, dtype, 128), 128)
                           for part in (once[:77], once[77:128], once[128:])])
        assert torch.equal(split, once)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, FP16, BF16])
def test_stochastic_rounding_is_unbiased_and_lands_on_either_side(dtype):
    from distopt.optim.block_scaling import narrow

    g = torch.Generator().manual_seed(0)
    for value in (1.03, -1.03, 0.0007, -0.0007, 300.3):
        x = torch.full((40_000,), value)
        got = narrow(x, dtype, g).float()
        assert on_either_side(got, x, dtype) and got.unique().numel() == 2
        below, above = got.min().item(), got.max().item()
        share = (value - below) / (above - below)  # the chance of rounding up
        sigma = (share * (1 - share) / x.numel()) ** 0.5
        assert abs((got == above).float().mean().item() - share) < 5 * sigma
    assert narrow(torch.zeros(10), dtype, g).float().eq(0).all()


def test_table_and_commands_give_the_scaled_rows(capsys):
    from distopt.cli.memory_command import main
    from distopt.optim.kinds import state_bytes
    from distopt.train.config import parse_args

    assert state_bytes(torch.optim.AdamW, (300,), None, {"exp_avg": E4M3}) == 300 + 10 + 1200
    assert state_bytes(torch.optim.AdamW, (300,), None, {"exp_avg": E4M3}, 128) == 300 + 3 + 1200
    assert distopt.theoretical_bytes_per_param(torch.float32, torch.float32, 4,
                                               state_dtype=E5M2) == 8 + 2 * (1 + 1 / 32) / 4
    for name in ("fp8-e4m3", "fp8-e5m2"):
        assert main(["--params", "1e9", "--dp", "4", "--dtype", "fp32",
                     "--state-dtype", name]) == 0
        rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
                if line.strip()}
        assert float(rows["total"][2]) == round(8 + 2 * (1 + 1 / 32) / 4, 3)
    assert parse_args(["--state-dtype", "fp8-e4m3"]).state_dtype == "fp8-e4m3"
    assert parse_args(["--state-dtype", "fp16"]).state_dtype == "fp16"  # Adam: scaled squares
    with pytest.raises(ValueError, match="--state-dtype fp8: must be one of"):
        parse_args(["--state-dtype", "fp8"])
    config = parse_args(["--state-dtype", "fp8-e5m2", "--state-rounding", "stochastic",
                         "--state-block-size", "128"])
    assert (config.state_rounding, config.state_block_size) == ("stochastic", 128)
    with pytest.raises(ValueError, match="--state-block-size 128: .*needs no scales"):
        parse_args(["--state-dtype", "bf16", "--state-block-size", "128"])
    with pytest.raises(ValueError, match="--state-rounding stochastic rounds state held below"):
        parse_args(["--state-rounding", "stochastic"])
