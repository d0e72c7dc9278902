"""torch DDP scripts under distopt's DDP: torch's meaning, or a refusal on every rank that
names what works ([Note: torch DDP's spellings] in ddp/torch_compat/torch_spellings.py), each
against torch's own DDP on the same ranks.

One process: the arguments' checks, bucket_cap_mb's size, zero-size params, requires_grad
changed after wrapping, params converted after wrapping, comm hooks and join. At d = 2 and 3
(``both``): the ignore list (those params local to each rank, the rest averaged),
pytorch/examples' DCGAN loop in every sharding mode, a param no forward uses (refused as torch
refuses it, or left out of the step as torch leaves it), torch's EMA under sharded params, and
the optimizer saved torch's way on rank 0 and resumed at the same d and on one process. At d =
2: init_sync=False, and the state dict and copies under sharded params (torch's DCP state-dict
functions: tests/test_torch_dcp_state_dict.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt

from dist_harness import case_result, run_cases
from helpers import shared_tmpdir
from models import mlp

IGNORED = ["2.weight", "2.bias"]  # the middle Linear of mlp([6, 8, 8, 3])
STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp([6, 8, 8, 3])


def _batch(step: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


# ---------------------------------------------------------------- one process


def test_bucket_cap_mb_sizes_the_buckets_in_mib_of_grads():
    ddp = distopt.DistributedDataParallel.for_this_process(_model(), bucket_cap_mb=0.0001)
    assert ddp.bucket_size == int(0.0001 * 2**20 / 4)  # fp32 grads: 26 elements
    bf16 = distopt.DistributedDataParallel.for_this_process(
        _model(), bucket_cap_mb=0.0001, grad_dtype=torch.bfloat16)
    assert bf16.bucket_size == int(0.0001 * 2**20 / 2)
    with pytest.raises(ValueError, match="pass one"):
        distopt.DistributedDataParallel.for_this_process(_model(), bucket_size=10,
                                                         bucket_cap_mb=1)


def test_torch_arguments_accepted_or_refused_by_name():
    make = distopt.DistributedDataParallel.for_this_process
    ddp = make(_model(), device_ids=None, output_device=None, dim=0, static_graph=True,
               gradient_as_bucket_view=True, init_sync=True)
    assert ddp.static_graph and ddp.gradient_as_bucket_view
    with pytest.raises(ValueError, match="device_ids=None for a CPU module"):
        make(_model(), device_ids=[0])
    with pytest.raises(ValueError, match="drop dim"):
        make(_model(), dim=1)
    with pytest.raises(ValueError, match="grad_dtype="):
        make(_model(), mixed_precision=object())
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        make(_model(), skip_all_reduce_unused_params=True)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        make(_model(), bucket_cap=1)
    with pytest.raises(TypeError, match="device_ids by keyword"):
        distopt.DistributedDataParallel(_model(), [0])


# ---------------------------------------------------------------- two ranks


def ignore_list_like_torch() -> dict:
    """The same ignore list under torch's DDP and distopt's, AdamW on both: the same params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_all, y_all = zip(*(_batch(s) for s in range(STEPS)), strict=True)
    runs = {}
    for kind in ("torch", "distopt"):
        model = _model()
        with torch.no_grad():  # each rank's own ignored layer, which no one averages
            model[2].weight.add_(rank)
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, IGNORED)
        ignored = [p for n, p in model.named_parameters() if n in IGNORED]
        if kind == "torch":
            ddp = nn.parallel.DistributedDataParallel(model)
            opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        else:
            ddp = distopt.DistributedDataParallel(model)
            # A second optimizer for the ignored params, as a torch script may hold them
            # (one optimizer for all: tests/test_torch_ignore_list.py).
            opts = [distopt.DistributedOptimizer(ddp, torch.optim.AdamW, params=ddp.params,
                                                 lr=1e-2),
                    torch.optim.AdamW(ignored, lr=1e-2)]
        for step in range(STEPS):
            x, y = x_all[step][rank::world], y_all[step][rank::world]
            for opt in opts:
                opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            for opt in opts:
                opt.step()
        if kind == "distopt":
            ddp.finish_param_sync()
        runs[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
    diff = max((runs["torch"][n] - runs["distopt"][n]).abs().max().item() for n in runs["torch"])
    gathered = [None] * world
    dist.all_gather_object(gathered, runs["distopt"]["2.weight"])
    return {"diff": diff, "local": not torch.equal(*gathered[:2])}


def init_sync_off_keeps_each_ranks_weights() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # other weights on each rank
    model = mlp([6, 8, 3])
    own = copy.deepcopy(model.state_dict())
    distopt.DistributedDataParallel(model, init_sync=False)
    kept = all(torch.equal(own[k], v) for k, v in model.state_dict().items())
    torch.manual_seed(rank)
    synced = mlp([6, 8, 3])
    distopt.DistributedDataParallel(synced)
    first = [None, None]
    dist.all_gather_object(first, synced[0].weight.detach())
    return {"kept": kept, "synced": torch.equal(*first)}


def dcgan_loop(mode: str) -> float:
    """pytorch/examples' DCGAN loop on small MLPs: D's two backwards, its step, then G's
    backward through D (D's grads again, after its step, dropped by the next zero_grad), the
    same under torch's DDP and distopt's (``mode``: the sharding); the largest difference of
    the two nets' params after 3 iterations."""
    rank = dist.get_rank()
    sharding = {"optim": {}, "grads": {"shard_grads": True},
                "params": {"shard_params": True}}[mode]
    ends = []
    for kind in ("torch", "distopt"):
        torch.manual_seed(0)
        net_g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
        net_d = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        if kind == "torch":
            ddp_g, ddp_d = (nn.parallel.DistributedDataParallel(n) for n in (net_g, net_d))
            opt_g = torch.optim.Adam(ddp_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
            opt_d = torch.optim.Adam(ddp_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
        else:
            ddp_g, ddp_d = (distopt.DistributedDataParallel(n, **sharding)
                            for n in (net_g, net_d))
            opt_g = distopt.DistributedOptimizer(ddp_g, torch.optim.Adam, lr=2e-3,
                                                 betas=(0.5, 0.999))
            opt_d = distopt.DistributedOptimizer(ddp_d, torch.optim.Adam, lr=2e-3,
                                                 betas=(0.5, 0.999))
        criterion = nn.BCEWithLogitsLoss()
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(3):
            real = torch.randn(8, 6, generator=g)
            noise = torch.randn(8, 4, generator=g)
            ddp_d.zero_grad()
            criterion(ddp_d(real), torch.ones(8, 1)).backward()
            fake = ddp_g(noise)
            criterion(ddp_d(fake.detach()), torch.zeros(8, 1)).backward()
            opt_d.step()
            ddp_g.zero_grad()
            criterion(ddp_d(fake), torch.ones(8, 1)).backward()
            opt_g.step()
        if kind == "distopt":
            for ddp in (ddp_g, ddp_d):
                ddp.finish_param_sync()
            params = [*ddp_g.full_state_dict().values(), *ddp_d.full_state_dict().values()]
        else:
            params = [p.detach() for n in (net_g, net_d) for p in n.parameters()]
        ends.append([p.clone() for p in params])
    return max((a - b).abs().max().item() for a, b in zip(*ends, strict=True))


def saved_the_torch_way() -> dict:
    """torch's way: ``torch.save(opt.state_dict())`` on rank 0 (after consolidate_state_dict;
    without it rank 0's part is refused where another rank loads it),
    the default ``torch.load`` on every rank, then training on, at the same d and on one
    process: where the uninterrupted run ends ([Note: torch's way of saving the optimizer]).
    12 rows a batch, so that every d of 1 to 4 slices it evenly."""
    rank, d = dist.get_rank(), dist.get_world_size()
    path = Path(shared_tmpdir("distopt-torch-save-")) / "ckpt.pt"

    def build(seed: int, one_process: bool = False):
        torch.manual_seed(seed)
        model = mlp([6, 8, 8, 3])
        ddp = (distopt.DistributedDataParallel.for_this_process(model) if one_process
               else distopt.DistributedDataParallel(model))
        return model, ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)

    def train(ddp, opt, steps: range, world: int) -> None:
        for step in steps:
            x, y = _batch(step, rows=12)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[rank % world::world]),
                                   y[rank % world::world]).backward()
            opt.step()
        ddp.finish_param_sync()

    model, ddp, opt = build(0)
    train(ddp, opt, range(4), d)
    want = [p.detach().clone() for p in model.parameters()]
    model, ddp, opt = build(0)
    train(ddp, opt, range(2), d)
    # Without consolidating, rank 0's opt.state_dict() is its own part: loaded on every rank,
    # refused on every rank, naming the ways that work.
    refused = ""
    part = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(part, src=0)
    try:
        opt.load_state_dict(part[0])
    except distopt.CheckpointError as error:
        refused = str(error)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    ckpt = torch.load(path)  # the default: weights only
    diffs = {}
    for where in ("same-d", "one-process"):
        resumed, ddp, opt = build(1, one_process=where == "one-process")
        resumed.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        train(ddp, opt, range(2, 4), d if where == "same-d" else 1)
        diffs[where] = max((p.detach() - w).abs().max().item()
                           for p, w in zip(resumed.parameters(), want, strict=True))
    return {"refused": refused, **diffs}


class _WithUnusedHead(nn.Module):
    """A head no forward uses: torch DDP refuses it without find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


UNUSED_MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}


def unused_param_like_torch(mode: str) -> dict:
    """A param no rank uses: without find_unused_parameters torch DDP raises at the next
    forward and distopt at the step, before any param moves; with it, both leave the param
    out of AdamW's step (weight decay too) and train the rest alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for find_unused in (False, True):
        runs = {}
        for kind in ("torch", "distopt"):
            model = _WithUnusedHead()
            before = [p.detach().clone() for p in model.parameters()]
            if kind == "torch":
                ddp = nn.parallel.DistributedDataParallel(
                    model, find_unused_parameters=find_unused)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            else:
                ddp = distopt.DistributedDataParallel(
                    model, find_unused_parameters=find_unused, **UNUSED_MODES[mode])
                opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2,
                                                   weight_decay=0.1)
            try:
                for step in range(STEPS):
                    x, y = _batch(step)
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world]).backward()
                    opt.step()
            except RuntimeError as error:
                runs[kind] = str(error)
                if kind == "distopt":
                    with ddp.gathered_params():
                        out["unmoved"] = all(torch.equal(b, p.detach()) for b, p in
                                             zip(before, model.parameters(), strict=True))
                continue
            if kind == "distopt":
                ddp.finish_param_sync()
            with ddp.gathered_params() if kind == "distopt" else contextlib.nullcontext():
                runs[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if find_unused:
            out["diff"] = max((runs["torch"][n] - runs["distopt"][n]).abs().max().item()
                              for n in runs["torch"])
            out["head_kept"] = torch.equal(runs["distopt"]["head.weight"],
                                           _WithUnusedHead().head.weight)
        else:
            out["torch_error"], out["error"] = runs["torch"], runs["distopt"]
    return out


def state_dict_under_sharded_params() -> dict:
    """The ways torch users read a model's weights, between steps, with sharded params: each
    refused (the module's, a submodule's and the DDP's state_dict(), a deep copy) or whole
    (inside gathered_params(), full_state_dict()), never a placeholder."""
    rank = dist.get_rank()
    model = _model()
    ddp = distopt.DistributedDataParallel(model, shard_params=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x[rank::2]), y[rank::2]).backward()
    opt.step()
    refusals = []
    for reader in (model.state_dict, model[2].state_dict, ddp.state_dict,
                   functools.partial(copy.deepcopy, model)):
        try:
            reader()
            refusals.append("no error")
        except RuntimeError as error:
            refusals.append(str(error))
    with ddp.gathered_params():
        inside = model.state_dict()
        finite = all(v.isfinite().all().item() for v in inside.values())
        inside = {k: v.clone() for k, v in inside.items()}
        plain = copy.deepcopy(model)  # whole, and without distopt's hooks
    full = ddp.full_state_dict()
    same = all(torch.equal(inside[k], full[k]) for k in full)
    copied = all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())
    return {"refusals": refusals, "finite": finite, "same": same and copied}


class _Branchy(nn.Module):
    """A forward that, on request, reads the second layer's weight outside that layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        out = self.second(h)
        if reuse:  # not in the first forward: distopt cannot know of this read
            out = out + nn.functional.linear(h, self.second.weight)
        return out


def reads_between_uses() -> dict:
    """With sharded params, the reads torch users make of a param between uses: value reads
    raise, naming the param (an EMA over params captured before wrapping, torch.save, a
    clone, .data, arithmetic, a later forward's read outside the param's module), metadata
    reads pass, and inside gathered_params() the values are whole."""
    torch.manual_seed(0)
    model = _Branchy()
    captured = list(model.parameters())  # before wrapping, as an EMA would
    ema = [p.detach().clone() for p in captured]
    ddp = distopt.DistributedDataParallel(model, shard_params=True)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    weight = captured[0]
    reads = {
        "ema": lambda: ema[0].lerp_(weight, 0.1),
        "torch.save": lambda: torch.save(weight, io.BytesIO()),
        "clone": weight.clone,
        "data": lambda: weight.data,
        "arithmetic": lambda: weight * 2,
        "later forward": lambda: ddp(x, reuse=True),
    }
    refusals = {}
    for what, read in reads.items():
        try:
            read()
            refusals[what] = "no error"
        except RuntimeError as error:
            refusals[what] = str(error)
    metadata = (tuple(weight.shape), weight.dtype, weight.device, weight.requires_grad,
                weight.numel(), next(model.parameters()).device)
    model.to("cpu")  # changes nothing, so it passes
    with ddp.gathered_params():
        whole = [p.detach().clone() for p in model.parameters()]
    full = list(ddp.full_state_dict().values())
    return {"refusals": refusals, "repr": repr(weight),
            "metadata": metadata == ((8, 6), torch.float32, torch.device("cpu"), True, 48,
                                     torch.device("cpu")),
            "whole": all(torch.equal(a, b) and a.isfinite().all() for a, b in
                         zip(whole, full, strict=True))}


def ema_under_sharded_params() -> float:
    """torch's own EMA, ``AveragedModel`` with ``get_ema_multi_avg_fn``, built and updated
    inside ``gathered_params()`` under sharded params, against the same EMA over torch DDP:
    the largest difference of the averaged weights after 4 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ends = []
    for kind in ("torch", "distopt"):
        model = _model()
        if kind == "torch":
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gathered = contextlib.nullcontext
        else:
            ddp = distopt.DistributedDataParallel(model, shard_params=True)
            opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
            gathered = ddp.gathered_params
        with gathered():
            ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=ema_fn)
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world]).backward()
            opt.step()
            with gathered():
                ema.update_parameters(model)
        ends.append([p.detach().clone() for p in ema.module.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*ends, strict=True))


def _both_sizes() -> list:
    """The cases that run at d = 2 and d = 3."""
    return [*[(f"dcgan-{m}", dcgan_loop, (m,)) for m in DCGAN_MODES],
            *[(f"unused-{m}", unused_param_like_torch, (m,)) for m in UNUSED_MODES],
            ("ema", ema_under_sharded_params, ()),
            ("ignore", ignore_list_like_torch, ()),
            ("torch-save", saved_the_torch_way, ())]


@pytest.fixture(scope="module")
def three():
    return run_cases(3, _both_sizes())


@pytest.fixture(scope="module")
def two():
    return run_cases(2, [("init-sync", init_sync_off_keeps_each_ranks_weights, ()),
                         ("state-dict", state_dict_under_sharded_params, ()),
                         ("reads", reads_between_uses, ()),
                         *_both_sizes()])


@pytest.fixture(scope="module", params=[2, 3], ids=["d2", "d3"])
def both(request, two, three):
    return {2: two, 3: three}[request.param]


DCGAN_MODES = ["optim", "grads", "params"]


@pytest.mark.parametrize("mode", DCGAN_MODES)
def test_dcgan_loop_ends_where_torch_ddp_ends(both, mode):
    for diff in case_result(both, f"dcgan-{mode}"):
        assert diff <= 1e-6, diff


@pytest.mark.parametrize("mode", list(UNUSED_MODES))
def test_unused_param_refused_as_torch_refuses_it_or_left_out_as_torch_leaves_it(both, mode):
    for v in case_result(both, f"unused-{mode}"):
        assert "not used in producing loss" in v["torch_error"]  # torch's own refusal
        assert "'head.weight'" in v["error"] and "find_unused_parameters=True" in v["error"]
        assert v["unmoved"]  # refused before the step moved anything
        assert v["diff"] <= 1e-6, v
        assert v["head_kept"]


def test_state_dict_between_steps_is_refused_or_whole_under_sharded_params(two):
    for v in case_result(two, "state-dict"):
        names = ["'0.weight'", "'2.weight'", "'0.weight'", "'0.weight'"]  # the model's names
        for refusal, name in zip(v["refusals"], names, strict=True):
            assert name in refusal and "ddp.full_state_dict()" in refusal, refusal
        assert v["finite"] and v["same"], v


def test_torch_ema_inside_gathered_params_averages_as_over_torch_ddp(both):
    for diff in case_result(both, "ema"):
        assert diff <= 1e-6, diff


def test_value_reads_between_uses_raise_naming_the_param_under_sharded_params(two):
    for v in case_result(two, "reads"):
        for what, refusal in v["refusals"].items():
            name = "second.weight" if what == "later forward" else "first.weight"
            assert f"parameter '{name}'" in refusal, (what, refusal)
            assert "gathered_params()" in refusal, (what, refusal)
        assert "first.weight" in v["repr"] and "between uses" in v["repr"], v["repr"]
        assert v["metadata"] and v["whole"], v


def test_ignore_list_trains_as_torch_ddp(both):
    for v in case_result(both, "ignore"):
        assert v["diff"] <= 1e-6, v
        assert v["local"]  # the ignored layer differs across ranks, as under torch


def test_init_sync_false_keeps_each_ranks_weights(two):
    for v in case_result(two, "init-sync"):
        assert v == {"kept": True, "synced": True}


class _WithEmptyParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.empty = nn.Parameter(torch.zeros(0))  # torch DDP and torch.optim take it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.empty.sum()


def test_a_zero_size_param_is_taken_as_torch_takes_it():
    torch.manual_seed(0)
    model = _WithEmptyParam()
    ref = copy.deepcopy(model)
    opt = distopt.BasicOptimizer(model, torch.optim.SGD, params=list(model.parameters()),
                                 lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _batch(0)
    for m, o in ((opt.models[0], opt), (ref, ref_opt)):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y[:, :3]).backward()
        o.step()
    assert torch.equal(model.lin.weight.detach(), ref.lin.weight.detach())


def test_requires_grad_changed_after_wrapping_trains_as_torch_or_is_refused():
    """A trainable param frozen after wrapping gets nothing from the backwards it is frozen
    for: frozen for a whole step it is refused at the step as a param without a grad (torch
    DDP refuses it at the next forward), or left out of the step with
    find_unused_parameters=True; unfrozen, it trains again. A param frozen when wrapped and
    made trainable afterwards is refused at the next forward ([Note: params frozen after
    wrapping] in ddp/torch_compat/trainable.py)."""
    x, y = _batch(0)
    for find_unused in (False, True):
        model = _model()
        ddp = distopt.DistributedDataParallel.for_this_process(
            model, find_unused_parameters=find_unused)
        opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
        model[0].weight.requires_grad_(False)
        frozen = model[0].weight.detach().clone()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if find_unused:
            opt.step()
            assert torch.equal(model[0].weight, frozen)  # left out, as torch.optim leaves it
        else:
            with pytest.raises(RuntimeError, match=r"got no gradient in this step on this rank "
                                                   r"\('0.weight'\).*frozen for the whole step"):
                opt.step()
        model[0].weight.requires_grad_(True)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        assert not torch.equal(model[0].weight, frozen)  # trainable again: stepped
    model = _model()
    model[2].bias.requires_grad_(False)
    frozen = distopt.DistributedDataParallel.for_this_process(model)
    model[2].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'2.bias' became trainable after the module was"):
        frozen(x)


def test_a_param_converted_after_wrapping_is_refused():
    """``model.to(torch.float64)`` after wrapping rebinds every param to float64 storage,
    which distopt's fp32 buffers cannot take up ([Note: params rebound] in
    ddp/buffers/rebound_params.py): refused at the next forward, naming the way; one param rebound
    alone, at the step, before any param moves."""
    refusal = (r"parameter '{}' was given other storage after the module was wrapped.*"
               r"torch.float64.*convert or move the model before")
    model = _model()
    ddp = distopt.DistributedDataParallel.for_this_process(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    x, y = _batch(0)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=refusal.format(r"[0-9.a-z]+")):
        ddp(x.double())
    model = _model()  # a new model and wrapper (the old one's params are float64 now)
    ddp = distopt.DistributedDataParallel.for_this_process(model)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    nn.functional.mse_loss(ddp(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.data = model[0].weight.data.double()
    with pytest.raises(RuntimeError, match=refusal.format(r"0\.weight")):
        opt.step()
    for param, was in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.float(), was)  # nothing moved


def test_torch_save_of_the_optimizer_on_rank_0_resumes_everywhere(both):
    for v in case_result(both, "torch-save"):
        assert "consolidate_state_dict(to=0)" in v["refused"]
        assert v["same-d"] <= 1e-6, v
        assert v["one-process"] <= 1e-5, v  # the same sums, in another order


def test_comm_hooks_and_join_accepted_or_refused_by_name():
    from torch.distributed.algorithms import Join
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    ddp = distopt.DistributedDataParallel.for_this_process(_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # what distopt does already
    with pytest.raises(ValueError, match="grad_dtype=torch.bfloat16"):
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    with pytest.raises(ValueError, match="grad_dtype=torch.float16"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match="powerSGD_hook"):
        ddp.register_comm_hook(None, powerSGD_hook.powerSGD_hook)
    with pytest.raises(RuntimeError, match="drop_last=True"), ddp.join():
        pass
    with pytest.raises(RuntimeError, match="drop_last=True"), Join([ddp]):
        pass
