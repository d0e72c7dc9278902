"""One model on every rank, checked when the DDP is built (see [Note: one model on every rank]).

The pure part (describing a model, finding the first difference, planning the layout) is tested
on one process. The collective part runs at d = 2 and 3, every case in one spawned group per
world size: the last rank builds the model differently (a wider layer, a transposed weight of
the same numel, a frozen param, a tie, another bucket_size, another dtype or option, no
broadcast of module buffers, in the replicate group of a hierarchical mesh, across a
tensor-parallel group), and every rank must raise a ValueError naming the first differing
param, both sides and the ranks, within seconds. The same for the optimizer built over the
same model (another lr, param groups, class or clip; see [Note: one optimizer on every rank]).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import distopt
from distopt.cross_rank.model import describe_model, first_difference
from distopt.cross_rank.optimizer import first_difference as first_optimizer_difference
from distopt.options import GradSyncOptions

from dist_harness import case_result, run_cases
from helpers import world_params

SECONDS = 10.0  # an error, not a hang: the harness' group timeout is 120 s


class Net(nn.Module):
    """An embedding, a square-ish weight that can be transposed, a head that can be tied."""

    def __init__(self, width: int = 16, transposed: bool = False, tied: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.proj = nn.Parameter(torch.randn((width, 6) if transposed else (6, width)))
        self.out = nn.Linear(width, 6).to(dtype)
        self.head = nn.Linear(6, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) @ self.proj
        h = self.out(torch.tanh(h).to(self.out.weight.dtype)).float() * self.scale
        return self.head(h)


def _describe(model: nn.Module, bucket_size: int = 100, dp_size: int = 2,
              **options) -> distopt.cross_rank.model.ModelDescription:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return describe_model(model, trainable, GradSyncOptions(**options), bucket_size=bucket_size,
                          dp_size=dp_size)


def _message(a: nn.Module, b: nn.Module, **kwargs) -> str | None:
    return first_difference([_describe(a, **kwargs), _describe(b, **kwargs)], [0, 1],
                            "data-parallel")


# ---------------------------------------------------------------------- pure part


def test_the_same_model_describes_the_same():
    torch.manual_seed(0)
    a = _describe(Net())
    torch.manual_seed(1)  # other values, same model
    b = _describe(Net())
    assert a == b and a.digest() == b.digest()
    assert first_difference([a, b, a], [0, 1, 2], "data-parallel") is None


def test_each_difference_is_named():
    width = _message(Net(16), Net(24))
    assert "parameter 'proj' has shape (6, 16) on rank 0 but (6, 24) on rank 1" in width
    assert "the data-parallel group (ranks [0, 1])" in width
    transposed = _message(Net(), Net(transposed=True))
    assert "parameter 'proj' has shape (6, 16) on rank 0 but (16, 6) on rank 1" in transposed
    frozen = Net()
    frozen.out.bias.requires_grad_(False)
    assert ("parameter 'out.bias' has requires_grad=True on rank 0 but requires_grad=False on "
            "rank 1") in _message(Net(), frozen)
    tie = _message(Net(), Net(tied=True))
    assert ("parameter 'head.weight' is a tensor of its own (untied) on rank 0 but tied to "
            "'emb.weight' on rank 1") in tie
    dtype = _message(Net(), Net(dtype=torch.bfloat16))
    assert "parameter 'out.weight' has dtype torch.float32 on rank 0 but torch.bfloat16" in dtype
    option = first_difference([_describe(Net()), _describe(Net(), find_unused_parameters=True)],
                              [0, 1], "data-parallel")
    assert "find_unused_parameters=False on rank 0 but find_unused_parameters=True" in option
    buckets = first_difference([_describe(Net(), bucket_size=100),
                                _describe(Net(), bucket_size=200)], [0, 1], "data-parallel")
    assert "the planned bucket layout differs (bucket_size 100 on rank 0, 200 on rank 1)" in buckets
    assert ("bucket 0 of the torch.float32 buffer holds ['head.weight', 'out.bias'] in elements "
            "[0, 128) on rank 0 but ['head.weight', 'out.bias', 'out.weight'] in [0, 256) on "
            "rank 1") in buckets


def test_a_buffer_a_missing_param_and_another_order_are_named():
    short = Net()
    short.register_buffer("scale", torch.ones(7))
    assert "buffer 'scale' has shape (6,) on rank 0 but (7,) on rank 1" in _message(Net(), short)
    extra = Net()
    extra.extra = nn.Linear(2, 2)
    assert "parameter 'extra.weight' (shape (2, 2)) is on rank 1 but not on rank 0" in _message(
        Net(), extra)

    class Swapped(Net):
        def __init__(self) -> None:
            super().__init__()
            out, head = self.out, self.head
            del self.out, self.head
            self.head, self.out = head, out

    swapped = _message(Net(), Swapped())
    assert "registered in another order: 'out.weight' comes where rank 1 has 'head.weight'" in (
        swapped)


def test_all_differing_ranks_are_listed_and_the_equal_bucket_size_passes():
    a, b = _describe(Net()), _describe(Net(24))
    message = first_difference([a, a, b, b], [4, 5, 6, 7], "tensor-parallel")
    assert "on rank 4 but (6, 24) on rank 6" in message
    assert "(ranks that differ from rank 4: [6, 7])" in message
    assert "the tensor-parallel group (ranks [4, 5, 6, 7])" in message
    # Bucket sizes beyond the model lay out the same buckets: nothing to raise.
    assert _describe(Net(), bucket_size=10_000) == _describe(Net(), bucket_size=20_000)


def test_tensor_parallel_view_ignores_local_shapes_and_layout():
    a, b = _describe(Net(), bucket_size=100), _describe(Net(), bucket_size=200)
    assert a != b and a.global_view() == b.global_view()
    assert a.global_view().digest() == b.global_view().digest()


def test_the_described_buckets_are_the_ones_the_ddp_builds():
    model = Net(dtype=torch.bfloat16)
    ddp = distopt.DistributedDataParallel(model, bucket_size=50, grad_dtype=None)
    names = ddp.param_names
    described = describe_model(model, [(n, p) for p, n in names.items()], ddp.options,
                               bucket_size=50, dp_size=1)
    assert [(b.param_dtype, b.grad_dtype, b.numel) for b in described.buffers] == [
        (str(buf.param_dtype), str(buf.grad_dtype), buf.layout.numel) for buf in ddp.flat_buffers
    ]
    assert [[(k.start, k.end, k.params) for k in b.buckets] for b in described.buffers] == [
        [(k.layout.buffer_range.start, k.layout.buffer_range.end,
          tuple(names[p] for p in k.params)) for k in buf.buckets] for buf in ddp.flat_buffers
    ]
    assert len(ddp.flat_buffers) == 2 and len(ddp.buckets) > 2  # the "same" case: at d > 1


def test_an_optimizer_is_described_by_values_not_addresses():
    """Two processes hold other objects for the same options: a callable by name, an object by
    type, a tensor by its values; a real difference is still named."""
    from distopt.cross_rank.optimizer import describe_optimizer
    from distopt.options import StepOptions

    class Schedule:  # an option object without a value-based repr
        pass

    model = Net()
    names = {p: n for n, p in model.named_parameters()}

    def describe(lr: float) -> tuple:
        group = {"params": [], "lr": torch.tensor(lr), "fn": lambda x: x, "obj": Schedule(),
                 "betas": (0.9, 0.95)}
        return describe_optimizer([group], [torch.optim.AdamW], [list(model.parameters())],
                                  names, StepOptions(clip_grad=1.0))

    assert describe(0.01) == describe(0.01)
    message = first_optimizer_difference([describe(0.01), describe(0.02)], [0, 1],
                                         "data-parallel")
    assert "param group 0 has lr=('tensor', 'torch.float32', 0.009999" in message


# ---------------------------------------------------------------------- collective part


def _build(make, **kwargs) -> dict:
    """Build the DDP on this rank; the error it raised (or None) and how long it took."""
    torch.manual_seed(0)
    model = make(dist.get_rank(), dist.get_world_size())
    start = time.perf_counter()
    try:
        ddp = distopt.DistributedDataParallel(model, **kwargs)
    except ValueError as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start, "ddp": ddp}


def _last(rank: int, world: int) -> bool:
    return rank == world - 1


def mismatch(kind: str) -> dict:
    bucket_size, options = 100, {}
    if kind == "width":  # the Sequential of the report: the same code, another config
        def make(rank, world):
            w = 24 if _last(rank, world) else 16
            return nn.Sequential(nn.Linear(8, w), nn.Linear(w, 4))
    elif kind == "transposed":
        def make(rank, world):
            return Net(transposed=_last(rank, world))
    elif kind == "frozen":
        def make(rank, world):
            model = Net()
            model.out.bias.requires_grad_(not _last(rank, world))
            return model
    elif kind == "tie":
        def make(rank, world):
            return Net(tied=_last(rank, world))
    elif kind == "bucket-size":
        def make(rank, world):
            return Net()
        bucket_size = 200 if _last(dist.get_rank(), dist.get_world_size()) else 100
    elif kind == "broadcast-buffers":  # one rank would skip the broadcast the others wait in
        def make(rank, world):
            return Net()
        options["broadcast_buffers"] = not _last(dist.get_rank(), dist.get_world_size())
    result = _build(make, bucket_size=bucket_size, **options)
    result.pop("ddp", None)
    return result


def same_model() -> dict:
    """A matching model builds, costs one 32-byte all-gather, plans what it lays out, trains."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = _build(lambda r, w: Net(), bucket_size=100)
    ddp = result.pop("ddp")
    calls, bytes_ = dict(ddp.comm_stats.calls), dict(ddp.comm_stats.bytes)
    described = describe_model(ddp.module, [(n, p) for p, n in ddp.param_names.items()],
                               ddp.options, bucket_size=100, dp_size=world)
    planned = [b.numel for b in described.buffers] == [
        buf.layout.numel for buf in ddp.flat_buffers]
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    tokens, targets = torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 10, (4, 3))
    F.cross_entropy(ddp(tokens).flatten(0, 1), targets.flatten()).backward()
    return {**result, "calls": calls, "bytes": bytes_, "planned": planned,
            "updated": opt.step().updated}


def hierarchical_replicas_differ() -> dict:
    """(world, 1): every shard group is one rank; the replicas must still agree."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    result = _build(lambda r, w: Net(24 if _last(r, w) else 16), device_mesh=mesh)
    result.pop("ddp", None)
    return result


def tensor_parallel_differs() -> dict:
    """(1, world) ("dp", "tp"): no DP peer at all; a plain param frozen on one TP rank only
    still raises, on every TP rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(1, world), mesh_dim_names=("dp", "tp"))

    def make(rank, w):
        model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        model[1].bias.requires_grad_(not _last(rank, w))
        return model

    result = _build(make, device_mesh=mesh)
    result.pop("ddp", None)
    return result


KINDS = ("width", "transposed", "frozen", "tie", "bucket-size", "broadcast-buffers")


def optimizer_mismatch(kind: str) -> dict:
    """The same model everywhere; the last rank builds another optimizer."""
    last = _last(dist.get_rank(), dist.get_world_size())
    ddp = _build(lambda r, w: Net(), bucket_size=100)["ddp"]
    model = ddp.module
    kwargs: dict = {"lr": 1e-2}
    if kind == "lr":
        kwargs["lr"] = 2e-2 if last else 1e-2
    elif kind == "groups":  # a param in the other group on one rank
        decayed = [model.proj, model.out.weight] + ([] if last else [model.head.weight])
        rest = [p for p in model.parameters() if all(p is not q for q in decayed)]
        kwargs["params"] = [{"params": decayed, "weight_decay": 0.1},
                            {"params": rest, "weight_decay": 0.0}]
    elif kind == "owner":  # whole matrices to Adafactor on one rank: other buckets
        cls = torch.optim.Adafactor if last else torch.optim.AdamW
        kwargs["params"] = [{"params": [model.proj], "optimizer": cls},
                            {"params": [p for p in model.parameters() if p is not model.proj]}]
    elif kind == "clip":
        kwargs["clip_grad"] = 1.0 if last else None
    start = time.perf_counter()
    try:
        distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **kwargs)
    except ValueError as error:
        return {"error": str(error), "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


OPTIMIZER_KINDS = ("lr", "groups", "owner", "clip")


def _cases() -> list:
    cases = [(kind, mismatch, (kind,)) for kind in KINDS]
    cases += [(f"optimizer-{kind}", optimizer_mismatch, (kind,)) for kind in OPTIMIZER_KINDS]
    cases += [("same", same_model, ()), ("hierarchical", hierarchical_replicas_differ, ()),
              ("tensor-parallel", tensor_parallel_differs, ())]
    return cases


WORLDS = [2, 3]


@pytest.fixture(scope="module", params=world_params(WORLDS))
def world(request):
    return request.param, run_cases(request.param, _cases())


EXPECTED = {
    "width": "parameter '0.weight' has shape (16, 8) on rank 0 but (24, 8) on rank {last}",
    "transposed": "parameter 'proj' has shape (6, 16) on rank 0 but (16, 6) on rank {last}",
    "frozen": "parameter 'out.bias' has requires_grad=True on rank 0 but requires_grad=False "
              "on rank {last}",
    "tie": "parameter 'head.weight' is a tensor of its own (untied) on rank 0 but tied to "
           "'emb.weight' on rank {last}",
    "bucket-size": "the planned bucket layout differs (bucket_size 100 on rank 0, 200 on rank "
                   "{last})",
    "broadcast-buffers": "broadcast_buffers=True on rank 0 but broadcast_buffers=False on rank "
                         "{last}",
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_different_model_raises_on_every_rank(world, kind):
    d, results = world
    values = case_result(results, kind)
    assert len(values) == d
    for value in values:
        assert value["error"] is not None, "a rank built the DDP without a word"
        assert EXPECTED[kind].format(last=d - 1) in value["error"], value["error"]
        assert f"the data-parallel group (ranks {list(range(d))})" in value["error"]
        assert value["seconds"] < SECONDS
    assert len({v["error"] for v in values}) == 1  # the same words everywhere


OPTIMIZER_EXPECTED = {
    "lr": "param group 0 has lr=0.01 against lr=0.02",
    "groups": "param group 0 holds other params (['head.weight'] against [])",
    "owner": "param group 0 is stepped by AdamW against Adafactor",
    "clip": "the step's options differ",
}


@pytest.mark.parametrize("kind", OPTIMIZER_KINDS)
def test_a_different_optimizer_raises_on_every_rank(world, kind):
    """Another lr, a param in another group, another class (other owners of whole tensors,
    so other buckets) or another clip: one ValueError on every rank, before any step."""
    d, results = world
    values = case_result(results, f"optimizer-{kind}")
    assert len(values) == d
    for value in values:
        assert value["error"] is not None, "a rank built the optimizer without a word"
        assert OPTIMIZER_EXPECTED[kind] in value["error"], value["error"]
        assert (f"between ranks 0 and {d - 1} of the data-parallel group "
                f"(ranks {list(range(d))})") in value["error"]
        assert "same param groups, optimizer classes and options on every rank" in value["error"]
        assert value["seconds"] < SECONDS
    assert len({v["error"] for v in values}) == 1


def test_the_same_model_costs_one_small_all_gather(world):
    d, results = world
    for value in case_result(results, "same"):
        assert value["error"] is None
        assert value["calls"] == {"model_check": 1} and value["bytes"] == {"model_check": 32}
        assert value["planned"] and value["updated"]


def test_replicas_of_a_hierarchical_mesh_are_compared(world):
    d, results = world
    for value in case_result(results, "hierarchical"):
        assert (f"the data-parallel replicate group (ranks {list(range(d))}): parameter 'proj' "
                f"has shape (6, 16) on rank 0 but (6, 24) on rank {d - 1}") in value["error"]
        assert value["seconds"] < SECONDS


def test_tensor_parallel_ranks_are_compared(world):
    d, results = world
    for value in case_result(results, "tensor-parallel"):
        assert (f"the tensor-parallel group (ranks {list(range(d))}): parameter '1.bias' has "
                f"requires_grad=True on rank 0 but requires_grad=False on rank {d - 1}"
                ) in value["error"]
        assert value["seconds"] < SECONDS
