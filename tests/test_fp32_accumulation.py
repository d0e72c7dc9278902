"""reduce_scatter_with_fp32_accumulation: bf16/fp16 grads sent as they are, summed in fp32.

One spawned gloo group per d = 2, 3, 4 runs every case. Each rank's grads are regenerated on
every rank (from seeds, or by running each rank's backward on a reference copy), so the exact
average is known everywhere: in fp64, and as the fp32 reduction the option promises (the d
chunks added in fp32 in rank order, divided by d, rounded once). The plain low-precision
reduce-scatter is measured beside it. Training with the option against fp32 master weights is
a point of the parity grid in test_parity.py. Run as a script to print the table of
docs/mixed-precision.md:

    PYTHONPATH=src:tests python tests/test_fp32_accumulation.py
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import distopt
from distopt.comm import collectives as comm
from distopt.comm import sums
from distopt.options import GradSyncOptions

from dist_harness import case_result, run_cases
from helpers import (
    ParityRun,
    error_report,
    fp32_average,
    markov_loss,
    owned_grad_pieces,
    parity_trajectory,
)
from models import TinyTransformer, mlp

WORLDS = [2, 3, 4]
CHUNK = 4096  # elements of each rank's shard in the collective cases
PARITY_STEPS = 10
OPTION = "reduce_scatter_with_fp32_accumulation"


# ---------------------------------------------------------------- arithmetic of the checks


def adversarial_rows(world: int, numel: int, g: torch.Generator, dtype) -> torch.Tensor:
    """Grads that nearly cancel: ranks 0..d-2 hold values of about 64, the last about minus
    their sum, so the average is of order 1 while the partial sums of a reduction stay of
    order 64 and each of their roundings costs ~2**-2."""
    big = (64 * torch.randn(world - 1, numel, generator=g, dtype=torch.float64)).to(dtype)
    small = torch.randn(numel, generator=g, dtype=torch.float64)
    last = (small - big.double().sum(0)).to(dtype)
    return torch.cat([big, last[None]])


def grads_of_every_rank(kind: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    """[d, d * CHUNK]: row r is rank r's bucket; the same on every rank."""
    g = torch.Generator().manual_seed(1000 * world + len(kind))
    numel = world * CHUNK
    if kind == "adversarial":
        return adversarial_rows(world, numel, g, dtype)
    return torch.randn(world, numel, generator=g).to(dtype)


# ---------------------------------------------------------------- distributed cases


def collective_errors(kind: str, dtype: torch.dtype) -> dict:
    """One bucket reduce-scattered both ways; errors of this rank's shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    every = grads_of_every_rank(kind, world, dtype)
    mine = slice(rank * CHUNK, (rank + 1) * CHUNK)
    rows = [every[r, mine] for r in range(world)]

    plain_full = every[rank].clone()
    comm.reduce_scatter_avg(plain_full[mine], plain_full, group, async_op=False)
    full = every[rank].clone()
    handle = comm.reduce_scatter_avg_fp32_accum(full[mine], full, group, async_op=True)
    handle.wait()
    # The all_to_all_single version (NCCL's), on gloo too, must give the same bits.
    a2a = torch.empty(CHUNK, dtype=dtype)
    sums.all_to_all_reduce_scatter_fp32(a2a, every[rank].clone(), group, async_op=False)

    result = full[mine]
    return {
        "fp32acc": error_report(result, rows),
        "plain": error_report(plain_full[mine], rows),
        "is_fp32_average": torch.equal(result, fp32_average(rows, dtype)),
        "a2a_same": torch.equal(a2a, result),
        "plain_differs": int((plain_full[mine] != result).sum()),
        "others_untouched": torch.equal(
            torch.cat([full[: mine.start], full[mine.stop :]]),
            torch.cat([every[rank, : mine.start], every[rank, mine.stop :]]),
        ),
    }


def ddp_reduction() -> dict:
    """A bf16 TinyTransformer's grads reduced through the DDP, with and without the option:
    the reductions start during backward, each owned piece is the fp32 average of every
    rank's bf16 grads rounded once, and a step moves the same bytes either way."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    per_rank = []  # every rank's bf16 grads, from its own slice of the batch
    for r in range(world):
        ref.zero_grad()
        markov_loss(ref, 0, r, world).backward()
        per_rank.append([p.grad.clone() for p in ref.parameters()])
    out = {}
    for name, flag in (("fp32acc", True), ("plain", False)):
        copy_ = copy.deepcopy(model)
        ddp = distopt.DistributedDataParallel(copy_, grad_dtype=torch.bfloat16,
                                              bucket_size=5000, **{OPTION: flag})
        opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.0)
        opt.zero_grad()
        ddp.comm_stats.reset()
        markov_loss(ddp, 0, rank, world).backward()
        launched_in_backward = ddp.comm_stats.calls["reduce_scatter"]
        ddp.finish_grad_sync()
        index = {p: i for i, p in enumerate(copy_.parameters())}
        exact_bits, pieces, worst = True, 0, {"max_ulps": 0.0, "over_half_ulp": -1.0}
        for param, piece in owned_grad_pieces(ddp):
            rows = [grads[index[param]].reshape(-1)[piece] for grads in per_rank]
            got = param.main_grad.reshape(-1)[piece]
            exact_bits &= torch.equal(got, fp32_average(rows, torch.bfloat16))
            report = error_report(got, rows)
            worst = {k: max(worst[k], report[k]) for k in worst}
            pieces += 1
        opt.step()
        out[name] = {"launched_in_backward": launched_in_backward,
                     "buckets": len(ddp.buckets), "pieces": pieces,
                     "is_fp32_average": exact_bits, **worst,
                     "bytes": dict(ddp.comm_stats.bytes), "calls": dict(ddp.comm_stats.calls),
                     "fp32_flags": [b.fp32_accumulation for b in ddp.buckets]}
    return out


def _parity_run(fp32_accumulation: bool) -> ParityRun:
    """bf16 params and grads, AdamW with clipping, against fp32 master weights: the parity
    grid's point (test_parity.py) with the option on or off."""
    return ParityRun(dtype=torch.bfloat16, grad_dtype=torch.bfloat16,
                     fp32_accumulation=fp32_accumulation, groups=False, overlap_gather=False,
                     steps=PARITY_STEPS)


@contextmanager
def _count_collectives() -> Iterator[list[str]]:
    """Record every torch.distributed collective a DDP constructor could issue."""
    names = ("broadcast", "all_reduce", "all_gather_object", "broadcast_object_list", "barrier")
    saved = {name: getattr(dist, name) for name in names}
    calls: list[str] = []

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


BAD_INPUTS = {
    "fp32-grads": (torch.float32, dict(grad_dtype=torch.float32)),
    "none-with-fp32-params": (torch.float32, dict(grad_dtype=None)),
    "all-reduce": (torch.bfloat16, dict(grad_dtype=torch.bfloat16,
                                        use_distributed_optimizer=False)),
}


def bad_inputs() -> dict:
    """Every rank raises the same ValueError, before any collective."""
    out = {}
    for name, (param_dtype, kwargs) in BAD_INPUTS.items():
        with _count_collectives() as calls:
            try:
                distopt.DistributedDataParallel(mlp([4, 3], dtype=param_dtype),
                                                **kwargs, **{OPTION: True})
                message = None
            except ValueError as error:
                message = str(error)
        out[name] = (message, list(calls))
    return out


def _cases() -> list:
    cases = [(f"collective-{kind}-{str(dtype)[6:]}", collective_errors, (kind, dtype))
             for kind, dtype in COLLECTIVE_CASES]
    cases += [("ddp", ddp_reduction, ()), ("bad-inputs", bad_inputs, ())]
    return cases


COLLECTIVE_CASES = [
    ("random", torch.bfloat16),
    ("adversarial", torch.bfloat16),
    ("random", torch.float16),
]


@pytest.fixture(scope="module")
def worlds() -> dict[int, list[dict]]:
    """Every case at d = 2, 3 and 4 (the tests that use it are slow)."""
    return {d: run_cases(d, _cases()) for d in WORLDS}


# ---------------------------------------------------------------- tests (no processes)


@pytest.mark.parametrize(
    "kwargs, fix",
    [(dict(grad_dtype=torch.float32), "grad_dtype=torch.bfloat16"),
     (dict(grad_dtype=torch.bfloat16, use_distributed_optimizer=False),
      "use_distributed_optimizer=True")],
)
def test_options_refuse_what_the_option_cannot_do(kwargs, fix):
    with pytest.raises(ValueError, match=OPTION) as error:
        GradSyncOptions(**kwargs, **{OPTION: True})
    assert fix in str(error.value)
    GradSyncOptions(**kwargs)  # fine without the option


def test_grad_dtype_none_follows_the_params():
    with pytest.raises(ValueError, match="grad_dtype=torch.bfloat16"):
        distopt.DistributedDataParallel(mlp([4, 3]), grad_dtype=None, **{OPTION: True})
    # A bf16 model with an fp32 layer: only the bf16 buffer needs (and gets) fp32 sums.
    model = mlp([4, 5, 3], dtype=torch.bfloat16)
    model[0].float()
    ddp = distopt.DistributedDataParallel(model, grad_dtype=None, **{OPTION: True})
    flags = {buf.grad_dtype: {b.fp32_accumulation for b in buf.buckets}
             for buf in ddp.flat_buffers}
    assert flags == {torch.bfloat16: {True}, torch.float32: {False}}


def test_the_option_is_keyword_only():
    ddp = distopt.DistributedDataParallel(mlp([4, 3], dtype=torch.bfloat16),
                                          grad_dtype=torch.bfloat16, **{OPTION: True})
    assert ddp.options.reduce_scatter_with_fp32_accumulation
    assert not distopt.DistributedDataParallel(mlp([4, 3])).options.\
        reduce_scatter_with_fp32_accumulation


def test_single_rank_copies_the_shard():
    full = torch.randn(8).to(torch.bfloat16)
    shard = torch.empty(8, dtype=torch.bfloat16)
    assert comm.reduce_scatter_avg_fp32_accum(shard, full, None, async_op=True) is comm.DONE
    assert torch.equal(shard, full)


# ---------------------------------------------------------------- distributed tests


@pytest.mark.slow
@pytest.mark.parametrize("kind,dtype", COLLECTIVE_CASES)
def test_shard_is_the_fp32_average_rounded_once(worlds, kind, dtype):
    for d, results in worlds.items():
        for value in case_result(results, f"collective-{kind}-{str(dtype)[6:]}"):
            assert value["is_fp32_average"], (d, value)
            assert value["a2a_same"], (d, value)
            assert value["others_untouched"]
            # Within half an ulp of the exact average, up to the fp32 sum's own roundoff.
            assert value["fp32acc"]["over_half_ulp"] <= 0, (d, value)


@pytest.mark.slow
def test_plain_reduction_error_is_larger_and_grows_with_d(worlds):
    def worst(kind: str, path: str, stat: str, d: int) -> float:
        values = case_result(worlds[d], f"collective-{kind}-bfloat16")
        return max(v[path][stat] for v in values)

    # Random grads: the plain bf16 sum rounds at every hop; past d = 2 it is off by more than
    # half an ulp somewhere, the fp32-accumulated one never is.
    assert any(worst("random", "plain", "max_ulps", d) > 0.5 for d in WORLDS)
    for d in WORLDS:
        assert worst("random", "fp32acc", "over_half_ulp", d) <= 0
    # Nearly cancelling grads: each hop rounds a partial sum ~64 times the result, so the
    # plain error grows with the hops; the fp32-accumulated one stays at about a quarter ulp
    # (the mean of a correct rounding) whatever d.
    plain = [worst("adversarial", "plain", "mean_ulps", d) for d in WORLDS]
    assert plain == sorted(plain) and plain[0] < plain[-1] / 4, plain
    fp32acc = [worst("adversarial", "fp32acc", "mean_ulps", d) for d in WORLDS]
    assert max(fp32acc) < 0.3 and max(fp32acc) < plain[-1] / 100, (fp32acc, plain)


@pytest.mark.slow
def test_ddp_reduces_during_backward_with_the_plain_paths_bytes(worlds):
    for d, results in worlds.items():
        for value in case_result(results, "ddp"):
            fp32acc, plain = value["fp32acc"], value["plain"]
            assert fp32acc["buckets"] >= 3 and fp32acc["pieces"] > 0
            assert all(fp32acc["fp32_flags"]) and not any(plain["fp32_flags"])
            # Overlapped like the plain reduce-scatter: every bucket launched in backward.
            assert fp32acc["launched_in_backward"] == fp32acc["buckets"]
            assert plain["launched_in_backward"] == plain["buckets"]
            assert fp32acc["is_fp32_average"], d
            assert fp32acc["over_half_ulp"] <= 0, (d, fp32acc)
            assert fp32acc["bytes"] == plain["bytes"] and fp32acc["calls"] == plain["calls"]
            assert fp32acc["bytes"]["reduce_scatter"] > 0


@pytest.mark.slow
def test_bad_inputs_raise_on_every_rank_before_any_collective(worlds):
    fixes = {"fp32-grads": "grad_dtype=torch.bfloat16",
             "none-with-fp32-params": "grad_dtype=torch.bfloat16",
             "all-reduce": "use_distributed_optimizer=True"}
    for results in worlds.values():
        for value in case_result(results, "bad-inputs"):
            for name, (message, calls) in value.items():
                assert message is not None and OPTION in message, name
                assert fixes[name] in message and "drop the option" in message
                assert calls == [], (name, calls)


# ---------------------------------------------------------------- the table in the docs


def _print_table() -> None:
    print(f"errors of the reduced shard, in ulps of the exact average ({CHUNK} elements per "
          "rank's shard, every rank)\n")
    print("| d | grads | dtype | plain: max | plain: mean | fp32 accumulation: max | "
          "fp32 accumulation: mean | plain != fp32 accumulation |")
    print("|---|---|---|---|---|---|---|---|")
    for d in WORLDS:
        results = run_cases(d, [(f"{k}-{t}", collective_errors, (k, t))
                                for k, t in COLLECTIVE_CASES])
        for kind, dtype in COLLECTIVE_CASES:
            values = case_result(results, f"{kind}-{dtype}")
            row = [max(v[p][s] for v in values) for p in ("plain", "fp32acc")
                   for s in ("max_ulps", "mean_ulps")]
            differs = sum(v["plain_differs"] for v in values) / (d * CHUNK)
            print(f"| {d} | {kind} | {str(dtype)[6:]} | " + " | ".join(f"{x:.3g}" for x in row)
                  + f" | {differs:.1%} |")
    print(f"\nbf16 AwkwardLM, AdamW, {PARITY_STEPS} steps: largest weight difference from fp32 "
          "master weights on the full batch\n")
    print("| d | plain bf16 reduce-scatter | fp32 accumulation |")
    print("|---|---|---|")
    for d in WORLDS:
        results = run_cases(d, [(str(f), parity_trajectory, (_parity_run(f),))
                                for f in (False, True)])
        diffs = [max(v["max_diff"] for v in case_result(results, str(f))) for f in (False, True)]
        print(f"| {d} | {diffs[0]:.4g} | {diffs[1]:.4g} |")


if __name__ == "__main__":
    _print_table()
