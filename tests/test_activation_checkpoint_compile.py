"""Activation checkpointing and per-block torch.compile under distopt, d = 2, against plain torch.

Users wrap each transformer block in ``torch.utils.checkpoint.checkpoint`` (reentrant, as
Hugging Face's ``gradient_checkpointing_enable`` does, or not), or compile each block
(``model.blocks[i] = torch.compile(model.blocks[i])``, or ``block.compile()``), and hand the
model to distopt unchanged. Every rank trains its slice of the same global batches with distopt
and, in the same process, plain torch (no checkpointing, no compile) on the whole batches, as
in test_parity.py. Nothing waits for the param gathers between steps: the next forward does, in
distopt's hooks, which run inside the checkpointed or compiled blocks. The weights are compared
right after that forward, and again after the last step.

A lost grad must show: each case also trains plain torch with the grads of the first block
dropped (the block backward reaches last; with reentrant checkpointing, the last inner
backward), and distopt must be far from that run; every parameter must have moved.

Small buckets put bucket boundaries inside the blocks, so that reductions are launched from a
reentrant checkpoint's inner backward and a compiled block waits for a gather inside its own
graph. Under helpers.StrictCollectives a grad accumulated after its bucket was sent, or a
param read before its gather was waited for, fails the case instead of depending on timing.

Compile uses the inductor backend, the real case: on a CPU it builds C++ kernels with the
system compiler and caches them on disk (inductor's cache directory), so only a first run pays
for the build. One compile thread per rank keeps the two ranks on two cores.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import distopt

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, FP32_U, StrictCollectives, max_diff
from models import TinyTransformer, markov_batch, rank_slice

pytestmark = pytest.mark.slow

WORLD = 2

# AdamW at lr 1e-2 over 20 steps, as in test_parity.py: each rank's grads are sums over half
# the batch, averaged across ranks after, so they differ from the reference's in float32
# roundoff, and Adam turns the roundoff of a grad near its eps into a step of up to lr. Within
# helpers.FP32_TOL: this very trajectory in fp32 stays within 1.04e-5 of its fp64 run, whatever
# the order of the batch's sums (helpers.ADAMW_FP32_DRIFT).
CKPT_STEPS = 20
CKPT_OPT = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.0})
CKPT_TOL = FP32_TOL
# A block holds 12,608 elements: at 3,000 per bucket each block spans seven buckets, and three
# buckets hold params of two blocks, or of a block and the layers around it.
CKPT_BUCKET = 3000

# Inductor fuses and reorders the block's arithmetic, so even on one process and one batch its
# grads differ from eager's in roundoff; with AdamW that alone moves some weights by 6e-6 in the
# first step (a grad near eps). SGD's step is proportional to the grad, which keeps the
# difference at the roundoff of the weights: each step rounds a weight (below 2, where one fp32
# ulp is 2**-23 = 2 * FP32_U) once, and the grads' own roundoff, a few FP32_U of grads below 1,
# moves it by lr = 0.1 times that; allow one ulp a step.
COMPILE_STEPS = 10
COMPILE_OPT = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
COMPILE_TOL = COMPILE_STEPS * 2 * FP32_U  # 1.2e-6
# Two buckets, split inside the first block (between its fc2 weight and bias): after a step,
# the hook of that block's fc2 waits for a gather inside the compiled graph, while the second
# block finds all of its params gathered.
COMPILE_BUCKET = 14000

# Without weight decay a parameter moves only by its grads: each tensor must have moved by more
# than this (Adam moves an element by about lr a step).
MOVED = 1e-3
# Losing the first block's grads moves the weights far more than the tolerance allows.
DROPPED_FACTOR = 100


class CheckpointedTransformer(TinyTransformer):
    """TinyTransformer whose blocks run under ``checkpoint`` when ``use_reentrant`` is set, as
    a Hugging Face model does after ``gradient_checkpointing_enable``."""

    def __init__(self) -> None:
        super().__init__()
        self.use_reentrant: bool | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            if self.use_reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(self.norm(h))


def _loss(forward, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten())


def _owner(name: str) -> str:
    parts = name.split(".")
    return f"blocks.{parts[1]}" if parts[0] == "blocks" else "outside the blocks"


def _prepare_compile() -> None:
    torch._inductor.config.compile_threads = 1
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _compile_each_block(model: CheckpointedTransformer) -> None:
    _prepare_compile()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="inductor")


def _compile_each_block_in_place(model: CheckpointedTransformer) -> None:
    _prepare_compile()
    for block in model.blocks:
        block.compile(backend="inductor")


def _checkpoint_each_block(use_reentrant: bool | None):
    def setup(model: CheckpointedTransformer) -> None:
        model.use_reentrant = use_reentrant

    return setup


SETUPS = {
    "no-checkpoint": _checkpoint_each_block(None),
    "reentrant": _checkpoint_each_block(True),
    "non-reentrant": _checkpoint_each_block(False),
    "compile": _compile_each_block,
    "compile-in-place": _compile_each_block_in_place,
}


@functools.cache
def plain_runs(opt_cls: type, kwargs: tuple, steps: int) -> tuple[list[list[torch.Tensor]],
                                                                   list[torch.Tensor]]:
    """Plain torch on the whole batches, from the model every case starts from: its params
    after each of ``steps`` steps (the first entry before any), and the params of the run that
    loses the first block's grads, at the end. Neither depends on the case's setup (checkpoint
    or compile acts on distopt's model alone), its buckets or overlap, nor on the rank, so a
    test process trains each (optimizer, steps) once and the cases that share it compare
    against the same copy."""
    torch.manual_seed(0)
    ref = CheckpointedTransformer()  # plain torch, on the whole batch
    dropped = copy.deepcopy(ref)  # plain torch that loses the first block's grads
    ref_opt = opt_cls(ref.parameters(), **dict(kwargs))
    dropped_opt = opt_cls(dropped.parameters(), **dict(kwargs))
    trajectory = [[p.detach().clone() for p in ref.parameters()]]
    for step in range(steps):
        tokens, targets = markov_batch(step)
        ref_opt.zero_grad()
        _loss(ref, tokens, targets).backward()
        ref_opt.step()
        trajectory.append([p.detach().clone() for p in ref.parameters()])
        dropped_opt.zero_grad()
        _loss(dropped, tokens, targets).backward()
        for p in dropped.blocks[0].parameters():
            p.grad = None
        dropped_opt.step()
    return trajectory, [p.detach().clone() for p in dropped.parameters()]


def _diff(model: torch.nn.Module, params: list[torch.Tensor]) -> float:
    """helpers.max_diff of ``model`` against plain params in its parameters' order (a compiled
    block's params are named under ``_orig_mod``, the plain model's are not)."""
    return max_diff(model, {name: q for (name, _), q
                            in zip(model.named_parameters(), params, strict=True)})


def train(setup: str, optim: tuple, steps: int, bucket_size: int, overlap_grad_reduce: bool,
          overlap_param_gather: bool, strict: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_cls, kwargs = optim
    ref, dropped = plain_runs(opt_cls, tuple(sorted(kwargs.items())), steps)
    torch.manual_seed(0)
    model = CheckpointedTransformer()
    start = copy.deepcopy(model)
    SETUPS[setup](model)
    compiled = setup.startswith("compile")
    ddp = distopt.DistributedDataParallel(
        model, bucket_size=bucket_size, overlap_grad_reduce=overlap_grad_reduce
    )
    opt = distopt.DistributedOptimizer(
        ddp, opt_cls, overlap_param_gather=overlap_param_gather, **kwargs
    )

    diffs, launched, graphs = [], [], []
    checker = StrictCollectives() if strict else contextlib.nullcontext()
    with checker:
        for step in range(steps):
            tokens, targets = markov_batch(step)
            opt.zero_grad()
            ddp.comm_stats.reset()
            if strict:
                checker.launched_before_sync = 0
            loss = _loss(ddp, rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
            # The forward waited for the previous step's gathers: these are the weights it used.
            diffs.append(_diff(model, ref[step]))
            loss.backward()
            launched.append(checker.launched_before_sync if strict
                            else ddp.comm_stats.calls["reduce_scatter"])
            opt.step()
            if compiled:
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        ddp.finish_param_sync()
    diffs.append(_diff(model, ref[steps]))
    moved = [(p.detach() - q).abs().max()
             for p, q in zip(model.parameters(), start.parameters(), strict=True)]
    return {
        "max_diff": torch.tensor(diffs).max().item(),  # nan if any is
        "dropped_diff": _diff(model, dropped),
        "moved": torch.stack(moved).min().item(),  # by the tensor that moved least
        "launched": launched,
        "buckets": len(ddp.buckets),
        "shared_buckets": sum(len({_owner(ddp.param_names[p]) for p in b.params}) > 1
                              for b in ddp.buckets),
        "block_buckets": [sum(not set(b.params).isdisjoint(block.parameters())
                              for b in ddp.buckets) for block in model.blocks],
        "violations": checker.violations if strict else [],
        "final": [p.detach().clone() for p in model.parameters()],
        "graphs": graphs,
        "graph_breaks": (sum(torch._dynamo.utils.counters["graph_break"].values())
                         if compiled else 0),
    }


CKPT = (CKPT_OPT, CKPT_STEPS, CKPT_BUCKET)
CKPT_SHORT = (CKPT_OPT, 8, CKPT_BUCKET)
COMPILE = (COMPILE_OPT, COMPILE_STEPS, COMPILE_BUCKET)
COMPILE_SHORT = (COMPILE_OPT, 4, COMPILE_BUCKET)
# name: (setup, (optimizer, steps, bucket), overlap_grad_reduce, overlap_param_gather, strict)
CASES = {
    "no-checkpoint": ("no-checkpoint", CKPT, True, True, False),
    "reentrant": ("reentrant", CKPT, True, True, False),
    "non-reentrant": ("non-reentrant", CKPT, True, True, False),
    "reentrant-strict": ("reentrant", CKPT_SHORT, True, True, True),
    "reentrant-no-overlap": ("reentrant", CKPT_SHORT, False, False, False),
    "compile": ("compile", COMPILE, True, True, False),
    "compile-strict": ("compile", COMPILE_SHORT, True, True, True),
    "compile-in-place": ("compile-in-place", COMPILE, True, False, False),
}
CKPT_CASES = [name for name, case in CASES.items() if not case[0].startswith("compile")]
COMPILE_CASES = [name for name, case in CASES.items() if case[0].startswith("compile")]


@pytest.fixture(scope="module")
def results():
    cases = [(name, train, (setup, *run, overlap_grad, overlap_gather, strict))
             for name, (setup, run, overlap_grad, overlap_gather, strict) in CASES.items()]
    return run_cases(WORLD, cases)


def _check_training(value: dict, case: str, tol: float) -> None:
    overlap_grad_reduce = CASES[case][2]
    assert value["max_diff"] <= tol, value["max_diff"]
    assert value["dropped_diff"] > DROPPED_FACTOR * tol, value["dropped_diff"]
    assert value["moved"] > MOVED, value["moved"]
    assert value["violations"] == []
    # With overlap every bucket's reduction started during backward, none in step(): all
    # grads, those of the checkpointed or compiled blocks included, arrived through the hooks.
    expected = value["buckets"] if overlap_grad_reduce else 0
    assert value["launched"] == [expected] * len(value["launched"])


@pytest.mark.parametrize("case", CKPT_CASES)
def test_checkpointed_blocks_match_plain_torch(results, case):
    for value in case_result(results, case):
        _check_training(value, case, CKPT_TOL)
        # Bucket boundaries fall inside each block, and some buckets hold two blocks' params.
        assert min(value["block_buckets"]) > 1 and value["shared_buckets"] > 0, value


@pytest.mark.parametrize("case", ["reentrant", "non-reentrant"])
def test_checkpointing_changes_no_bit(results, case):
    # Recomputation repeats the same kernels on the same inputs, so a checkpointed run is the
    # non-checkpointed one bit for bit, rank by rank.
    ranks = zip(case_result(results, "no-checkpoint"), case_result(results, case), strict=True)
    for unchanged, value in ranks:
        for a, b in zip(unchanged["final"], value["final"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compiled_blocks_match_plain_torch(results, case):
    for value in case_result(results, case):
        _check_training(value, case, COMPILE_TOL)
        # A bucket boundary falls inside a block: that block waits for a gather in its graph.
        assert max(value["block_buckets"]) > 1, value


def test_compiled_blocks_stay_compiled(results):
    # With nothing in flight, distopt's hooks inside a block trace into its graph: both blocks
    # run one graph, traced once, with no graph break.
    for value in case_result(results, "compile-in-place"):
        assert value["graph_breaks"] == 0
        assert value["graphs"] == [1] * COMPILE_STEPS
    # A block that waits for a gather breaks its graph there (the wait is a collective), and
    # the forwards after the first, which find gathers in flight, are traced once more; after
    # that no step recompiles.
    for value in case_result(results, "compile"):
        graphs = value["graphs"]
        assert graphs[0] == 1
        assert graphs[1:] == [graphs[1]] * (COMPILE_STEPS - 1), graphs
