"""Gather units of sharded params: which params are gathered together, and what a rank holds.

Pure: the units a model's tree gives (its repeated blocks by default, a class or a predicate),
buckets that never straddle two units, and the boxes a param's flat range is written as.
On 2 and 3 ranks (one pool per world size): a small LM whose blocks are units and whose head
is tied to its embedding (a read outside any unit) trains within fp32 roundoff of one process's
torch AdamW, holds at most ``distopt.transient_bound``'s gathered bytes, nothing between steps;
built on the meta device it starts from the values and leaves the RNG state of the same model
built whole on one process; its checkpoint is written from the shards (nothing gathered) and
loads into full buffers at the values it had. See [Note: gather units] in
src/distopt/ddp/params/gather_units.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distopt
from distopt.checkpoint.dcp import flat_range_boxes
from distopt.ddp.params.gather_units import plan_gather_units
from distopt.layout.elementwise import build_layout
from distopt.memory import transient_bound_of_model

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, shared_tmpdir
from models import _Block, rank_slice

VOCAB, SEQ, DIM = 50, 8, 16
STEPS = 5
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
# AdamW at lr 1e-2 turns fp32 roundoff of the sums over ranks into steps: helpers.FP32_TOL.
TOL = FP32_TOL


class TiedLM(nn.Module):
    """Blocks in a ModuleList and a head tied to the embedding, read by the root itself."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block(DIM, 2) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.tok.weight)  # the tied head, outside every unit

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _tokens(step: int, batch: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)


# ---------------------------------------------------------------- pure


def test_default_units_are_the_repeated_blocks_of_a_million_elements():
    with torch.device("meta"):
        big = nn.Sequential(nn.Embedding(1000, 512),
                            nn.ModuleList(nn.Linear(1024, 1024) for _ in range(3)))
    params = list(big.parameters())
    units = plan_gather_units(big, params, None)
    assert [u.name for u in units] == ["1.0", "1.1", "1.2"]  # the embedding (512k) is loose
    assert all(len(u.params) == 2 for u in units)
    assert plan_gather_units(TiedLM(), list(TiedLM().parameters()), None) == []  # too small


def test_units_by_class_and_by_predicate_nest_and_order_by_registration():
    model = TiedLM()
    params = list(model.parameters())
    by_class = plan_gather_units(model, params, _Block)
    assert [u.name for u in by_class] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [p for u in by_class for p in u.params] == list(model.blocks.parameters())
    nested = plan_gather_units(model, params, lambda m: isinstance(m, (_Block, nn.Linear))
                               and m is not model.blocks[1].fc2)
    names = [u.name for u in nested]
    assert names.index("blocks.0") < names.index("blocks.0.qkv") < names.index("blocks.1")
    block1 = nested[names.index("blocks.1")]
    assert set(block1.params) == {*model.blocks[1].ln1.parameters(),
                                  *model.blocks[1].ln2.parameters(),
                                  *model.blocks[1].fc2.parameters()}
    with pytest.raises(TypeError, match="gather_units must be"):
        plan_gather_units(model, params, "blocks")


def test_a_bucket_never_holds_two_units():
    numels = [10, 10, 10, 10, 10, 10]
    units = [0, 0, 1, 1, 1, -1]
    layout = build_layout(numels, bucket_size=25, dp_size=2, units=units)
    groups = [b.param_indices for b in layout.buckets]
    assert groups == [(0, 1), (2, 3), (4,), (5,)]
    assert [b.param_indices for b in build_layout(numels, bucket_size=25, dp_size=2).buckets] \
        == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_a_flat_range_is_written_as_boxes_that_cover_it_once(shape):
    n = math.prod(shape)
    flat = torch.arange(n).view(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            covered = torch.zeros(shape, dtype=torch.int)
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) + 1
            for offset, size, start in boxes:
                box = tuple(slice(o, o + z) for o, z in zip(offset, size, strict=True))
                covered[box] += 1
                assert torch.equal(flat[box].reshape(-1),
                                   torch.arange(start, start + math.prod(size)))
            assert torch.equal(covered.reshape(-1),
                               ((torch.arange(n) >= lo) & (torch.arange(n) < hi)).int())


def test_gather_units_need_sharded_params():
    with pytest.raises(ValueError, match="shard_params=True"):
        distopt.DistributedDataParallel.for_this_process(TiedLM(), gather_units=_Block)


# ---------------------------------------------------------------- on 2 and 3 ranks


def trains_like_torch() -> dict:
    """Units by block, the tied head read outside them: against one process's AdamW."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TiedLM(layers=5)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ddp = distopt.DistributedDataParallel(model, shard_params=True, gather_units=_Block,
                                          bucket_size=1500)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW)
    bound = distopt.transient_bound(ddp)
    # What `distopt memory` states from the model's tree alone: the same bound.
    from_tree = transient_bound_of_model(model, world, gloo=True, gather_units=_Block,
                                         bucket_size=1500)
    peaks, held = [], []
    for step in range(STEPS):
        tokens = _tokens(step)
        for pool in ddp.param_pools.values():
            pool.reset_peak()
        opt.zero_grad()
        _loss(ddp, rank_slice(tokens, rank, world)).backward()
        opt.step()
        peaks.append(sum(p.peak_bytes for p in ddp.param_pools.values()))
        held.append(sum(p.live_bytes for p in ddp.param_pools.values()))
        ref_opt.zero_grad()
        ref.loss(tokens).backward()
        ref_opt.step()
    full = ddp.full_state_dict()
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    units = [{ddp._grad_sync.bucket_of[p] for p in u.params} for u in ddp.gather_units]
    return {"diff": diff, "units": len(ddp.gather_units), "same_bound": from_tree == bound,
            "disjoint": all(not (a & b) for i, a in enumerate(units) for b in units[i + 1:]),
            "peaks": peaks, "held": held, "bound": bound.gathered_params,
            "all_buckets": sum(b.numel * 4 for b in ddp.buckets)}


def _loss(ddp, tokens: torch.Tensor) -> torch.Tensor:
    logits = ddp(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def meta_built_as_one_process() -> dict:
    """Built on the meta device with units: the values and the RNG state of a whole build."""
    out = {}
    for meta in (True, False):
        torch.manual_seed(3)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = TiedLM()
        ddp = distopt.DistributedDataParallel(model, shard_params=True, gather_units=_Block,
                                              bucket_size=1500)
        rng = torch.get_rng_state()
        out[meta] = ([v.clone() for v in ddp.full_state_dict().values()], rng)
    values = all(torch.equal(a, b) for a, b in zip(out[True][0], out[False][0], strict=True))
    return {"values": values, "rng": torch.equal(out[True][1], out[False][1])}


def checkpoint_from_shards() -> dict:
    """Saved with sharded params (nothing gathered for the write), loaded into full buffers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(shared_tmpdir("distopt-units-"))
    torch.manual_seed(0)
    ddp = distopt.DistributedDataParallel(TiedLM(), shard_params=True, gather_units=_Block,
                                          bucket_size=1500)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW)
    for step in range(2):
        opt.zero_grad()
        _loss(ddp, rank_slice(_tokens(step), rank, world)).backward()
        opt.step()
    for pool in ddp.param_pools.values():
        pool.reset_peak()
    distopt.save_checkpoint(root / "ckpt", ddp, opt)
    gathered_for_save = sum(p.peak_bytes for p in ddp.param_pools.values())
    expected = ddp.full_state_dict()
    torch.manual_seed(1)  # other initial values, overwritten by the load
    whole = distopt.DistributedDataParallel(TiedLM())
    whole_opt = distopt.DistributedOptimizer(whole, torch.optim.AdamW, **ADAMW)
    distopt.load_checkpoint(root / "ckpt", whole, whole_opt)
    loaded = whole.full_state_dict()
    return {"gathered_for_save": gathered_for_save,
            "same": all(torch.equal(expected[k], loaded[k]) for k in expected)}


def module_load_state_dict() -> dict:
    """``ddp.module.load_state_dict(sd)`` after wrapping with sharded params, every rank
    loading the whole state dict (torch's pattern): the values land in the shards, the tied
    head and the buffers too, strict, and the next step trains from them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    source = TiedLM()
    sd = copy.deepcopy(source.state_dict())
    torch.manual_seed(1)  # other values, replaced by the load
    model = TiedLM()
    ddp = distopt.DistributedDataParallel(model, shard_params=True, gather_units=_Block,
                                          bucket_size=1500)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW)
    result = ddp.module.load_state_dict(sd)
    loaded = ddp.full_state_dict()
    same = all(torch.equal(loaded[k], v) for k, v in sd.items())
    opt.zero_grad()
    _loss(ddp, rank_slice(_tokens(0), rank, world)).backward()
    opt.step()
    ref_opt = torch.optim.AdamW(source.parameters(), **ADAMW)
    source.loss(_tokens(0)).backward()
    ref_opt.step()
    after = ddp.full_state_dict()
    diff = max((after[k] - v).abs().max().item() for k, v in source.state_dict().items())
    return {"same": same, "missing": list(result.missing_keys),
            "unexpected": list(result.unexpected_keys), "diff": diff}


def _cases() -> list:
    return [("train", trains_like_torch, ()), ("meta", meta_built_as_one_process, ()),
            ("checkpoint", checkpoint_from_shards, ()), ("load", module_load_state_dict, ())]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda d: f"d{d}")
def world(request):
    return request.param, run_cases(request.param, _cases())


def test_units_train_like_torch_and_hold_at_most_the_bound(world):
    for v in case_result(world[1], "train"):
        assert v["diff"] <= TOL, v["diff"]
        assert v["units"] == 5 and v["disjoint"] and v["same_bound"]
        assert set(v["held"]) == {0}  # nothing gathered between steps
        assert 0 < max(v["peaks"][1:]) <= v["bound"] < v["all_buckets"], v


def test_meta_model_with_units_starts_as_a_whole_build(world):
    for v in case_result(world[1], "meta"):
        assert v == {"values": True, "rng": True}


def test_checkpoint_written_from_shards_loads_whole(world):
    for v in case_result(world[1], "checkpoint"):
        assert v["gathered_for_save"] == 0
        assert v["same"]


def test_module_load_state_dict_writes_the_shards(world):
    for v in case_result(world[1], "load"):
        assert v["same"] and v["missing"] == [] and v["unexpected"] == [], v
        assert v["diff"] <= TOL, v
