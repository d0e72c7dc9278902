"""Overlapped grad reduction and param gather give exactly the results of the synchronous path.

Every case trains the same model twice in one process, with overlap on (``overlap_grad_reduce``
and ``overlap_param_gather``) and off, and compares the params after every step, bitwise: the
arithmetic is the same, only its timing moves. A plain torch reference on the full batch checks
both. The timing is perturbed the way FSDP2's tests expose ordering races: sleeps on some ranks
before each collective, before the optimizer step and after the forward. The model uses its
modules in an order unlike their registration order, with one bucket per layer, so the gathers
complete in an order the forward does not follow.

``StrictCollectives`` makes the ordering contract itself observable instead of hoping a race
shows: an async reduction is only run when it is waited for, and fails the case if its bucket's
grads changed after launch (a grad accumulated after its bucket was sent); an async gather
fills the bucket's other ranks' chunks with NaN until it is waited for, so a module reading a
param it did not wait for poisons the loss.
"""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distopt
from distopt.comm import collectives as comm

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, FP32_U, StrictCollectives, sum_tol, world_params
from models import batches, rank_slice

VOCAB, WIDTH = 11, 32
STEPS = 4
ORDER = (2, 0, 3, 1)  # the forward's use of self.layers, unlike their registration order
# Elements per bucket: 1056 per Linear, so each layer gets a bucket of its own, spread over
# every rank's shard; the final norm with the last bias, and the embedding, get one each.
BUCKET = 1100


class Shuffled(nn.Module):
    """Layers used out of registration order, an embedding tied to the head, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in ORDER)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for i in ORDER:
            h = h + torch.tanh(self.layers[i](h))
        return F.linear(self.norm(h), self.emb.weight)


def _loss(forward, tokens, targets) -> torch.Tensor:
    return F.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten())


class Delays:
    """Sleeps on odd ranks before each collective distopt issues (see [Note: param gather])."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds if dist.get_rank() % 2 == 1 else 0.0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> Delays:
        for name in ("reduce_scatter_avg", "all_gather"):
            fn = self._saved[name] = getattr(comm, name)
            setattr(comm, name, self._delayed(fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(comm, name, fn)

    def _delayed(self, fn):
        def delayed(*args, **kwargs):
            time.sleep(self.seconds)
            return fn(*args, **kwargs)

        return delayed


def _train(overlap: bool, delay: str, micro: int, strict: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Shuffled()
    ref = copy.deepcopy(model)
    ddp = distopt.DistributedDataParallel(
        model, bucket_size=BUCKET, overlap_grad_reduce=overlap
    )
    opt = distopt.DistributedOptimizer(
        ddp, torch.optim.AdamW, overlap_param_gather=overlap, lr=2e-2, weight_decay=0.1
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=0.1)
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    ref_flat = {ddp.param_names[p]: r for p, r in pairs}
    sleep = 0.003 if rank % 2 == 1 else 0.0

    # The first forward after construction sees rank 0's initial weights, as torch DDP does.
    tokens, _ = batches(0, global_batch=4 * world)
    first_forward = (ddp(tokens) - ref(tokens)).abs().max().item()

    snapshots, worst, launches = [], 0.0, []
    checker = StrictCollectives() if strict else contextlib.nullcontext()
    with Delays(0.003 if delay == "collectives" else 0.0), checker:
        for step in range(STEPS):
            tokens, targets = batches(step, global_batch=4 * micro * world)
            mine = [rank_slice(t, rank, world).chunk(micro) for t in (tokens, targets)]
            opt.zero_grad()
            if strict:
                checker.launched_before_sync = 0
            for i in range(micro):
                # With overlap, this forward waits for the previous step's gathers in flight.
                loss = _loss(ddp, mine[0][i], mine[1][i]) / micro
                if delay == "after_forward":
                    time.sleep(sleep)
                if i < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            if strict:
                launches.append(checker.launched_before_sync)
            if delay == "before_step":
                time.sleep(sleep)
            opt.step()

            ref_opt.zero_grad()
            _loss(ref, tokens, targets).backward()
            ref_opt.step()
            # Compare this rank's updated shard (the gather may still be in flight) with the
            # same elements of the reference.
            snapshots.append([m.detach().clone() for m in opt.main_params])
            for main in opt.main_params:
                param, piece = opt.piece_info(main)
                expected = ref_flat[ddp.param_names[param]].detach().flatten()
                r = piece.param_range
                worst = max(worst, (main - expected[r.start : r.end]).abs().max().item())
        ddp.finish_param_sync()
    final = max(
        (a - b).abs().max().item()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {
        "snapshots": snapshots,
        "max_diff": max(worst, final),
        "first_forward": first_forward,
        "buckets": len(ddp.buckets),
        "launched_in_backward": launches,
        "violations": checker.violations if strict else [],
    }


def overlap_vs_sync(delay: str, micro: int = 1, strict: bool = False) -> dict:
    """Train with overlap on and off in one process; return both results."""
    return {"on": _train(True, delay, micro, strict), "off": _train(False, delay, micro, strict)}


def strict_gather_with_first_use() -> dict:
    """Under StrictCollectives, a forward whose first module is the last registered layer
    still reads only gathered params, and the loss equals the synchronous one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = Shuffled()
        ddp = distopt.DistributedDataParallel(
            model, bucket_size=BUCKET, overlap_grad_reduce=overlap
        )
        opt = distopt.DistributedOptimizer(
            ddp, torch.optim.SGD, overlap_param_gather=overlap, lr=0.5
        )
        tokens, targets = (rank_slice(t, rank, world) for t in batches(0, global_batch=4 * world))
        with StrictCollectives():
            _loss(ddp, tokens, targets).backward()
            opt.step()
            pending = ddp.param_gathers_in_flight
            loss = _loss(ddp, tokens, targets).item()  # waits inside module pre-hooks only
        losses[overlap] = (loss, pending)
    return losses


def counts_per_step() -> dict:
    """Collectives of one overlapped step, as distopt records them and as gloo sees them."""
    torch.manual_seed(0)
    model = Shuffled()
    ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, overlap_param_gather=True)
    seen: list[tuple[str, int]] = []
    names = ("isend", "irecv", "all_to_all_single", "reduce", "broadcast", "all_reduce")
    saved = {name: getattr(dist, name) for name in names}

    def spy(name):
        def call(tensor, *args, **kwargs):
            seen.append((name, tensor.numel() * tensor.element_size()))
            return saved[name](tensor, *args, **kwargs)

        return call

    tokens, targets = batches(0, global_batch=4 * dist.get_world_size())
    for step in range(2):
        if step == 1:
            ddp.comm_stats.reset()
            for name in saved:
                setattr(dist, name, spy(name))
        opt.zero_grad()
        _loss(ddp, tokens, targets).backward()
        opt.step()
        ddp.finish_param_sync()
    for name, fn in saved.items():
        setattr(dist, name, fn)
    return {
        "calls": dict(ddp.comm_stats.calls),
        "bytes": dict(ddp.comm_stats.bytes),
        "seen": seen,
        "buffer_bytes": sum(b.layout.numel * 4 for b in ddp.flat_buffers),
        "buckets": len(ddp.buckets),
        "launch_order": [b.order for b in ddp.buckets],
        "first_bucket_params": [ddp.param_names[p] for p in ddp.buckets[0].params],
    }


def agreements_per_step() -> dict:
    """The agreements of one step (ddp/agreements.py): the grad statistics' all-gather is left
    in flight at the end of the backward and waited for by the next zero of the grads; a DDP
    built without them (the benchmarks' switch) runs none and refuses p.grad reads."""
    from distopt.ddp import agreements

    out = {}
    for variant in ("with", "without"):
        torch.manual_seed(0)
        with agreements.without() if variant == "without" else contextlib.nullcontext():
            ddp = distopt.DistributedDataParallel(Shuffled(), bucket_size=BUCKET)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW)
        tokens, targets = batches(0, global_batch=4 * dist.get_world_size())
        ddp.comm_stats.reset()
        opt.zero_grad()
        _loss(ddp, tokens, targets).backward()
        reads = ddp._grad_sync.reads
        pending_after_backward = reads.pending
        opt.step()
        opt.zero_grad()
        try:
            _loss(ddp, tokens, targets).backward()
            read = float(next(ddp.parameters()).grad.norm())
        except RuntimeError as error:
            read = str(error)
        opt.step()
        out[variant] = {"calls": dict(ddp.comm_stats.calls), "read": read,
                        "pending_after_backward": pending_after_backward,
                        "pending_after_zero": reads.pending}
    return out


def late_grads() -> dict:
    """Several backwards per step without no_sync, as torch DDP takes them (see [Note: several
    backwards per step]): two backwards reduce and add, overlapped or not, and a backward after
    the step (a GAN's discriminator reached by the generator's loss) is dropped by zero_grad as
    torch's is. SGD, whose step scales with the grad, so that a lost or stale grad would show."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batches(0, global_batch=4 * world)
    mine = [rank_slice(t, rank, world) for t in (tokens, targets)]
    two, after_step = {}, {}
    torch.manual_seed(0)
    ref = Shuffled()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        _loss(ref, tokens, targets).backward()  # torch: the two grads add up
    ref_opt.step()
    expected_two = [p.detach().clone() for p in ref.parameters()]
    for overlap in (True, False):
        torch.manual_seed(0)
        ddp = distopt.DistributedDataParallel(
            Shuffled(), bucket_size=BUCKET, overlap_grad_reduce=overlap
        )
        opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
        for _ in range(2):
            _loss(ddp, *mine).backward()  # neither no_sync nor zero_grad
            if not overlap:
                ddp.finish_grad_sync()  # each rank's buffer holds averages in its chunk only
        opt.step()
        ddp.finish_param_sync()
        two[overlap] = max((p.detach() - e).abs().max().item()
                           for p, e in zip(ddp.module.parameters(), expected_two, strict=True))
        opt.zero_grad()
        _loss(ddp, *mine).backward()
        opt.step()
        _loss(ddp, *mine).backward()  # after the step, without zero_grad: dropped next
        opt.zero_grad()
        _loss(ddp, *mine).backward()
        opt.step()
        ddp.finish_param_sync()
        after_step[overlap] = [p.detach().clone() for p in ddp.module.parameters()]

    # The same steps on a model that never saw the backwards after the step.
    torch.manual_seed(0)
    clean = distopt.DistributedDataParallel(Shuffled(), bucket_size=BUCKET)
    clean_opt = distopt.DistributedOptimizer(clean, torch.optim.SGD, lr=0.1)
    for backwards in (2, 1, 1):
        clean_opt.zero_grad()
        for _ in range(backwards):
            _loss(clean, *mine).backward()
        clean_opt.step()
    clean.finish_param_sync()
    expected_after_step = [p.detach().clone() for p in clean.module.parameters()]

    # All-reduced buckets: two backwards after a finished sync give the sum of both averages.
    torch.manual_seed(0)
    model = Shuffled()
    ref = copy.deepcopy(model)
    basic = distopt.DistributedDataParallel(model, use_distributed_optimizer=False)
    for _ in range(2):
        _loss(basic, *mine).backward()
        basic.finish_grad_sync()
    for _ in range(2):
        _loss(ref, tokens, targets).backward()
    accumulated = max(
        (p.main_grad - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return {
        "two_backwards_diff": two,
        "after_step_diff": {
            overlap: max((a - b).abs().max().item()
                         for a, b in zip(after_step[overlap], expected_after_step, strict=True))
            for overlap in (True, False)},
        "all_reduce_accumulated_diff": accumulated,
        "grad_scale": max(r.grad.abs().max().item() for r in ref.parameters()),
    }


def rewrap() -> dict:
    """A module wrapped again: a second DDP and optimizer over a module a first one trained,
    built while the first one's gathers are still in flight, trains as a fresh torch optimizer
    over the trained model; the first wrapper then refuses to train. ``release()`` leaves a
    plain module, and a ``with`` block releases at its end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Shuffled()
    ref = copy.deepcopy(model)

    def train(step_fn, zero_fn, forward, steps):
        for step in range(steps):
            tokens, targets = batches(step, global_batch=4 * world)
            zero_fn()
            if forward is ref:
                _loss(ref, tokens, targets).backward()
            else:
                _loss(forward, *(rank_slice(t, rank, world) for t in (tokens, targets))).backward()
            step_fn()

    out: dict = {}
    for run in range(2):  # each run: a new wrapper and a new AdamW, as a second trainer builds
        ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, overlap_param_gather=True,
                                           lr=2e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=0.1)
        train(opt.step, opt.zero_grad, ddp, 2)
        train(ref_opt.step, ref_opt.zero_grad, ref, 2)
        if run == 0:
            first, first_opt = ddp, opt
            out["in_flight_at_rewrap"] = ddp.param_gathers_in_flight
    ddp.finish_param_sync()
    out["diff"] = max((a - b).abs().max().item()
                      for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    out["first_released"] = first.released
    try:
        first_opt.zero_grad()
        out["first_error"] = None
    except RuntimeError as error:
        out["first_error"] = str(error)

    # release(): the same values, storage of its own, no hook, no main_grad; plain autograd.
    before = [p.detach().clone() for p in model.parameters()]
    buffers = {b.param_data.untyped_storage().data_ptr() for b in ddp.flat_buffers}
    assert ddp.release() is model and ddp.release() is model  # twice is harmless
    params = list(model.parameters())
    out["same_values"] = all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    out["own_storage"] = all(p.untyped_storage().data_ptr() not in buffers for p in params)
    out["no_main_grad"] = not any(hasattr(p, "main_grad") for p in params)
    out["no_hooks"] = not any(p._post_accumulate_grad_hooks for p in params) and not any(
        m._forward_pre_hooks for m in model.modules())
    tokens, targets = batches(0, global_batch=4 * world)
    _loss(model, tokens, targets).backward()
    ref.zero_grad()
    _loss(ref, tokens, targets).backward()
    out["plain_grads"] = max((p.grad - r.grad).abs().max().item()
                             for p, r in zip(params, ref.parameters(), strict=True))
    model.zero_grad()
    with distopt.DistributedDataParallel(model, bucket_size=BUCKET) as scoped:
        scoped_opt = distopt.DistributedOptimizer(scoped, torch.optim.SGD, lr=0.1)
        train(scoped_opt.step, scoped_opt.zero_grad, scoped, 1)
    out["scoped_released"] = scoped.released and not any(
        p._post_accumulate_grad_hooks for p in model.parameters())
    return out


DELAYS = ("none", "collectives", "before_step", "after_forward")


def _cases() -> list:
    cases = [(f"delay-{d}", overlap_vs_sync, (d,)) for d in DELAYS]
    cases.append(("no-sync", overlap_vs_sync, ("collectives", 3)))
    cases.append(("strict", overlap_vs_sync, ("none", 2, True)))
    cases.append(("strict-first-use", strict_gather_with_first_use, ()))
    cases.append(("counts", counts_per_step, ()))
    cases.append(("late-grads", late_grads, ()))
    cases.append(("agreements", agreements_per_step, ()))
    cases.append(("rewrap", rewrap, ()))
    return cases


WORLDS = [2, 3]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


def _assert_identical(value: dict) -> None:
    on, off = value["on"], value["off"]
    for step, (a, b) in enumerate(zip(on["snapshots"], off["snapshots"], strict=True)):
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb), f"overlap on and off differ after step {step}"
    for run in (on, off):
        assert run["max_diff"] <= FP32_TOL, run["max_diff"]
        assert run["first_forward"] <= 1e-6
    # The weights really moved, so equality is not that of two untouched models.
    moved = max((a - b).abs().max().item()
                for a, b in zip(on["snapshots"][-1], on["snapshots"][0], strict=True))
    assert moved > 1e-2


@pytest.mark.parametrize("delay", DELAYS)
def test_overlap_is_bitwise_identical_under_delays(world, delay):
    _, results = world
    for value in case_result(results, f"delay-{delay}"):
        _assert_identical(value)


def test_the_grad_statistics_are_agreed_off_the_critical_path(world):
    for value in case_result(world[1], "agreements"):
        with_, without = value["with"], value["without"]
        # Two backwards, each one all-gather of the statistics, left in flight by the
        # backward and waited for by the next zero (or the first read).
        assert with_["calls"]["agree_grad_statistics"] == 2
        assert with_["pending_after_backward"] and not with_["pending_after_zero"]
        assert isinstance(with_["read"], float) and with_["read"] > 0
        assert "agree_grad_statistics" not in without["calls"]
        assert without["calls"]["reduce_scatter"] == with_["calls"]["reduce_scatter"]
        assert "without agreements" in without["read"], without["read"]


def test_no_sync_micro_batches_with_overlap(world):
    _, results = world
    for value in case_result(results, "no-sync"):
        _assert_identical(value)


def test_waits_are_where_the_data_is_used(world):
    _, results = world
    for value in case_result(results, "strict"):
        _assert_identical(value)
        on, off = value["on"], value["off"]
        assert on["violations"] == [] and off["violations"] == []
        # Overlap on: every bucket launched during the last micro-batch's backward (all params
        # get grads), none during the no_sync one; off: none before finish_grad_sync.
        assert on["launched_in_backward"] == [on["buckets"]] * STEPS
        assert off["launched_in_backward"] == [0] * STEPS


def test_forward_waits_for_each_bucket_before_first_use(world):
    _, results = world
    for value in case_result(results, "strict-first-use"):
        (loss_on, pending_on), (loss_off, pending_off) = value[True], value[False]
        assert pending_on == 6 and pending_off == 0  # gathers really were in flight
        assert loss_on == loss_off and loss_on == loss_on  # equal, and not NaN


def test_one_reduce_scatter_and_one_all_gather_per_bucket(world):
    d, results = world
    for value in case_result(results, "counts"):
        buckets, buffer_bytes = value["buckets"], value["buffer_bytes"]
        assert buckets == 6  # see BUCKET
        # and the small all-gather of what p.grad reads ([Note: p.grad under distopt]).
        assert value["calls"] == {"reduce_scatter": buckets, "all_gather": buckets,
                                  "agree_grad_statistics": 1}
        # Reduce-scatter plus all-gather of the whole buffer: one all-reduce's worth.
        assert {op: n for op, n in value["bytes"].items()
                if op != "agree_grad_statistics"} == {
            "reduce_scatter": buffer_bytes, "all_gather": buffer_bytes}
        # On gloo both are point-to-point: per bucket, each rank sends every other rank its
        # chunk of the grads, then its chunk of the params, and receives theirs; nothing else.
        seen = value["seen"]
        assert sorted({name for name, _ in seen}) == ["irecv", "isend"]
        for name in ("isend", "irecv"):
            assert sum(1 for n, _ in seen if n == name) == 2 * (d - 1) * buckets
            assert sum(b for n, b in seen if n == name) * d == 2 * buffer_bytes * (d - 1)
        # Buckets are launched in layout order, reverse registration (the usual backward
        # order), filled greedily up to BUCKET elements: the final norm and the last bias.
        assert value["launch_order"] == list(range(buckets))
        assert value["first_bucket_params"] == ["norm.bias", "norm.weight", "layers.3.bias"]


def test_several_backwards_per_step_add_as_torch_ddp(world):
    d, results = world
    for value in case_result(results, "late-grads"):
        # Each grad sums the same terms as torch's, two backwards of 4 d sequences of 5 tokens,
        # in another order: within sum_tol of the terms' size, taken as the largest grad's.
        grads_tol = sum_tol(2 * 4 * d * 5, value["grad_scale"])
        # Two backwards without no_sync: the sum of both averages, as torch's. One SGD step at
        # lr 0.1 of those grads, rounded into weights below 8 (one ulp there: 8 FP32_U).
        weights_tol = 0.1 * grads_tol + 8 * FP32_U
        assert value["two_backwards_diff"][True] <= weights_tol, value
        assert value["two_backwards_diff"][False] <= weights_tol, value
        # A backward after the step, then zero_grad(): that of a model that never saw it.
        assert value["after_step_diff"] == {True: 0.0, False: 0.0}
        # All-reduced buckets accumulate across synced backwards like torch DDP.
        assert value["grad_scale"] > 1e-2
        assert value["all_reduce_accumulated_diff"] <= grads_tol, value


def test_a_module_wrapped_again_trains_and_release_leaves_a_plain_module(world):
    _, results = world
    for value in case_result(results, "rewrap"):
        assert value["in_flight_at_rewrap"] > 0  # the takeover waited for them
        # Two wrappers in turn train as two AdamWs in turn on the whole batch.
        assert value["diff"] <= FP32_TOL, value["diff"]
        assert value["first_released"]
        assert "no longer holds its module (a newer distopt.DistributedDataParallel wrapped " \
            "its parameter '" in value["first_error"]
        for key in ("same_values", "own_storage", "no_main_grad", "no_hooks", "scoped_released"):
            assert value[key], key
        # The grads of weights value["diff"] apart (at most FP32_TOL), of size up to 5: the
        # loss's curvature here is of order 1, so they differ by about as much.
        assert value["plain_grads"] <= FP32_TOL, value
