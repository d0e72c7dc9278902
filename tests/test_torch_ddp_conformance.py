"""torch DDP's behaviours, written as a torch user writes them, run under torch's own DDP and
under distopt's in each sharding mode on the same ranks, and compared.

Each case trains the same small model both ways and returns what the behaviour shows (a state
dict, the names, the params after a step); the tests assert that distopt's equals torch's. The
wrapper's ``nn.Module`` methods come first: ``state_dict()``, ``load_state_dict()``,
``named_parameters()``, ``named_buffers()``, ``parameters()``, ``modules()`` and ``train()`` /
``eval()``, keyed ``module.`` as torch DDP keys them. With sharded params a state dict is read
inside ``ddp.gathered_params()`` (between uses it is refused, tests/test_torch_ddp_args.py).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distopt

from dist_harness import case_result, run_cases

MODES = {"optim": {}, "grads": {"shard_grads": True}, "params": {"shard_params": True}}
STEPS = 2


def _model() -> nn.Module:
    """An MLP with a BatchNorm, so that the state dict holds buffers as well as params. The
    BatchNorm follows the Tanh: right after a Linear it would cancel that Linear's bias, whose
    grad would then be round-off that AdamW's normalized step turns into a full step."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows of step ``step``'s batch (4 rows a rank at any world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)
    return x[rank::world], y[rank::world]


def _wrapped(kind: str, mode: str, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
             model: nn.Module | None = None, distopt_options: dict | None = None,
             **ddp_options) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Torch's DDP or distopt's over ``model`` with ``ddp_options`` (and, for distopt's,
    ``mode``'s sharding and ``distopt_options``), and ``optimizer`` over it."""
    model = _model() if model is None else model
    if kind == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, **ddp_options)
        return ddp, optimizer(ddp.parameters(), lr=1e-2)
    ddp = distopt.DistributedDataParallel(model, **MODES[mode], **ddp_options,
                                          **(distopt_options or {}))
    return ddp, distopt.DistributedOptimizer(ddp, optimizer, lr=1e-2)


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _readable(ddp: nn.Module) -> contextlib.AbstractContextManager:
    """Where a state dict's values can be read: anywhere, or with sharded params inside
    ``gathered_params()``."""
    gathered = getattr(ddp, "gathered_params", None)
    sharded = isinstance(ddp, distopt.DistributedDataParallel) and ddp.options.shard_params
    return gathered() if sharded else contextlib.nullcontext()


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def module_methods_like_torch(mode: str) -> dict:
    """``nn.Module``'s methods on the wrapper, against torch DDP's after the same two steps:
    the state dict (keys in order, values), the names of params, buffers and submodules, and
    the training flag; then torch DDP's state dict of other weights loaded into both wrappers,
    read back, and trained one more step from; and a state dict without the ``module.`` prefix,
    refused by both."""
    runs: dict[str, dict] = {}
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode)
        _train(ddp, opt, range(STEPS))
        with _readable(ddp):
            state = {k: v.clone() for k, v in ddp.state_dict().items()}
        runs[kind] = {
            "ddp": ddp, "opt": opt, "state": state,
            "keys": list(state),
            "params": [n for n, _ in ddp.named_parameters()],
            "buffers": [n for n, _ in ddp.named_buffers()],
            "modules": [n for n, _ in ddp.named_modules()],
            "count": sum(1 for _ in ddp.parameters()),
            "training": [m.training for m in ddp.eval().modules()]
                        + [m.training for m in ddp.train().modules()],
        }
    # Other weights, as a checkpoint of another run would hold: torch DDP's state dict of a
    # model trained one step further on other data.
    other_ddp, other_opt = _wrapped("torch", mode)
    _train(other_ddp, other_opt, range(10, 13))
    loaded = {k: v.clone() for k, v in other_ddp.state_dict().items()}
    for kind, run in runs.items():
        ddp = run["ddp"]
        run["load"] = str(ddp.load_state_dict(loaded))
        with _readable(ddp):
            run["read_back"] = _largest_difference(
                loaded, {k: v.clone() for k, v in ddp.state_dict().items()})
        _train(ddp, run["opt"], range(STEPS, STEPS + 1))
        if kind == "distopt":
            ddp.finish_param_sync()
        with _readable(ddp):
            run["after"] = {k: v.clone() for k, v in ddp.state_dict().items()}
        try:
            ddp.load_state_dict({k.removeprefix("module."): v for k, v in loaded.items()})
            run["unprefixed"] = "no error"
        except RuntimeError as error:
            run["unprefixed"] = str(error).splitlines()[0]
    torch_run, ours = runs["torch"], runs["distopt"]
    names = ("keys", "params", "buffers", "modules", "count", "training", "load", "unprefixed")
    return {
        **{name: (torch_run[name], ours[name]) for name in names},
        "state": _largest_difference(torch_run["state"], ours["state"]),
        "read_back": (torch_run["read_back"], ours["read_back"]),
        "after_load": _largest_difference(torch_run["after"], ours["after"]),
        "moved": _largest_difference(loaded, ours["after"]),
    }


def accumulation_by_flag_like_torch(mode: str) -> dict:
    """nanoGPT's gradient accumulation: ``model.require_backward_grad_sync`` set by hand, True
    on the last of three micro-batches only; the params against torch DDP's after two steps,
    and how many reductions distopt's first step ran (one per bucket: the last micro-batch's)."""
    ends = {}
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode)
        for step in range(STEPS):
            for micro in range(3):
                ddp.require_backward_grad_sync = micro == 2
                x, y = _batch(10 * step + micro)
                (nn.functional.mse_loss(ddp(x), y) / 3).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if kind == "distopt" and step == 0:
                stats = ddp.comm_stats.calls
                reductions = stats["reduce_scatter"] + stats["all_reduce"]
                buckets = len(ddp.buckets)
        with _readable(ddp):
            ends[kind] = {k: v.clone() for k, v in ddp.state_dict().items()}
    return {"diff": _largest_difference(ends["torch"], ends["distopt"]),
            "reductions": reductions, "buckets": buckets}


# ---------------------------------------------------------------- p.grad, read torch's way

MAX_NORM = 0.05  # below every step's total grad norm (the tests check it), so clipping acts
CLIP_VALUE = 0.02  # below the largest grad elements (checked), so clamping acts
FOREACH = (None, True, False)  # torch's three paths of its clip functions, one per step
INF = math.inf


def _reads(ddp: nn.Module) -> dict[str, tuple[float, float] | None]:
    """What a torch user reads off each ``p.grad``: None, or its norms of type 2 and inf."""
    return {name: None if p.grad is None
            else (p.grad.norm().item(), torch.linalg.vector_norm(p.grad, INF).item())
            for name, p in ddp.named_parameters()}


def _state(ddp: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(ddp, distopt.DistributedDataParallel):
        ddp.finish_param_sync()
    with _readable(ddp):
        return {k: v.clone() for k, v in ddp.state_dict().items()}


def clipping_like_torch(mode: str, way: str, optimizer: str = "AdamW",
                        overlap: bool = True) -> dict:
    """A torch loop of three steps that clips the averaged grads torch's way between backward
    and step, ``foreach`` None, True and False in turn: ``way`` "norm"
    (``clip_grad_norm_``), "inf" (``norm_type=inf``) or "value" (``clip_grad_value_``, then
    ``get_total_norm``), under torch's DDP and distopt's (``overlap``: its
    ``overlap_grad_reduce``; off, the first read agrees the norms): what each clip returned,
    the reads of every ``p.grad`` before and after it, and the difference of the state dicts at
    the end."""
    runs: dict[str, dict] = {}
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode, getattr(torch.optim, optimizer),
                            distopt_options={"overlap_grad_reduce": overlap})
        run: dict[str, list] = {"returned": [], "before": [], "after": []}
        for step, foreach in enumerate(FOREACH):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            run["before"].append(_reads(ddp))
            if way == "value":
                nn.utils.clip_grad_value_(ddp.parameters(), CLIP_VALUE, foreach=foreach)
                total = nn.utils.get_total_norm(
                    [p.grad for p in ddp.parameters() if p.grad is not None], foreach=foreach)
            else:
                total = nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM,
                                                 norm_type=2.0 if way == "norm" else INF,
                                                 foreach=foreach)
            run["returned"].append(total.item())
            run["after"].append(_reads(ddp))
            opt.step()
        run["state"] = _state(ddp)
        runs[kind] = run
    state = _largest_difference(runs["torch"].pop("state"), runs["distopt"].pop("state"))
    return {**runs, "state": state}


def reads_on_one_rank(mode: str) -> dict:
    """Two steps whose p.grad reads run on rank 0 alone (a script logging on its master
    process), each followed by a collective of every rank: a read that started a collective
    would meet the other ranks' all-reduce, and the case would hang or fail."""
    rank = dist.get_rank()
    runs: dict[str, dict] = {}
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode)
        reads, signals = [], []
        for step in range(2):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            if rank == 0:
                reads.append(_reads(ddp))
            signal = torch.full((5,), float(rank + 1))
            dist.all_reduce(signal)
            signals.append(signal.tolist())
            nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
            opt.step()
        runs[kind] = {"reads": reads, "signals": signals, "state": _state(ddp)}
    state = _largest_difference(runs["torch"].pop("state"), runs["distopt"].pop("state"))
    return {**runs, "state": state}


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[5] = INF
    return grad


def nonfinite_like_torch(mode: str) -> dict:
    """An inf in one element of one rank's grad: ``clip_grad_norm_(...,
    error_if_nonfinite=True)`` raises; without the flag it returns torch's norm; after
    ``zero_grad()`` a clean step trains on as torch's does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs: dict[str, dict] = {}
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode)
        opt.zero_grad()
        handle = ddp.module[0].weight.register_hook(_poison) if rank == world - 1 else None
        x, y = _batch(0)
        nn.functional.mse_loss(ddp(x), y).backward()
        if handle is not None:
            handle.remove()
        try:
            nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM, error_if_nonfinite=True)
            raised = "no error"
        except RuntimeError as error:
            raised = str(error)
        returned = str(nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM).item())
        _train(ddp, opt, range(1, 2))
        runs[kind] = {"raised": raised, "returned": returned, "state": _state(ddp)}
    state = _largest_difference(runs["torch"].pop("state"), runs["distopt"].pop("state"))
    return {**runs, "state": state}


class _Branches(nn.Module):
    """A trunk every rank uses, a branch only the last rank uses (where every rank must run
    the same modules, sharded params, a branch whose output is multiplied by 0 elsewhere, so
    that every rank computes a grad) and a branch no rank uses."""

    def __init__(self, some_ranks: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.some_ranks = some_ranks
        self.trunk, self.some, self.none = nn.Linear(6, 3), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = dist.get_rank() == dist.get_world_size() - 1
        if self.some_ranks:
            return self.trunk(x) + self.some(x) if last else self.trunk(x)
        return self.trunk(x) + self.some(x) * float(last)


def unused_like_torch(mode: str) -> dict:
    """``p.grad is None`` with ``find_unused_parameters=True``: None for the branch no rank
    used, the reduced grad for the one some rank used (on every rank, as torch's DDP gives
    it); then two clipped steps."""
    runs: dict[str, dict] = {}
    for kind in ("torch", "distopt"):
        model = _Branches(some_ranks=mode != "params")
        ddp, opt = _wrapped(kind, mode, model=model, find_unused_parameters=True)
        reads = []
        for step in range(2):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward()
            reads.append(_reads(ddp))
            nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
            opt.step()
        runs[kind] = {"reads": reads, "state": _state(ddp)}
    state = _largest_difference(runs["torch"].pop("state"), runs["distopt"].pop("state"))
    return {**runs, "state": state}


def whole_reads_refused(mode: str) -> list[str]:
    """What needs the whole reduced grad is refused on every rank, naming the param; the
    loop goes on."""
    ddp, opt = _wrapped("distopt", mode)
    opt.zero_grad()
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    grad = ddp.module[0].weight.grad
    messages = []
    for use in (grad.clone, lambda: grad[0], lambda: grad.abs().max(), lambda: grad.norm(1)):
        try:
            use()
            messages.append("no error")
        except RuntimeError as error:
            messages.append(str(error))
    opt.step()
    return messages


CLIP_WAYS = ["norm", "inf", "value"]


def _cases() -> list:
    cases = [(f"module-{mode}", module_methods_like_torch, (mode,)) for mode in MODES]
    cases += [(f"clip-{way}-{mode}", clipping_like_torch, (mode, way))
              for way in CLIP_WAYS for mode in MODES]
    cases += [(f"clip-whole-{mode}", clipping_like_torch, (mode, "norm", "Adafactor"))
              for mode in MODES]
    cases += [(f"clip-no-overlap-{mode}", clipping_like_torch, (mode, "norm", "AdamW", False))
              for mode in MODES]
    cases += [(f"one-rank-{mode}", reads_on_one_rank, (mode,)) for mode in MODES]
    cases += [(f"nonfinite-{mode}", nonfinite_like_torch, (mode,)) for mode in MODES]
    cases += [(f"unused-{mode}", unused_like_torch, (mode,)) for mode in MODES]
    cases += [(f"refused-{mode}", whole_reads_refused, (mode,)) for mode in MODES]
    cases += [(f"accumulate-{mode}", accumulation_by_flag_like_torch, (mode,)) for mode in MODES]
    cases += [(f"nanogpt-{mode}", nanogpt_loop, (mode,)) for mode in NANOGPT_MODES]
    return cases


@pytest.fixture(scope="module")
def two():
    return run_cases(2, _cases())


@pytest.fixture(scope="module")
def three():
    return run_cases(3, _cases())


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)],
                ids=["d2", "d3"])
def both(request):
    return request.getfixturevalue({2: "two", 3: "three"}[request.param])


# torch's DDP and distopt's run the same forward and backward kernels in the same process on
# the same rows, so each rank's grads are the same bits on any CPU; only the average over the
# ranks may round differently (torch all-reduces each grad, distopt reduce-scatters the bucket:
# at d = 2 the sum of two terms is exact in either order, at d = 3 one rounding, 2**-24
# relative). AdamW's update lr * m / sqrt(v) then differs by that relative amount, ~1e-9 a step
# at lr 1e-2, unless a grad is round-off itself (the models here have none: see _model). 1e-6
# is 100 times the drift over a few steps and 10**4 times below one step's update, which a
# missed, doubled or unclipped step would show.
TRAJECTORY_TOL = 1e-6


@pytest.mark.parametrize("mode", list(MODES))
def test_module_methods_on_the_wrapper_are_torch_ddps(both, mode):
    for v in case_result(both, f"module-{mode}"):
        for name in ("keys", "params", "buffers", "modules", "count", "training", "load",
                     "unprefixed"):
            torch_value, ours = v[name]
            assert ours == torch_value, (name, torch_value, ours)
        assert v["keys"][0][0].startswith("module.")
        assert v["state"] <= TRAJECTORY_TOL, v["state"]
        assert v["read_back"] == (0.0, 0.0)  # what was loaded is what is read
        assert v["after_load"] <= TRAJECTORY_TOL, v["after_load"]
        assert v["moved"] > 1e-3  # the step after the load trained (a step is ~lr = 1e-2)


def test_the_wrapper_shadows_no_attribute_of_nn_module():
    """Every attribute ``nn.Module.__init__`` sets keeps its type on the wrapper, and the
    wrapper's classes define no ``nn.Module`` name but the methods torch DDP overrides too
    (``forward``) and ``zero_grad`` (which clears distopt's grad buffers as well)."""
    for options in ({}, {"shard_params": True}):
        ddp = distopt.DistributedDataParallel.for_this_process(_model(), **options)
        plain = vars(nn.Module())
        shadowed = {k: type(vars(ddp)[k]).__name__ for k in plain
                    if type(vars(ddp)[k]) is not type(plain[k])}
        assert not shadowed, shadowed
    defined = {name for cls in distopt.DistributedDataParallel.__mro__[:-2]
               if issubclass(cls, nn.Module) or cls.__module__.startswith("distopt")
               for name in vars(cls) if not name.startswith("__")}
    assert nn.Module in distopt.DistributedDataParallel.__mro__
    overridden = {n for n in defined if hasattr(nn.Module, n)}
    assert overridden == {"forward", "zero_grad"}, overridden


# The norms of p.grad, against torch DDP's, at the first step (the same weights on both): the
# same averaged grads but for their last bit (torch all-reduces, distopt reduce-scatters: a sum
# of d terms rounded in another order, the same at d = 2), whose squares distopt sums per rank's
# piece, then over the ranks in fp64, where torch sums them over the whole tensor in fp32: each
# a few roundings of 2**-24 apart, which the square root halves. After clip_grad_norm_ distopt
# scales the norm by the coefficient where torch takes the norm of the scaled grads: one
# rounding more. 16 roundings (2**-20) is above what these add up to (2 here) and far below a
# wrong clip (each coefficient MAX_NORM / norm is below 0.5).
NORM_RTOL = 2.0**-20
# At later steps the weights are apart by what the earlier steps rounded (below 1e-7, see
# TRAJECTORY_TOL), and the grads with them: by less than 1e-5 of these grads, whose norms are
# above 1e-3, at the curvatures of this small model.
LATER_RTOL = 1e-5


def _close(ours: float, theirs: float, rtol: float) -> bool:
    return (math.isnan(ours) and math.isnan(theirs)) or ours == theirs or (
        abs(ours - theirs) <= rtol * abs(theirs))


def _same_reads(ours: list[dict], theirs: list[dict]) -> None:
    """Each step's reads: ``p.grad is None`` alike, the norms within the step's tolerance."""
    assert len(ours) == len(theirs)
    for step, (mine, torch_reads) in enumerate(zip(ours, theirs, strict=True)):
        rtol = NORM_RTOL if step == 0 else LATER_RTOL
        assert mine.keys() == torch_reads.keys()
        for name, read in torch_reads.items():
            assert (mine[name] is None) == (read is None), (step, name)
            if read is not None:
                for a, b in zip(mine[name], read, strict=True):
                    assert _close(a, b, rtol), (step, name, a, b)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("way", CLIP_WAYS + ["whole", "no-overlap"])
def test_torch_clip_functions_on_p_grad_are_torch_ddps(both, way, mode):
    name = f"clip-{way}-{mode}"
    for v in case_result(both, name):
        theirs, ours = v["torch"], v["distopt"]
        if way == "value":  # the bound acts: some element above it before, none after
            assert max(r[1] for r in theirs["before"][0].values()) > CLIP_VALUE
            assert max(r[1] for step in theirs["after"] for r in step.values()) <= CLIP_VALUE
        else:  # clipping acts every step
            assert min(theirs["returned"]) > 2 * MAX_NORM, theirs["returned"]
        for step, (a, b) in enumerate(zip(ours["returned"], theirs["returned"], strict=True)):
            assert _close(a, b, NORM_RTOL if step == 0 else LATER_RTOL), (step, a, b)
        _same_reads(ours["before"], theirs["before"])
        _same_reads(ours["after"], theirs["after"])
        assert v["state"] <= TRAJECTORY_TOL, v["state"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_read_on_one_rank_communicates_nothing(both, mode):
    for rank, v in enumerate(case_result(both, f"one-rank-{mode}")):
        theirs, ours = v["torch"], v["distopt"]
        assert len(ours["reads"]) == (2 if rank == 0 else 0)
        _same_reads(ours["reads"], theirs["reads"])
        assert ours["signals"] == theirs["signals"]
        assert v["state"] <= TRAJECTORY_TOL, v["state"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_nonfinite_grad_raises_as_torch_ddps(both, mode):
    for v in case_result(both, f"nonfinite-{mode}"):
        theirs, ours = v["torch"], v["distopt"]
        assert theirs["raised"].startswith("The total norm of order 2.0 for gradients")
        assert ours["raised"] == theirs["raised"]
        assert ours["returned"] == theirs["returned"] == "inf"
        assert v["state"] <= TRAJECTORY_TOL, v["state"]


@pytest.mark.parametrize("mode", list(MODES))
def test_p_grad_is_none_as_torch_ddps(both, mode):
    for v in case_result(both, f"unused-{mode}"):
        theirs, ours = v["torch"], v["distopt"]
        _same_reads(ours["reads"], theirs["reads"])
        # The branch no rank used has no grad; the one another rank used has it here too.
        torch_reads = theirs["reads"][0]
        assert torch_reads["module.none.weight"] is None
        assert torch_reads["module.some.weight"] is not None
        assert v["state"] <= TRAJECTORY_TOL, v["state"]


@pytest.mark.parametrize("mode", list(MODES))
def test_reads_of_the_whole_grad_are_refused_by_name(both, mode):
    messages = case_result(both, f"refused-{mode}")
    assert all(m == messages[0] for m in messages)  # on every rank alike
    for message in messages[0][:3]:
        assert message.startswith("p.grad of parameter '0.weight' cannot be used by aten.")
        assert "clip_grad_norm_" in message and "clip_grad=" in message
    assert "norm of type 1" in messages[0][3] and "norm_type=2" in messages[0][3]


@pytest.mark.parametrize("mode", list(MODES))
def test_require_backward_grad_sync_accumulates_as_torch_ddps_flag(both, mode):
    for v in case_result(both, f"accumulate-{mode}"):
        assert v["diff"] <= TRAJECTORY_TOL, v
        # Sharded grads reduce every backward (a kept shard per bucket); otherwise the flag
        # holds the first two micro-batches' grads back: one reduction per bucket a step.
        if mode == "optim":
            assert v["reductions"] == v["buckets"], v


# ---------------------------------------------------------------- nanoGPT's loop


class _NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # nanoGPT's bias=False: the key's bias gets no grad but round-off (softmax ignores a
        # shift shared by every key), which AdamW's normalized step turns into lr-sized moves.
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class _NanoGPT(nn.Module):
    """nanoGPT's model in small: token and position embeddings, blocks, a head tied to the
    token embedding; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, vocab: int = 17, block: int = 8, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList(_NanoBlock(width, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """nanoGPT's configure_optimizers: weight decay on the matrices only."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# Under sharded params a forward on the master alone cannot gather: refused, tested apart.
NANOGPT_MODES = ["optim", "grads"]


def _nanogpt_run(kind: str, mode: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """nanoGPT's train.py, DDP path, in small, with its two lines changed for distopt (the DDP
    class, and the optimizer built over the wrapper): a seed per rank, gradient accumulation
    through ``require_backward_grad_sync``, GradScaler (disabled: fp32), ``clip_grad_norm_``,
    a cosine lr set in ``param_groups``, and ``estimate_loss()`` on the master process only."""
    rank = dist.get_rank()
    accumulation, iters, clip = 2, 4, 0.5
    torch.manual_seed(1337 + rank)  # nanoGPT: seed_offset = ddp_rank
    model = _NanoGPT()
    groups = model.optim_groups(0.1)
    if kind == "torch":
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    else:
        model = distopt.DistributedDataParallel(model, **MODES[mode])
        optimizer = distopt.DistributedOptimizer(model, torch.optim.AdamW, params=groups,
                                                 lr=1e-2, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, 17, (3, 9))
        return data[:, :8], data[:, 1:].contiguous()

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = [model(*get_batch())[1].item() for _ in range(2)]
        model.train()
        return sum(losses) / len(losses)

    seen = []
    x, y = get_batch()
    for it in range(iters):
        lr = 1e-2 * 0.5 * (1 + math.cos(math.pi * it / iters))
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % 2 == 0 and rank == 0:  # master_process
            seen.append(estimate_loss())
        for micro in range(accumulation):
            model.require_backward_grad_sync = micro == accumulation - 1
            _, loss = model(x, y)
            loss = loss / accumulation
            x, y = get_batch()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    with _readable(model):
        return {k: v.clone() for k, v in model.state_dict().items()}, seen


def nanogpt_loop(mode: str) -> dict:
    """nanoGPT's loop under torch DDP and distopt: the params at the end, and the losses the
    master process estimated."""
    (torch_end, torch_seen), (ours, seen) = (_nanogpt_run(k, mode) for k in ("torch", "distopt"))
    return {"diff": _largest_difference(torch_end, ours), "estimates": (torch_seen, seen)}


@pytest.mark.parametrize("mode", NANOGPT_MODES)
def test_nanogpts_loop_with_two_lines_changed_ends_where_torch_ddp_ends(both, mode):
    for rank, v in enumerate(case_result(both, f"nanogpt-{mode}")):
        assert v["diff"] <= TRAJECTORY_TOL, v
        theirs, ours = v["estimates"]
        assert len(ours) == (2 if rank == 0 else 0)  # estimate_loss() on the master alone
        # The same weights evaluated on the same batches: losses of ~3 within fp32 round-off.
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(theirs, ours, strict=True))
