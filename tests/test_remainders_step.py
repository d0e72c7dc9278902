"""store_param_remainders with bf16/fp16 grads: no persistent fp32 main grads, d = 1, 2, 4.

The step of an optimizer with remainders sees the fp32 masters and, for bf16/fp16 grads, the
fp32 main grads one bucket's shard at a time. Here it runs beside the fp32-master path on the
same grads (a loss linear in the params, so both runs get the same grads whatever their params)
with everything a step does around the inner optimizer: clipping to a global norm, counting
zeros, a dynamic loss scale that skips overflowing fp16 steps, a param no rank uses on odd
steps. The masters, the optimizer state, the grad norms, the zero counts and the skipped steps
must be the same bits. Then the memory each rank holds, by component, against the formula, and
the peak of what a step allocates, against one bucket's shard.

    PYTHONPATH=src:tests python tests/test_remainders_step.py    # prints the measured table
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import distopt
from distopt.memory import bytes_per_param_breakdown
from distopt.optim.remainders import bf16_of_fp32

from dist_harness import case_result, run_cases
from helpers import world_params
from models import mlp

WORLDS = [1, 2, 4]
STEPS = 8
OPTION = "store_param_remainders"
SKIPPED_PARAM = 1  # index of the param whose loss term is left out on odd steps
CONFIGS = {
    # name: (optimizer class, kwargs, grad dtype, loss scaler?, fp32-accumulated reduction?)
    "adamw-bf16": (
        torch.optim.AdamW,
        dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
        torch.bfloat16,
        False,
        True,
    ),
    "sgd-bf16": (torch.optim.SGD, dict(lr=0.5, momentum=0.9), torch.bfloat16, False, False),
    "adamw-fp16-scaled": (torch.optim.AdamW, dict(lr=1e-2), torch.float16, True, False),
    # Muon for the matrices, each owned whole by one rank, and AdamW for the biases.
    "muon-adamw-bf16": (torch.optim.Muon, dict(lr=2e-2), torch.bfloat16, False, False),
}


def _coefficients(p: nn.Parameter, step: int, rank: int, index: int) -> torch.Tensor:
    """This rank's grad of ``p`` at ``step``: every seventh element zero (so zeros are counted),
    the rest N(0, 1) of differing scale per param (so clipping matters)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * index + rank)
    c = torch.randn(p.shape, generator=g) * 2.0 ** (index % 4 - 2)
    c.view(-1)[::7] = 0.0
    return c


def _linear_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    terms = [
        (p.float() * _coefficients(p, step, rank, i)).sum()
        for i, p in enumerate(model.parameters())
        if not (i == SKIPPED_PARAM and step % 2 == 1)
    ]
    return torch.stack(terms).sum()


def _build(base: nn.Module, name: str, remainders: bool, bucket_size: int = 600):
    opt_cls, kwargs, grad_dtype, scaled, fp32_accum = CONFIGS[name]
    model = copy.deepcopy(base)
    ddp = distopt.DistributedDataParallel(
        model,
        grad_dtype=grad_dtype,
        bucket_size=bucket_size,
        find_unused_parameters=True,
        reduce_scatter_with_fp32_accumulation=fp32_accum,
    )
    # hysteresis=1: the first steps, at scale 2**16, overflow fp16 and are skipped.
    scaler = distopt.DynamicLossScaler(hysteresis=1) if scaled else None
    groups = None
    if opt_cls is torch.optim.Muon:
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() == 2]},
            {
                "params": [p for p in params if p.dim() == 1],
                "optimizer": torch.optim.AdamW,
                "lr": 1e-2,
            },
        ]
    opt = distopt.DistributedOptimizer(
        ddp,
        opt_cls,
        params=groups,
        clip_grad=1.0,
        log_num_zeros=True,
        loss_scaler=scaler,
        **kwargs,
        **{OPTION: remainders},
    )
    return model, ddp, opt


def same_bits_as_the_fp32_master_path(name: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = mlp([24, 40, 17], dtype=torch.bfloat16)
    runs = {r: _build(base, name, r) for r in (True, False)}
    (_, ddp_r, opt_r), (_, _, opt_f) = runs[True], runs[False]
    out = {
        "results": {True: [], False: []},
        "masters_equal": [],
        "state_equal": [],
        "params_split": [],
        "grads_between_steps": [],
        "buckets": len(ddp_r.buckets),
    }
    for step in range(STEPS):
        for remainders, (model, ddp, opt) in runs.items():
            opt.zero_grad()
            opt.scale_loss(_linear_loss(model, step, rank)).backward()
            result = opt.step()
            out["results"][remainders].append((result.updated, result.grad_norm, result.num_zeros))
            ddp.finish_param_sync()
        masters = opt_r.main_param_values()
        refs = [m.detach() for m in opt_f.main_params]
        out["masters_equal"].append(
            all(
                torch.equal(a.view(torch.int32), b.view(torch.int32))
                for a, b in zip(masters, refs, strict=True)
            )
        )
        out["state_equal"].append(
            all(
                set(opt_r.state[a]) == set(opt_f.state[b])
                and all(torch.equal(opt_r.state[a][k], opt_f.state[b][k]) for k in opt_r.state[a])
                for a, b in zip(opt_r.main_params, opt_f.main_params, strict=True)
            )
        )
        out["params_split"].append(
            all(
                torch.equal(
                    param.detach()
                    .reshape(-1)[piece.param_range.start : piece.param_range.end]
                    .view(torch.int16),
                    bf16_of_fp32(master).reshape(-1).view(torch.int16),
                )
                for (param, piece, _), master in zip(opt_r.pieces(), masters, strict=True)
            )
        )
        out["grads_between_steps"].append([m.grad is None for m in opt_r.main_params].count(False))
    out["scales"] = [
        opt.loss_scaler.scale if opt.loss_scaler else None for _, _, opt in runs.values()
    ]
    # The zeros the grads have by construction: every seventh element, and the whole param
    # that no rank uses on odd steps.
    sizes = [p.numel() for p in base.parameters()]
    sevenths = sum(-(-n // 7) for n in sizes)
    out["zeros_by_parity"] = [
        sevenths,
        sevenths + sizes[SKIPPED_PARAM] - -(-sizes[SKIPPED_PARAM] // 7),
    ]
    return out


def _owned_elements(opt) -> int:
    return sum(piece.local_range.end - piece.local_range.start for _, piece, _ in opt.pieces())


def memory(grad_dtype: torch.dtype, remainders: bool) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = mlp([64, 96, 80, 33], dtype=torch.bfloat16)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=6000)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, lr=1e-3, clip_grad=1.0, **{OPTION: remainders}
    )
    opt.zero_grad()
    ddp(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    report = distopt.measure_state_bytes(opt)
    padded = sum(buf.layout.numel for buf in ddp.flat_buffers)
    theory = bytes_per_param_breakdown(torch.bfloat16, grad_dtype, **{OPTION: remainders})
    return {
        "report": report,
        "padded": padded,
        "owned": _owned_elements(opt),
        "theory": theory,
        "total": theory.total(world),
        "d": world,
    }


def _peak_bytes(fn) -> tuple[int, int]:
    """The peak, over ``fn``, of the CPU bytes allocated since it began and not yet freed,
    and what of them is still held at its end. From the profiler's allocation events, paired
    by address: freeing a block allocated before ``fn`` began does not count against it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append(
                (node.start_time_ns, fields.alloc_size < 0, fields.ptr, fields.alloc_size)
            )
    live = peak = 0
    allocated: dict[int, int] = {}
    for _, _, ptr, size in sorted(events):
        if size > 0:
            allocated[ptr] = size
            live += size
        elif ptr in allocated:
            live -= allocated.pop(ptr)
        peak = max(peak, live)
    return peak, live


def peak_transient(grad_dtype: torch.dtype, remainders: bool) -> dict:
    """What ``opt.step()`` allocates at its peak, on a model of 8 equal buckets."""
    torch.manual_seed(0)
    model = mlp([128] * 9, dtype=torch.bfloat16)  # 8 layers of 128 * 129 elements
    ddp = distopt.DistributedDataParallel(model, grad_dtype=grad_dtype, bucket_size=128 * 129)
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, lr=1e-3, clip_grad=1.0, **{OPTION: remainders}
    )
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    peaks = []
    for _ in range(3):  # the first step allocates Adam's state; measure the next two
        opt.zero_grad()
        ddp(x).float().square().mean().backward()
        ddp.finish_grad_sync()  # the reductions' buffers are not the step's
        peaks.append(_peak_bytes(opt.step))
        ddp.finish_param_sync()
    shards = [b.param_shard.numel() for b in ddp.buckets]
    return {
        "peaks": peaks[1:],
        "buckets": len(shards),
        "largest_shard": max(shards),
        "shard": sum(shards),
        "owned": _owned_elements(opt),
        "model": sum(b.param_data.numel() for b in ddp.buckets),
    }


def _cases() -> list:
    cases = [(f"exact-{n}", same_bits_as_the_fp32_master_path, (n,)) for n in CONFIGS]
    cases += [
        (f"memory-{str(g)[6:]}-{r}", memory, (g, r))
        for g in (torch.bfloat16, torch.float32)
        for r in (True, False)
    ]
    cases += [
        (f"peak-{str(g)[6:]}-{r}", peak_transient, (g, r))
        for g in (torch.bfloat16, torch.float32)
        for r in (True, False)
    ]
    return cases


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_bits_as_the_fp32_master_path(world, name):
    d, results = world
    values = case_result(results, f"exact-{name}")
    for value in values:
        assert value["buckets"] >= 2
        assert value["masters_equal"] == [True] * STEPS, value
        assert value["state_equal"] == [True] * STEPS, value
        assert value["params_split"] == [True] * STEPS, value
        # Grad norms, zero counts and skipped steps: the same numbers, on every rank.
        assert value["results"][True] == value["results"][False] == values[0]["results"][True]
        assert value["grads_between_steps"] == [0] * STEPS  # no fp32 main grads kept
    results_r = values[0]["results"][True]
    updates = [r for r in results_r if r[0]]
    assert all(norm > 1.0 for _, norm, _ in updates)  # clipping scaled every update
    # Zeros: every seventh element of every rank's grad, and the skipped param on odd steps
    # (plus the rare elements where the ranks' bf16/fp16 grads cancel exactly).
    for step, (updated, _, zeros) in enumerate(results_r):
        if updated:
            expected = values[0]["zeros_by_parity"][step % 2]
            assert expected <= zeros <= expected * 1.05, (step, zeros, expected)
    if name.endswith("scaled"):
        # Scale 2**16 overflows the fp16 grads: skipped on every rank until it has backed off.
        assert [r[0] for r in results_r][:2] == [False, False] and len(updates) >= 3
        assert values[0]["scales"][0] == values[0]["scales"][1] < 2**16
    else:
        assert len(updates) == STEPS


@pytest.mark.parametrize("grad", ["bfloat16", "float32"])
@pytest.mark.parametrize("remainders", [True, False])
def test_memory_per_component_is_the_formula(world, grad, remainders):
    d, results = world
    for value in case_result(results, f"memory-{grad}-{remainders}"):
        report, theory, padded = value["report"], value["theory"], value["padded"]
        # The model's buffers are whole on every rank, the rest is this rank's padded shard
        # (the optimizer's state covers the owned elements only).
        assert report.params == theory.params * padded
        assert report.grads == theory.grads * padded
        assert report.main_params == theory.main_params * padded // d
        assert report.main_grads == theory.main_grads * padded // d
        assert report.optimizer_state == theory.optimizer_state * value["owned"]
        assert value["total"] <= report.bytes_per_param < value["total"] * 1.05
    if remainders:
        assert case_result(results, f"memory-{grad}-True")[0]["theory"].main_grads == 0
        if grad == "bfloat16":
            assert case_result(results, f"memory-{grad}-True")[0]["total"] == 4 + 10 / d


def test_peak_transient_is_one_bucket_shard(world):
    """With remainders the step's peak is one bucket's fp32 master, its fp32 grads (bf16
    grads only) and AdamW's one temporary (the sqrt of the second moment) of the same size;
    the fp32-master path's is AdamW's temporary of the whole shard."""
    d, results = world
    for grad, grad_bytes in (("bfloat16", 4), ("float32", 0)):
        for value in case_result(results, f"peak-{grad}-True"):
            assert value["buckets"] == 8
            bound = (4 + grad_bytes + 4) * value["largest_shard"] + 4096  # + scalars
            for peak, held in value["peaks"]:
                assert held <= 64, value  # nothing of the shard's size outlives the step
                assert (4 + grad_bytes) * value["largest_shard"] < peak <= bound, value
                # A small fraction of one fp32 copy of the model, or of this rank's shard.
                assert peak <= (4 + grad_bytes + 4) / 8 * 4 * value["shard"] + 4096
        for value in case_result(results, f"peak-{grad}-False"):
            for peak, _ in value["peaks"]:
                assert peak >= 4 * value["owned"], value


def _print_table() -> None:
    print(
        "| d | grads | path | largest bucket shard (elements) | rank's shard (elements) "
        "| step peak (bytes) | bytes per element of the largest bucket shard "
        "| bytes per element of the rank's shard |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in WORLDS:
        results = run_cases(d, [c for c in _cases() if c[0].startswith("peak-")])
        for grad in ("bfloat16", "float32"):
            for remainders in (True, False):
                value = case_result(results, f"peak-{grad}-{remainders}")[0]
                peak = max(p for p, _ in value["peaks"])
                path = "remainders" if remainders else "fp32 masters"
                print(
                    f"| {d} | {grad} | {path} | {value['largest_shard']} | {value['shard']} "
                    f"| {peak} | {peak / value['largest_shard']:.2f} "
                    f"| {peak / value['shard']:.2f} |"
                )


if __name__ == "__main__":
    _print_table()
