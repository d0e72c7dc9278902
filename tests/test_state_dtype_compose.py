"""bf16 optimizer state (``state_dtype``) with the rest of distopt: tensor parallelism, a
hierarchical mesh, overlapped param gathers, the fp32-accumulated reduce-scatter, and a
checkpoint saved at one DP size and resumed at another.

Each case trains with fixed grad coefficients (tests/test_state_dtype.py): every averaged grad
is known exactly, so distopt with bf16 state equals plain torch.optim whose state is rounded to
bf16 after every step, bit for bit, and every case compares each rank's fp32 masters and state
with that reference after every step. With the fp32-accumulated reduce-scatter the ranks' grads
differ and the reference steps their fp32 average rounded once to bf16, what that reduction
promises. One spawned group per world size runs every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import distopt

from dist_harness import case_result, run_cases
from helpers import StrictCollectives, fp32_average, shared_tmpdir, world_params
from models import Block, tp_plan
from test_state_dtype import (
    ADAMW,
    BF16,
    _coefficients,
    _model,
    _muon_groups,
    _reference,
    _round_state,
)

STEPS = 4
SAVED_AT = 2  # the checkpoint cases save after this many steps and resume for the rest
BUCKET = 700  # elements: several buckets for the MLP's 1697 params


def _local(value: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's part of a whole-tensor ``value`` laid out like ``param`` (its TP shard
    for a DTensor param, no communication)."""
    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    return value


def _local_param(param: nn.Parameter) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


# ---------------------------------------------------------------- grads and the reference


def _rank_grads(shape: torch.Size, step: int, index: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s grad of param ``index`` for the fp32-accumulation case: full-mantissa
    values that differ across ranks, so their bf16 sum rounds."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * index + rank)
    return torch.randn(shape, generator=g) * 1e-2


def _grads(model: nn.Module, step: int, fp32_accumulation: bool = False
           ) -> list[torch.Tensor]:
    """The averaged grad of every param (this rank's part of it), as distopt must reduce it."""
    out = []
    for index, p in enumerate(model.parameters()):
        if fp32_accumulation:
            rows = [_rank_grads(p.shape, step, index, r).to(BF16)
                    for r in range(dist.get_world_size())]
            out.append(fp32_average(rows, BF16).float())
        else:
            out.append(_local(_coefficients(p.shape, step, index), p))
    return out


def _loss(model: nn.Module, step: int, fp32_accumulation: bool = False) -> torch.Tensor:
    """A loss linear in the params whose grads are the coefficients (this rank's own, with
    ``fp32_accumulation``; this rank's TP shard of them for DTensor params)."""
    rank = dist.get_rank()
    terms = []
    for index, p in enumerate(model.parameters()):
        c = (_rank_grads(p.shape, step, index, rank) if fp32_accumulation
             else _local(_coefficients(p.shape, step, index), p))
        terms.append((_local_param(p).float() * c).sum())
    return torch.stack(terms).sum()


class Reference:
    """Plain torch.optim over fp32 copies of this rank's part of every param (the whole param
    without TP), with distopt's group options, one optimizer per class; the state rounded to
    the held dtypes after every step."""

    def __init__(self, model: nn.Module, opt: distopt.DistributedOptimizer) -> None:
        self.params = list(model.parameters())
        self.masters, self.optimizers = _reference(model, opt)
        self.dtypes = dict(opt.state_precision.dtypes)

    def step(self, grads: list[torch.Tensor]) -> None:
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad.clone()
        for ref in self.optimizers:
            ref.step()
        _round_state(self.optimizers, self.dtypes)

    def matches(self, opt: distopt.DistributedOptimizer) -> dict[str, bool]:
        """Every piece's fp32 master and held state against the reference's elements, bit for
        bit, and the state's dtypes."""
        index = {p: i for i, p in enumerate(self.params)}
        ref_state = {p: s for ref in self.optimizers for p, s in ref.state.items()}
        out = {"masters": True, "state": True, "dtypes": True}
        for (param, piece, main), value in zip(opt.pieces(), opt.main_param_values(),
                                               strict=True):
            lo, hi = piece.param_range.start, piece.param_range.end
            ref = self.masters[index[param]]
            out["masters"] &= torch.equal(value.reshape(-1), ref.detach().reshape(-1)[lo:hi])
            for key, held in opt.state[main].items():
                want = ref_state[ref][key]
                if key == "step":
                    out["state"] &= float(held) == float(want)
                    continue
                out["dtypes"] &= held.dtype == self.dtypes.get(key, torch.float32)
                out["state"] &= torch.equal(held.float().reshape(-1), want.reshape(-1)[lo:hi])
        return out


def _state_dtypes(opt: distopt.DistributedOptimizer) -> set[torch.dtype]:
    return {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}


def _optimizer(ddp, model: nn.Module, kind: str, **kwargs) -> distopt.DistributedOptimizer:
    if kind == "muon":
        return distopt.DistributedOptimizer(ddp, torch.optim.Muon, params=_muon_groups(model),
                                            state_dtype=BF16, lr=0.02, **kwargs)
    return distopt.DistributedOptimizer(ddp, torch.optim.AdamW, state_dtype=BF16, **kwargs,
                                        **ADAMW)


def _trajectory(model: nn.Module, ddp, opt, fp32_accumulation: bool = False
                ) -> list[dict[str, bool]]:
    """STEPS steps of distopt and of the reference; one verdict per step."""
    ref = Reference(model, opt)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, fp32_accumulation).backward()
        opt.step()
        ddp.finish_param_sync()
        ref.step(_grads(model, step, fp32_accumulation))
        out.append(ref.matches(opt))
    return out


# ---------------------------------------------------------------- the cases


def tensor_parallel() -> dict:
    """(dp, tp) = (2, 2): a transformer block's DTensor params (column- and row-wise shards,
    replicated biases) and plain ones, AdamW with bf16 state."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Block()
    parallelize_module(model, mesh["tp"], tp_plan())
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh, bucket_size=100)
    opt = _optimizer(ddp, model, "adamw")
    steps = _trajectory(model, ddp, opt)
    return {"steps": steps, "dp_size": ddp.dp_size, "state_dtypes": _state_dtypes(opt),
            "dtensor_pieces": sum(isinstance(p, DTensor) for p, _, _ in opt.pieces())}


def hierarchical(kind: str) -> dict:
    """Shard over 2 ranks, replicate over 2 (four ranks)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model()
    ddp = distopt.DistributedDataParallel(model, device_mesh=mesh, bucket_size=BUCKET)
    opt = _optimizer(ddp, model, kind)
    steps = _trajectory(model, ddp, opt)
    return {"steps": steps, "dp_size": ddp.dp_size, "state_dtypes": _state_dtypes(opt)}


class _Term(nn.Module):
    """A linear layer's params whose forward is the loss's terms of its own params, so a
    forward pre-hook runs before the params are read."""

    def __init__(self, linear: nn.Linear, first: int) -> None:
        super().__init__()
        self.weight, self.bias, self.first = linear.weight, linear.bias, first

    def forward(self, step: int) -> torch.Tensor:
        return torch.stack([(p.float() * _coefficients(p.shape, step, self.first + i)).sum()
                            for i, p in enumerate((self.weight, self.bias))])


class _Terms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        linears = [m for m in _model() if isinstance(m, nn.Linear)]
        self.layers = nn.ModuleList(_Term(m, 2 * i) for i, m in enumerate(linears))

    def forward(self, step: int) -> torch.Tensor:
        return torch.cat([layer(step) for layer in self.layers])


def overlapped_gathers(kind: str) -> dict:
    """overlap_param_gather: each step's gathers are still in flight when the next forward
    starts and each layer waits for its own; a gather not waited for reads NaN (see
    StrictCollectives), which the loss's terms against the reference's would show."""
    model = _Terms()
    ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET)
    opt = _optimizer(ddp, model, kind, overlap_param_gather=True)
    ref = Reference(model, opt)
    out = {"steps": [], "in_flight": [], "terms_equal": [], "state_dtypes": None}
    with StrictCollectives() as strict:
        for step in range(STEPS):
            opt.zero_grad()
            terms = ddp(step)
            want = torch.stack([(m.detach() * _coefficients(m.shape, step, i)).sum()
                                for i, m in enumerate(ref.masters)])
            out["terms_equal"].append(torch.equal(terms.detach(), want))
            terms.sum().backward()
            opt.step()
            out["in_flight"].append(ddp.param_gathers_in_flight)
            ref.step(_grads(model, step))
            out["steps"].append(ref.matches(opt))  # the owners' masters: no gather needed
        ddp.finish_param_sync()
    out["violations"] = strict.violations
    out["buckets"] = len(ddp.buckets)
    out["state_dtypes"] = _state_dtypes(opt)
    return out


def fp32_accumulated_reduction() -> dict:
    """bf16 params and grads with store_param_remainders and
    reduce_scatter_with_fp32_accumulation; each rank's grads are its own."""
    model = _model(BF16)
    ddp = distopt.DistributedDataParallel(model, grad_dtype=BF16, bucket_size=BUCKET,
                                          reduce_scatter_with_fp32_accumulation=True)
    opt = _optimizer(ddp, model, "adamw", store_param_remainders=True)
    steps = _trajectory(model, ddp, opt, fp32_accumulation=True)
    # The data make the option matter: bf16 sums in rank order differ from the fp32 average.
    rows = [_rank_grads(torch.Size([4096]), 0, 0, r).to(BF16)
            for r in range(dist.get_world_size())]
    plain = rows[0]
    for row in rows[1:]:
        plain = plain + row
    return {"steps": steps, "fp32_buckets": [b.fp32_accumulation for b in ddp.buckets],
            "plain_differs": int((plain / len(rows) != fp32_average(rows, BF16)).sum()),
            "state_dtypes": _state_dtypes(opt)}


def checkpoint_path() -> str:
    return shared_tmpdir("distopt-state-compose-")


def save_after(path: str, kind: str) -> dict:
    """SAVED_AT steps with bf16 state, then a checkpoint named after this DP size."""
    model = _model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET)
    opt = _optimizer(ddp, model, kind)
    ref = Reference(model, opt)
    for step in range(SAVED_AT):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        ddp.finish_param_sync()
        ref.step(_grads(model, step))
    distopt.save_checkpoint(path, ddp, opt, name=f"{kind}-d{dist.get_world_size()}")
    return ref.matches(opt)


def resume(path: str, kind: str, saved_world: int) -> dict:
    """Load the checkpoint saved at ``saved_world`` ranks, then train the remaining steps; the
    reference trains every step on one process."""
    model = _model()
    ddp = distopt.DistributedDataParallel(model, bucket_size=BUCKET)
    opt = _optimizer(ddp, model, kind)
    ref = Reference(model, opt)
    for step in range(SAVED_AT):
        ref.step(_grads(model, step))
    distopt.load_checkpoint(f"{path}/{kind}-d{saved_world}", ddp, opt)
    out = {"loaded": ref.matches(opt), "loaded_dtypes": _state_dtypes(opt), "steps": []}
    for step in range(SAVED_AT, STEPS):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        ddp.finish_param_sync()
        ref.step(_grads(model, step))
        out["steps"].append(ref.matches(opt))
    return out


# ---------------------------------------------------------------- the grid

EXACT = {"masters": True, "state": True, "dtypes": True}
KINDS = ["adamw", "muon"]


def _held_in_bf16(values: list[dict], key: str = "state_dtypes") -> bool:
    """Every rank's state is bf16 (a rank may own no matrix under Muon), and some rank has
    state."""
    return all(v[key] <= {BF16} for v in values) and any(v[key] for v in values)


def _flat_cases() -> list:
    cases = [(f"overlap-{kind}", overlapped_gathers, (kind,)) for kind in KINDS]
    cases.append(("fp32-accumulation", fp32_accumulated_reduction, ()))
    return cases


@pytest.fixture(scope="module")
def results() -> dict:
    """The group of two's results (key 2), and the path of the checkpoints its ranks saved."""
    path = case_result(run_cases(2, [("path", checkpoint_path, ())]), "path")[0]
    out = {2: run_cases(2, [*_flat_cases(), *[(f"save-{k}", save_after, (path, k))
                                                for k in KINDS]])}
    return {"path": path, **out}


@pytest.fixture(scope="module")
def results_four(results) -> dict[int, list]:
    """With the group of four's results (slow); the checkpoints go 2 -> 4 and 4 -> 2 ranks."""
    path = results["path"]
    four = [*_flat_cases(),
            ("tp", tensor_parallel, ()),
            *[(f"hierarchical-{k}", hierarchical, (k,)) for k in KINDS],
            *[(f"resume-{k}", resume, (path, k, 2)) for k in KINDS],
            *[(f"save-{k}", save_after, (path, k)) for k in KINDS]]
    out = {2: [dict(per_rank) for per_rank in results[2]], 4: run_cases(4, four)}
    resumed = run_cases(2, [(f"resume-{k}", resume, (path, k, 4)) for k in KINDS])
    for rank, per_rank in enumerate(resumed):
        out[2][rank].update(per_rank)
    return out


def _of(request, d: int) -> list:
    """The results of the group of ``d`` ranks (the group of four only when asked for)."""
    return request.getfixturevalue("results" if d == 2 else "results_four")[d]


@pytest.mark.slow
def test_tensor_parallel(results_four):
    values = case_result(results_four[4], "tp")
    assert _held_in_bf16(values)
    for value in values:
        assert value["dp_size"] == 2 and value["dtensor_pieces"] > 0
        assert value["steps"] == [EXACT] * STEPS, value["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hierarchical_mesh(results_four, kind):
    values = case_result(results_four[4], f"hierarchical-{kind}")
    assert _held_in_bf16(values)
    for value in values:
        assert value["dp_size"] == 2
        assert value["steps"] == [EXACT] * STEPS, value["steps"]


@pytest.mark.parametrize("d", world_params([2, 4]))
@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_param_gathers(request, d, kind):
    values = case_result(_of(request, d), f"overlap-{kind}")
    assert _held_in_bf16(values)
    for value in values:
        assert value["buckets"] >= 2 and value["violations"] == []
        assert all(n == value["buckets"] for n in value["in_flight"]), value["in_flight"]
        assert value["terms_equal"] == [True] * STEPS  # every layer read its gathered params
        assert value["steps"] == [EXACT] * STEPS, value["steps"]


@pytest.mark.parametrize("d", world_params([2, 4]))
def test_fp32_accumulated_reduce_scatter(request, d):
    values = case_result(_of(request, d), "fp32-accumulation")
    assert _held_in_bf16(values)
    for value in values:
        assert value["fp32_buckets"] and all(value["fp32_buckets"])
        if d == 4:  # at d = 2 a bf16 sum of two halves is already the fp32 average
            assert value["plain_differs"] > 100
        assert value["steps"] == [EXACT] * STEPS, value["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(2, 4), (4, 2)])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_resumes_at_another_dp_size(results_four, kind, saved, resumed):
    for value in case_result(results_four[saved], f"save-{kind}"):
        assert value == EXACT
    values = case_result(results_four[resumed], f"resume-{kind}")
    assert _held_in_bf16(values, "loaded_dtypes")
    for value in values:
        assert value["loaded"] == EXACT
        assert value["steps"] == [EXACT] * (STEPS - SAVED_AT), value["steps"]
