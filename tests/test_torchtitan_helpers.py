"""torchtitan 0.3.0's optimizer helpers over distopt: ``init_optim_state``,
``get_flat_optim_state_dict`` and ``load_flat_optim_state_dict`` ([Note: a state dict DCP
reshards] in checkpoint/reshardable.py).

torchtitan 0.3.0's ``OptimizersContainer`` builds each optimizer from ``(name, param)`` pairs and
saves ``opt.state_dict()`` re-keyed by the groups' ``param_names``; DCP reshards its entries, as
FSDP2's DTensor state, when a run resumes at another d. torchtitan's package needs torchdata,
datasets, tyro and more, none of which the suite installs, so its helpers' lines are copied
below, unchanged, and the cases make the calls its ``OptimizersContainer.state_dict`` /
``load_state_dict`` and ``CheckpointManager`` make. The runs train the MLP of
test_torch_dcp_state_dict.py with AdamW and weight decay, saved at d = 2 and resumed at d = 3
(or 2) under distopt in each sharding mode and under FSDP2, against one process with torch's
AdamW.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_torch_dcp_state_dict import MODES, SAVED_AT, STEPS, _batch, _ends, _model
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import distopt

from dist_harness import case_result, run_cases
from helpers import assert_within_adamw_drift

LR, WEIGHT_DECAY = 1e-2, 0.1
DISTOPT = [f"distopt-{m}" for m in MODES]


# ---------------------------------------------------------------- torchtitan's helpers
# Copied from torchtitan 0.3.0, torchtitan/components/optimizer/utils.py (docstrings left out).


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    if optim.state:
        return

    for param_group in optim.param_groups:
        for param in param_group["params"]:
            if param.grad is not None:
                return

    for param_group in optim.param_groups:
        for param in param_group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)

    # Some optimizers update parameters regardless of gradients due to lr, so set
    # lr to zero before stepping to keep parameters unchanged.
    saved_lrs = []
    for param_group in optim.param_groups:
        if "lr" in param_group:
            saved_lrs.append(param_group["lr"])
            param_group["lr"] = (
                torch.tensor(0.0)
                if isinstance(param_group["lr"], torch.Tensor)
                else 0.0
            )
    optim.step(closure=None)
    for param_group in optim.param_groups:
        if "lr" in param_group:
            param_group["lr"] = saved_lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def get_flat_optim_state_dict(optim: torch.optim.Optimizer) -> dict[str, Any]:
    fqn_sd = _optim_state_dict_to_fqn_keys(optim.state_dict())

    flat: dict[str, Any] = {}
    for fqn, state in fqn_sd["state"].items():
        _flatten_state_nested(state, f"state.{fqn}", flat)
    for param_group in fqn_sd["param_groups"]:
        for fqn in param_group["params"]:
            for key, value in param_group.items():
                if key != "params":
                    flat[f"param_groups.{fqn}.{key}"] = value
    return flat


def load_flat_optim_state_dict(
    optim: torch.optim.Optimizer, flat_sd: dict[str, Any]
) -> None:
    optim.load_state_dict(_unflatten_optim_state_dict(optim, flat_sd))


def _optim_state_dict_to_fqn_keys(optim_sd: dict[str, Any]) -> dict[str, Any]:
    id_to_fqn: dict[int, str] = {}
    new_param_groups: list[dict[str, Any]] = []
    for param_group in optim_sd["param_groups"]:
        if "param_names" not in param_group:
            raise ValueError(
                "Optimizer must be built with (name, param) tuples so that "
                "param_names is available for FQN-keyed state dicts."
            )
        fqns = param_group["param_names"]
        for param_id, fqn in zip(param_group["params"], fqns):  # noqa: B905 (torchtitan's own)
            id_to_fqn[param_id] = fqn
        new_group = {k: v for k, v in param_group.items() if k != "param_names"}
        new_group["params"] = list(fqns)
        new_param_groups.append(new_group)

    new_state: dict[str, Any] = {}
    for param_id, state in optim_sd["state"].items():
        if param_id not in id_to_fqn:
            raise KeyError(
                f"Optimizer state has param id {param_id} that is not in any "
                f"param group. Known ids: {sorted(id_to_fqn)}"
            )
        new_state[id_to_fqn[param_id]] = state

    return {"state": new_state, "param_groups": new_param_groups}


def _unflatten_optim_state_dict(
    optim: torch.optim.Optimizer, flat_sd: dict[str, Any]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    param_id = 0
    for param_group in optim.param_groups:
        fqns = param_group["param_names"]
        params = param_group["params"]
        ids: list[int] = []
        for fqn, param in zip(fqns, params):  # noqa: B905 (torchtitan's own)
            ids.append(param_id)
            if param in optim.state:
                param_state: dict[str, Any] = {}
                for state_name in optim.state[param]:
                    flat_key = f"state.{fqn}.{state_name}"
                    if flat_key in flat_sd:
                        param_state[state_name] = flat_sd[flat_key]
                    else:
                        # State value is itself a nested dict (e.g. Shampoo).
                        nested = _reconstruct_nested(flat_sd, flat_key)
                        if nested:
                            param_state[state_name] = nested
                if param_state:
                    state[param_id] = param_state
            param_id += 1

        if not fqns:
            param_groups.append({"params": ids})
            continue
        new_group: dict[str, Any] = {"params": ids}
        for key in param_group:
            if key in ("params", "param_names"):
                continue
            flat_key = f"param_groups.{fqns[0]}.{key}"
            if flat_key not in flat_sd:
                raise KeyError(
                    f"Optimizer param group key {key!r} not found in checkpoint "
                    f"(looked up via param {fqns[0]!r})."
                )
            new_group[key] = flat_sd[flat_key]
        param_groups.append(new_group)

    return {"state": state, "param_groups": param_groups}


def _flatten_state_nested(
    state: dict[str, Any], prefix: str, out: dict[str, Any]
) -> None:
    for key, value in state.items():
        flat_key = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flatten_state_nested(value, flat_key, out)
        else:
            out[flat_key] = value


def _reconstruct_nested(flat_sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    prefix_dot = prefix + "."
    for key, value in flat_sd.items():
        if not key.startswith(prefix_dot):
            continue
        current = result
        parts = key[len(prefix_dot) :].split(".")
        for part in parts[:-1]:
            current = current.setdefault(part, {})
        current[parts[-1]] = value
    return result


# torchtitan 0.3.0, torchtitan/components/optimizer/optimizer.py: OptimizersContainer's
# state_dict and load_state_dict, for its one optimizer here.


def container_state_dict(optim: torch.optim.Optimizer) -> dict[str, Any]:
    result: dict[str, Any] = {}
    init_optim_state(optim)
    result.update(get_flat_optim_state_dict(optim))
    return result


def container_load_state_dict(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    init_optim_state(optim)
    load_flat_optim_state_dict(optim, state_dict)


# ---------------------------------------------------------------- runs


def _build(system: str, model: nn.Module | None = None, **options: Any
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 or distopt over the MLP, AdamW built from ``model.named_parameters()`` as
    torchtitan's ``OptimizersContainer`` builds it."""
    model = _model() if model is None else model
    if system == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.named_parameters(), lr=LR,
                                        weight_decay=WEIGHT_DECAY)
    ddp = distopt.DistributedDataParallel(model, **MODES[system.removeprefix("distopt-")])
    return ddp, distopt.DistributedOptimizer(ddp, torch.optim.AdamW, model.named_parameters(),
                                             lr=LR, weight_decay=WEIGHT_DECAY, **options)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = next(model.parameters()).dtype
    for step in steps:
        x, y = (t[rank::world] for t in _batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()


def titan_save(system: str, root: str) -> None:
    """Train SAVED_AT steps and save as torchtitan's ``CheckpointManager`` does: the model's
    entries at the top level beside ``"optimizer"``, the container's flat dict."""
    model, opt = _build(system)
    _train(model, opt, range(SAVED_AT))
    states = {"optimizer": container_state_dict(opt), **get_model_state_dict(model)}
    dcp.save(states, checkpoint_id=f"{root}/{system}")


def titan_resume(system: str, root: str, saver: str) -> dict[str, torch.Tensor]:
    """A fresh run that loads ``saver``'s checkpoint as ``CheckpointManager.load`` does
    (``dcp.load`` into its own states, then each ``load_state_dict``) and trains to STEPS."""
    model, opt = _build(system)
    states = {"optimizer": container_state_dict(opt), **get_model_state_dict(model)}
    dcp.load(states, checkpoint_id=f"{root}/{saver}")
    set_model_state_dict(model, {k: v for k, v in states.items() if k != "optimizer"},
                         options=StateDictOptions(strict=False))
    container_load_state_dict(opt, states["optimizer"])
    _train(model, opt, range(SAVED_AT, STEPS))
    return _ends(model, opt)


def _held(ddp: nn.Module, opt: Any) -> list[torch.Tensor]:
    """The model's params and, under distopt, the masters this rank holds."""
    if not isinstance(ddp, distopt.DistributedDataParallel):  # FSDP2: its local shards
        return [p.to_local().detach().clone() for p in ddp.parameters()]
    with ddp.gathered_params() if ddp.options.shard_params else _nothing():
        out = [p.detach().clone() for p in ddp.module.parameters()]
    with opt.main_params_materialized():
        out += [m.detach().clone() for m in opt.main_params]
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


def zero_lr_step_leaves_params(system: str, bf16_remainders: bool) -> dict:
    """``init_optim_state`` on a fresh optimizer with weight decay: every param and master the
    same bits, the state made (``step`` 1), no grad left; with bf16 params and
    ``store_param_remainders`` the masters rebuilt from params and remainders too."""
    model = _model().bfloat16() if bf16_remainders else _model()
    options = {"store_param_remainders": True} if bf16_remainders else {}
    ddp, opt = _build(system, model, **options)
    before = _held(ddp, opt)
    init_optim_state(opt)
    after = _held(ddp, opt)
    steps = {float(s["step"]) for s in opt.state.values() if "step" in s}
    return {"same": len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "steps": sorted(steps), "lr": opt.param_groups[0]["lr"],
            "grads": [p.grad is None for g in opt.param_groups for p in g["params"]],
            "flat_keys": sorted(get_flat_optim_state_dict(opt))}


def _reference() -> dict[str, torch.Tensor]:
    """One process, torch's AdamW on the whole batch, STEPS steps."""
    model = _model()
    opt = torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{n}"] = opt.state[p][key]
    return out


def _assert_follows_reference(ends: dict[str, torch.Tensor]) -> None:
    reference = _reference()
    assert_within_adamw_drift(ends, reference)
    # The run moved: a resume that lost the saved state would not follow the reference.
    assert any(reference[k].abs().max() > 0 for k in reference if k.startswith("exp_avg/"))


# ---------------------------------------------------------------- d = 2

SAME_D = [("distopt-grads", "distopt-optim"), ("distopt-params", "distopt-params")]


@pytest.fixture(scope="module")
def at_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("titan-helpers-2"))
    cases = [(f"zero-lr-{s}-{b}", zero_lr_step_leaves_params, (s, b))
             for s in DISTOPT for b in (False, True)]
    cases += [("zero-lr-fsdp", zero_lr_step_leaves_params, ("fsdp", False))]
    cases += [(f"save-{s}", titan_save, (s, root)) for s in sorted({s for _, s in SAME_D})]
    cases += [(f"{a}<-{b}", titan_resume, (a, root, b)) for a, b in SAME_D]
    return run_cases(2, cases)


@pytest.mark.parametrize("bf16_remainders", [False, True], ids=["fp32", "bf16-remainders"])
@pytest.mark.parametrize("system", DISTOPT)
def test_init_optim_states_zero_lr_step_leaves_every_param_and_master(at_two, system,
                                                                      bf16_remainders):
    fsdp_keys = case_result(at_two, "zero-lr-fsdp")[0]["flat_keys"]
    keys = set()
    for v in case_result(at_two, f"zero-lr-{system}-{bf16_remainders}"):
        assert v["same"], "a step at lr 0 with weight decay changed a param or a master"
        assert v["steps"] == [1.0] and v["lr"] == LR and all(v["grads"]), v
        keys |= set(v["flat_keys"])
    # torchtitan's flat keys: each rank those of its pieces, together FSDP2's.
    assert keys == set(fsdp_keys), sorted(keys ^ set(fsdp_keys))


@pytest.mark.parametrize("loader,saver", SAME_D, ids=[f"{a}<-{b}" for a, b in SAME_D])
def test_torchtitans_helpers_resume_a_distopt_run(at_two, loader, saver):
    for ends in case_result(at_two, f"{loader}<-{saver}"):
        _assert_follows_reference(ends)


# ---------------------------------------------------------------- dcp.async_save, PROCESS


def _loaded_ends(loader: str, path: str) -> dict[str, torch.Tensor]:
    """The whole params and AdamW state of a fresh ``loader`` run after torch's recipe
    (``get_state_dict``, ``dcp.load``, ``set_state_dict``) from ``path``."""
    from test_torch_dcp_state_dict import _build as build_plain
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build_plain(loader)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return _ends(model, opt)


def process_async_save(system: str, root: str) -> dict:
    """``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS`` of distopt's state dicts
    beside a ``dcp.save`` of them: both loaded under FSDP2, torch DDP and distopt."""
    from test_torch_dcp_state_dict import _build as build_plain
    from test_torch_dcp_state_dict import _train as train_plain
    from torch.distributed.checkpoint import _async_process_executor as executor
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, opt = build_plain(system)
    train_plain(model, opt, range(SAVED_AT))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/sync")
    try:
        dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/process",
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    finally:
        # torch keeps its checkpointing process for later saves; end it with the case.
        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        del process
    out = {}
    for loader in ("fsdp", "torch", "distopt-params"):
        sync, background = (_loaded_ends(loader, f"{root}/{k}") for k in ("sync", "process"))
        out[loader] = {"keys": set(sync) == set(background),
                       "equal": [k for k in sync if not torch.equal(sync[k], background[k])],
                       "moved": max(v.abs().max().item() for k, v in sync.items()
                                    if k.startswith("exp_avg/"))}
    return out


PROCESS_SYSTEMS = ["distopt-optim", "distopt-params"]  # a checkpointing process each: seconds


@pytest.fixture(scope="module")
def process_saves(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("process-async"))
    return run_cases(2, [(f"process-{s}", process_async_save, (s, f"{root}/{s}"))
                         for s in PROCESS_SYSTEMS])


@pytest.mark.parametrize("system", PROCESS_SYSTEMS)
def test_async_save_in_torchs_checkpointing_process_loads_everywhere_as_save(process_saves,
                                                                             system):
    for v in case_result(process_saves, f"process-{system}"):
        for loader, result in v.items():
            assert result["keys"] and result["moved"] > 0, (loader, result)
            assert result["equal"] == [], (loader, result["equal"])  # bit for bit


# ---------------------------------------------------------------- d = 2 to 3

RESHARDED = [("distopt-grads", "distopt-optim"), ("distopt-params", "distopt-params"),
             ("fsdp", "distopt-optim"), ("fsdp", "distopt-params"),
             ("distopt-optim", "fsdp"), ("distopt-params", "fsdp")]


@pytest.fixture(scope="module")
def at_three(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("titan-helpers-3"))
    run_cases(2, [(f"save-{s}", titan_save, (s, root)) for s in sorted({s for _, s in RESHARDED})])
    return run_cases(3, [(f"{a}<-{b}", titan_resume, (a, root, b)) for a, b in RESHARDED])


@pytest.mark.slow
@pytest.mark.parametrize("loader,saver", RESHARDED, ids=[f"{a}<-{b}" for a, b in RESHARDED])
def test_torchtitans_helpers_move_a_run_between_fsdp2_and_distopt_at_another_size(
        at_three, loader, saver):
    for ends in case_result(at_three, f"{loader}<-{saver}"):
        _assert_follows_reference(ends)
