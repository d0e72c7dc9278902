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
import copy

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


def _wrapped(kind: str, mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    if kind == "torch":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ddp = distopt.DistributedDataParallel(model, **MODES[mode])
    return ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)


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


def _state(ddp: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the wrapper's state dict, read where its values are whole."""
    if isinstance(ddp, distopt.DistributedDataParallel):
        ddp.finish_param_sync()
    with _readable(ddp):
        return {k: v.detach().clone() for k, v in ddp.state_dict().items()}


# ---------------------------------------------------------------- torch DDP scripts (#57)
# Each trains a torch DDP script under torch's DDP and distopt's, and returns the largest
# difference of the two state dicts at the end (or what each rank saw where distopt refuses).


def create_graph_backward(mode: str) -> dict:
    """``loss.backward(create_graph=True)`` (as scripts that go on to take second-order grads
    write it). torch DDP's reducer reduces each grad detached (reducer.cpp: the higher-order
    grad is not synchronized), and so does distopt. torch 2.13's DDP on the CPU raises in that
    backward itself ("a leaf Variable that requires grad is being used in an in-place
    operation", at any d); where it does, the reference is torch DDP's reduction of the same
    grads detached, the script with ``backward()``. Returns torch's error (None where it ran)
    and the largest difference of the state dicts after three steps."""
    def train(kind: str, create_graph: bool) -> dict[str, torch.Tensor]:
        ddp, opt = _wrapped(kind, mode)
        for step in range(STEPS + 1):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x), y).backward(create_graph=create_graph)
            opt.step()
        return _state(ddp)

    ours = train("distopt", True)
    try:
        reference, torch_error = train("torch", True), None
    except RuntimeError as error:
        reference, torch_error = train("torch", False), str(error)
    return {"torch_error": torch_error, "diff": _largest_difference(reference, ours)}


class _Lookup(nn.Module):
    """An ``nn.Embedding`` and an ``nn.EmbeddingBag``, sparse or dense, and a head."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 6, sparse=sparse)
        self.bag = nn.EmbeddingBag(20, 6, sparse=sparse)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1) + self.bag(tokens))


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows of step ``step``'s batch of 5 tokens a row, from 20 (rows repeat tokens,
    within a rank and across ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 20, (4 * world, 5), generator=g)
    return tokens[rank::world], torch.randn(4 * world, 3, generator=g)[rank::world]


def sparse_embeddings(mode: str) -> dict[str, float]:
    """``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``: torch DDP reduces
    their sparse grads; distopt adds them densified into its buckets. "sgd": torch's SGD with
    momentum, which takes sparse grads, stepping torch DDP's sparse grads against distopt's
    dense ones. "adamw": torch's AdamW refuses sparse grads, so distopt's model with sparse
    embeddings is compared to torch DDP's with dense ones (the same grads, dense)."""
    out = {}
    for name, opt_cls, kwargs in (("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                  ("adamw", torch.optim.AdamW, {"lr": 1e-2})):
        ends = []
        for kind in ("torch", "distopt"):
            model = _Lookup(sparse=kind == "distopt" or name == "sgd")
            if kind == "torch":
                ddp = nn.parallel.DistributedDataParallel(model)
                opt = opt_cls(ddp.parameters(), **kwargs)
            else:
                ddp = distopt.DistributedDataParallel(model, **MODES[mode])
                opt = distopt.DistributedOptimizer(ddp, opt_cls, **kwargs)
            for step in range(STEPS + 1):
                opt.zero_grad()
                tokens, y = _tokens(step)
                nn.functional.mse_loss(ddp(tokens), y).backward()
                opt.step()
            ends.append(_state(ddp))
        out[name] = _largest_difference(*ends)
    return out


def _reparametrized() -> nn.Module:
    """Layers whose weight torch's utilities compute in a forward pre-hook registered before
    wrapping: ``spectral_norm`` (from ``weight_orig``, with its power iteration's buffers),
    ``weight_norm`` (from ``weight_g`` and ``weight_v``) and ``prune`` (``weight_orig`` times
    a mask); and a last Linear as it comes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    nn.utils.spectral_norm(model[0])
    nn.utils.weight_norm(model[2])
    nn.utils.prune.l1_unstructured(model[4], "weight", amount=0.3)
    return model


def weight_hooks(mode: str) -> float:
    """``spectral_norm``, ``weight_norm`` and ``prune`` applied before wrapping, trained three
    steps under torch DDP and distopt: with sharded params distopt's gathers must run before
    their pre-hooks read the params."""
    ends = []
    for kind in ("torch", "distopt"):
        model = _reparametrized()
        if kind == "torch":
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        else:
            ddp = distopt.DistributedDataParallel(model, **MODES[mode])
            opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
        _train(ddp, opt, range(STEPS + 1))
        ends.append(_state(ddp))
    return _largest_difference(*ends)


def copy_of_the_wrapper(mode: str) -> dict:
    """``copy.deepcopy(ddp)`` for an evaluation copy after two steps: torch DDP's copy is a
    second DDP; distopt refuses the copy on every rank that makes it, naming
    ``copy.deepcopy(ddp.module)``, and the copy made that way (with sharded params inside
    ``gathered_params()``) holds what torch's copy holds and evaluates alike. (torch's copy is
    a DDP: its forward first broadcasts the first rank's BatchNorm statistics, as the
    wrapper's forward does, not the module's.)"""
    x, _ = _batch(7)
    copies, refusal = [], None
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, mode)
        _train(ddp, opt, range(STEPS))
        if kind == "distopt":
            ddp.finish_param_sync()
        try:
            copied = copy.deepcopy(ddp).module
        except TypeError as error:
            refusal = str(error)
            with _readable(ddp):
                copied = copy.deepcopy(ddp.module)
        copies.append(copied.eval())
    with torch.no_grad():
        outputs = [c(x) for c in copies]
    return {"refusal": refusal, "plain": type(copies[1]) is nn.Sequential,
            "state": _largest_difference(*(c.state_dict() for c in copies)),
            "output": (outputs[0] - outputs[1]).abs().max().item()}


def vector_to_parameters(mode: str) -> dict:
    """``torch.nn.utils.vector_to_parameters(vec, model.parameters())`` between steps (a
    perturbation, an average of weights), which rebinds each ``param.data`` to a slice of
    ``vec``, then training on. "fp32": a step, the write, two more steps at lr 1e-2. "bf16":
    bf16 params, whose fp32 masters must follow the write: the same at lr 0, so that each side
    ends at the written values. With sharded params the params are placeholders between
    steps, so the call is refused, naming ``gathered_params()``, and made inside it."""
    out = {}
    for dtype, lr, name in ((torch.float32, 1e-2, "fp32"), (torch.bfloat16, 0.0, "bf16")):
        ends = []
        for kind in ("torch", "distopt"):
            model = _model().to(dtype)
            if kind == "torch":
                ddp = nn.parallel.DistributedDataParallel(model)
                opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
            else:
                ddp = distopt.DistributedDataParallel(model, **MODES[mode])
                opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=lr)
            steps = [(x.to(dtype), y.to(dtype)) for x, y in map(_batch, range(STEPS + 1))]
            for k, (x, y) in enumerate(steps):
                if k == 1:
                    try:
                        with _readable(ddp):
                            vec = nn.utils.parameters_to_vector(model.parameters())
                        nn.utils.vector_to_parameters(0.5 * vec, model.parameters())
                    except RuntimeError as error:  # placeholders: refused, naming the way
                        out["refusal"] = str(error)
                        with _readable(ddp):
                            vec = nn.utils.parameters_to_vector(model.parameters())
                            nn.utils.vector_to_parameters(0.5 * vec, model.parameters())
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            ends.append(_state(ddp))
        out[name] = _largest_difference(*ends)
        start = {f"module.{k}": v.to(dtype) for k, v in _model().state_dict().items()}
        out[f"{name}-moved"] = _largest_difference(ends[0], start)
    return out


def _set_requires_grad(nets: list[nn.Module], requires_grad: bool) -> None:
    """pix2pix's and CycleGAN's ``set_requires_grad``, on the plain modules as they write it."""
    for net in nets:
        for param in net.parameters():
            param.requires_grad = requires_grad


def cyclegan_loop(mode: str) -> float:
    """CycleGAN's loop (junyanz/pytorch-CycleGAN-and-pix2pix) on small MLPs: two generators
    and two discriminators, each wrapped; the discriminators frozen with ``requires_grad =
    False`` while the generators' loss (adversarial, cycle and identity terms) goes back
    through them, then trainable again for their own update. Three iterations under torch DDP
    and distopt; the largest difference of the four nets' params, and whether the frozen
    discriminators' params were freed after each generators' backward (with sharded params:
    gathered for it, then freed; otherwise never gathered apart)."""
    rank = dist.get_rank()
    ends, freed = [], []
    for kind in ("torch", "distopt"):
        torch.manual_seed(0)
        g_ab, g_ba = (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
                      for _ in range(2))
        d_a, d_b = (nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
                    for _ in range(2))
        nets = [g_ab, g_ba, d_a, d_b]
        adam = {"lr": 2e-3, "betas": (0.5, 0.999)}
        if kind == "torch":
            wrapped = [nn.parallel.DistributedDataParallel(n) for n in nets]
            opt_g = torch.optim.Adam([*wrapped[0].parameters(), *wrapped[1].parameters()],
                                     **adam)
            opt_d = torch.optim.Adam([*wrapped[2].parameters(), *wrapped[3].parameters()],
                                     **adam)
        else:
            wrapped = [distopt.DistributedDataParallel(n, **MODES[mode]) for n in nets]
            opt_g = distopt.DistributedOptimizer(wrapped[:2], torch.optim.Adam, **adam)
            opt_d = distopt.DistributedOptimizer(wrapped[2:], torch.optim.Adam, **adam)
        gen_ab, gen_ba, dis_a, dis_b = wrapped
        gan, l1 = nn.functional.mse_loss, nn.functional.l1_loss
        g = torch.Generator().manual_seed(20 + rank)
        for _ in range(3):
            real_a, real_b = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g) + 1
            fake_b, fake_a = gen_ab(real_a), gen_ba(real_b)
            rec_a, rec_b = gen_ba(fake_b), gen_ab(fake_a)
            _set_requires_grad([d_a, d_b], False)
            opt_g.zero_grad()
            loss_g = (gan(dis_b(fake_b), torch.ones(8, 1)) + gan(dis_a(fake_a), torch.ones(8, 1))
                      + 10 * (l1(rec_a, real_a) + l1(rec_b, real_b))
                      + 5 * (l1(gen_ba(real_a), real_a) + l1(gen_ab(real_b), real_b)))
            loss_g.backward()
            if kind == "distopt":  # the frozen nets' gathered params are not held on
                freed.append(all(b.param_data is None for w in wrapped[2:] for b in w.buckets))
            opt_g.step()
            _set_requires_grad([d_a, d_b], True)
            opt_d.zero_grad()
            for dis, real, fake in ((dis_a, real_a, fake_a), (dis_b, real_b, fake_b)):
                loss_d = 0.5 * (gan(dis(real), torch.ones(8, 1))
                                + gan(dis(fake.detach()), torch.zeros(8, 1)))
                loss_d.backward()
            opt_d.step()
        ends.append({f"{i}.{k}": v for i, w in enumerate(wrapped) for k, v in _state(w).items()})
    return {"diff": _largest_difference(*ends), "freed": freed}


def _plain_model() -> nn.Module:
    """An MLP without buffers, as nanoGPT's GPT has none: a forward under torch DDP then
    broadcasts nothing, and torch DDP lets one rank run a forward alone."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def forward_on_one_rank(mode: str) -> dict:
    """nanoGPT's loop: ``if iter_num % eval_interval == 0 and master_process: losses =
    estimate_loss()``, a few forwards of the wrapped model on rank 0 alone ("eval": under
    ``torch.no_grad()`` in eval mode, as estimate_loss runs them; "grad": one with grad
    enabled whose output is only printed). torch DDP trains on; distopt does too with whole
    params, and with sharded params, where every rank gathers each forward's params with every
    other, refuses on every rank, naming the cause and the ways that work. "copy": one of those
    ways, distopt's side evaluating on rank 0 a copy of the module made inside
    ``gathered_params()`` on every rank. Per variant: the largest difference of the state
    dicts (and for "copy" of the evaluated losses), or each side's error."""
    rank = dist.get_rank()
    out = {}
    for variant in ("eval", "grad", "copy"):
        ends, errors, losses = [], {}, []
        for kind in ("torch", "distopt"):
            model = _plain_model()
            if kind == "torch":
                ddp = nn.parallel.DistributedDataParallel(model)
                opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            else:
                ddp = distopt.DistributedDataParallel(model, **MODES[mode])
                opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2)
            try:
                for step in range(STEPS + 1):
                    x, y = _batch(step)
                    if step == 1 and variant == "copy":
                        evaluated = ddp
                        if kind == "distopt":  # on every rank
                            with _readable(ddp):
                                evaluated = copy.deepcopy(ddp.module)
                        if rank == 0:
                            with torch.no_grad():
                                losses.append(nn.functional.mse_loss(evaluated.eval()(x), y))
                            evaluated.train()
                    elif step == 1 and rank == 0:  # the master process evaluates
                        if variant == "eval":
                            ddp.eval()
                            with torch.no_grad():
                                for _ in range(2):
                                    nn.functional.mse_loss(ddp(x), y)
                            ddp.train()
                        else:
                            str(ddp(x).mean())
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), y).backward()
                    opt.step()
                ends.append(_state(ddp))
            except RuntimeError as error:
                errors[kind] = str(error)
        out[variant] = errors or _largest_difference(*ends)
        if losses:
            out["copy-loss"] = (losses[0] - losses[1]).abs().item()
    return out


def _cases() -> list:
    return [case for mode in MODES for case in (
        (f"module-{mode}", module_methods_like_torch, (mode,)),
        (f"create-graph-{mode}", create_graph_backward, (mode,)),
        (f"sparse-{mode}", sparse_embeddings, (mode,)),
        (f"weight-hooks-{mode}", weight_hooks, (mode,)),
        (f"copy-{mode}", copy_of_the_wrapper, (mode,)),
        (f"vector-{mode}", vector_to_parameters, (mode,)),
        (f"cyclegan-{mode}", cyclegan_loop, (mode,)),
        (f"one-rank-{mode}", forward_on_one_rank, (mode,)),
    )]


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


# Two AdamW steps at lr 1e-2 from the same weights and grads averaged over the same rows: torch
# all-reduces each grad and distopt reduce-scatters the bucket, so an average may round
# differently (one fp32 rounding of a sum of d terms), and AdamW's update of size lr divides by
# sqrt(v): a grad differing in its last bit moves a weight by at most ~lr * 2**-23 per step,
# far below this. 1e-6 is 100 times that over three steps and still 10**4 times smaller than
# one step's update, which a missed or doubled step would show.
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


@pytest.mark.parametrize("mode", list(MODES))
def test_backward_with_create_graph_trains_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"create-graph-{mode}"):
        assert v["diff"] <= TRAJECTORY_TOL, v


@pytest.mark.parametrize("mode", list(MODES))
def test_sparse_embedding_grads_train_as_under_torch_ddp(both, mode):
    # SGD: one rounding of each averaged grad apart, lr 0.1, momentum 0.9, three steps: far
    # below 1e-6 (a step moves a weight by ~1e-2).
    for v in case_result(both, f"sparse-{mode}"):
        assert v["sgd"] <= TRAJECTORY_TOL and v["adamw"] <= TRAJECTORY_TOL, v


@pytest.mark.parametrize("mode", list(MODES))
def test_spectral_norm_weight_norm_and_prune_train_as_under_torch_ddp(both, mode):
    for diff in case_result(both, f"weight-hooks-{mode}"):
        assert diff <= TRAJECTORY_TOL, diff


@pytest.mark.parametrize("mode", list(MODES))
def test_a_copy_of_the_wrapper_is_refused_naming_a_copy_of_its_module(both, mode):
    for v in case_result(both, f"copy-{mode}"):
        assert v["refusal"] is not None and "copy.deepcopy(ddp.module)" in v["refusal"], v
        assert "collective" in v["refusal"]  # the cause
        assert v["plain"] and v["state"] <= TRAJECTORY_TOL, v
        assert v["output"] <= 10 * TRAJECTORY_TOL, v  # two layers' sums of those weights


@pytest.mark.parametrize("mode", list(MODES))
def test_vector_to_parameters_is_trained_from_as_under_torch_ddp(both, mode):
    for v in case_result(both, f"vector-{mode}"):
        assert v["fp32"] <= TRAJECTORY_TOL, v
        assert v["bf16"] == 0.0, v  # lr 0: both end at the written values, in bf16
        assert v["fp32-moved"] > 0.1 and v["bf16-moved"] > 0.1, v  # the write halved them
        if mode == "params":
            assert "gathered_params()" in v["refusal"], v
        else:
            assert "refusal" not in v, v


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cyclegan_loop_freezing_its_discriminators_ends_where_torch_ddp_ends(both, mode):
    for v in case_result(both, f"cyclegan-{mode}"):
        assert v["diff"] <= TRAJECTORY_TOL, v
        if mode == "params":
            assert v["freed"] == [True] * 3, v


@pytest.mark.parametrize("mode", list(MODES))
def test_a_forward_on_one_rank_trains_as_under_torch_ddp_or_is_refused_on_every_rank(both, mode):
    results = case_result(both, f"one-rank-{mode}")
    for v in results:
        assert v["copy"] <= TRAJECTORY_TOL, v  # the way that works, in every mode
    assert results[0]["copy-loss"] <= TRAJECTORY_TOL, results[0]
    for variant in ("eval", "grad"):
        if mode != "params":
            for v in results:
                assert v[variant] <= TRAJECTORY_TOL, v
            continue
        refusals = [v[variant] for v in results]
        for refusal in refusals:
            assert set(refusal) == {"distopt"}, refusal  # torch trained; distopt refused
        message = refusals[0]["distopt"]
        assert all(r["distopt"] == message for r in refusals), refusals  # the same everywhere
        for words in ("shard_params=True", "every rank", "rank 0", "rank 1",
                      "gathered_params()", "copy.deepcopy(ddp.module)",
                      "ddp.full_state_dict()"):
            assert words in message, (words, message)


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
