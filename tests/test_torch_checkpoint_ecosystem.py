"""Checkpoints as the torch ecosystem writes them, over distopt: torchtitan's checkpointer
(the optimizer in torch's flat layout, ``flatten_optimizer_state_dict=True``, beside the
model's entries, the LR scheduler and the train state) and ``dcp.async_save`` with torch's
default stager ([Note: torch's flat optimizer layout] in checkpoint/torch_flat.py, [Note:
staging by torch's stagers] in checkpoint/dcp.py).

torchtitan's package needs torchdata, datasets, tyro, tensorboard and more, none of which the
suite installs, so ``TitanCheckpointer`` below makes the calls its ``CheckpointManager`` makes
(torchtitan 0.2.0, components/checkpoint.py and optimizer.py): a ``ModelWrapper`` caching
``get_model_state_dict`` of each model part and loading with ``set_model_state_dict(...,
StateDictOptions(strict=False))``, an ``OptimizersContainer`` whose ``state_dict`` and
``load_state_dict`` are ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
``flatten_optimizer_state_dict=True``, the model's entries flattened into the top level and
``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` of that dict.

The runs train the MLP of test_torch_dcp_state_dict.py on its batches with a LambdaLR
schedule, so a resumed run at another d and under another system follows the one-process run.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_torch_dcp_state_dict import (
    LR,
    MODES,
    SAVED_AT,
    STEPS,
    _batch,
    _build,
    _model,
    _own,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from dist_harness import case_result, run_cases
from helpers import FP32_TOL, assert_within_adamw_drift, shared_tmpdir

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FULL_FLAT = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
DISTOPT = [f"distopt-{m}" for m in MODES]


def _schedule(step: int) -> float:
    """A warmup, so that each step's lr differs and a lost scheduler state shows."""
    return (step + 1) / 4


def _run(system: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model, opt = _build(system)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = (t[rank::world] for t in _batch(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


# ---------------------------------------------------------------- torchtitan's calls


class ModelWrapper(Stateful):
    """torchtitan's ``ModelWrapper``: the model parts' state dicts, cached, as one dict."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        self.model = [model] if isinstance(model, nn.Module) else model
        self.cache_state_dict = self._get_state_dict()

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for sd in map(get_model_state_dict, self.model) for k, v in sd.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.cache_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(set_model_state_dict, model_state_dict=state_dict,
                                 options=StateDictOptions(strict=False))
        list(map(func, self.model))
        self.cache_state_dict = self._get_state_dict()


class OptimizersContainer(Stateful):
    """torchtitan's ``OptimizersContainer``'s ``state_dict`` and ``load_state_dict``."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[Any]) -> None:
        self.model_parts, self.optimizers = model_parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        func = functools.partial(get_optimizer_state_dict, options=FLAT)
        return {k: v for sd in map(func, self.model_parts, self.optimizers)
                for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(set_optimizer_state_dict, optim_state_dict=state_dict,
                                 options=FLAT)
        list(map(func, self.model_parts, self.optimizers))


class LRSchedulersContainer(Stateful):
    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(dict(state_dict))


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class TitanCheckpointer:
    """``CheckpointManager``'s states, save (sync or ``async``) and load."""

    def __init__(self, model: nn.Module, opt: Any, sched: Any, train_state: TrainState,
                 folder: str) -> None:
        self.folder = folder
        self.states = {"train_state": train_state,
                       "optimizer": OptimizersContainer([model], [opt]),
                       "lr_scheduler": LRSchedulersContainer([sched]),
                       "model": ModelWrapper(model)}

    def _flattened_model_states_sd(self) -> dict[str, Any]:
        sd = {k: v for k, v in self.states.items() if k != "model"}
        sd.update(self.states["model"].state_dict())
        return sd

    def save(self, step: int, *, asynchronous: bool = False) -> None:
        checkpoint_id = str(Path(self.folder) / f"step-{step}")
        states = self._flattened_model_states_sd()
        if asynchronous:
            dcp.async_save(states, checkpoint_id=checkpoint_id).result()
        else:
            dcp.save(states, checkpoint_id=checkpoint_id)

    def load(self, step: int) -> None:
        states = self._flattened_model_states_sd()
        dcp.load(states, checkpoint_id=str(Path(self.folder) / f"step-{step}"))
        self.states["model"].load_state_dict(states)


def _pieces(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """This rank's masters and state as torch's sharded state dicts give them, and the whole
    params: runs at the same layout compare piece by piece."""
    model.finish_param_sync()
    msd, osd = get_state_dict(model, opt)
    values = {f"model/{k}": v for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        values.update({f"{key}/{fqn}": v for key, v in state.items()})
    out = {k: own for k, v in values.items() if (own := _own(v)) is not None}
    out.update({f"param/{k}": v.clone() for k, v in model.full_state_dict().items()})
    return out


def titan_round_trip(system: str, asynchronous: bool) -> dict:
    """A run checkpointed by torchtitan's calls after SAVED_AT steps and trained on, and a
    fresh run that loads it and trains as far: their ends, the loaded train state and the
    scheduler's step."""
    folder = shared_tmpdir("titan-")
    model, opt, sched = _run(system)
    train_state = TrainState()
    checkpointer = TitanCheckpointer(model, opt, sched, train_state, folder)
    _train(model, opt, sched, range(SAVED_AT))
    train_state.step, train_state.ntokens_seen = SAVED_AT, 24 * SAVED_AT
    checkpointer.save(SAVED_AT, asynchronous=asynchronous)
    keys = sorted(dcp.FileSystemReader(str(Path(folder) / f"step-{SAVED_AT}")).read_metadata()
                  .state_dict_metadata)
    _train(model, opt, sched, range(SAVED_AT, STEPS))
    straight = _pieces(model, opt)
    model.release()

    model, opt, sched = _run(system)
    train_state = TrainState()
    TitanCheckpointer(model, opt, sched, train_state, folder).load(SAVED_AT)
    loaded = {"train_state": (train_state.step, train_state.ntokens_seen),
              "last_epoch": sched.last_epoch, "lr": opt.param_groups[0]["lr"]}
    _train(model, opt, sched, range(SAVED_AT, STEPS))
    return {"straight": straight, "resumed": _pieces(model, opt), "loaded": loaded,
            "keys": keys}


def flat_layout_against_fsdp() -> dict:
    """FSDP2's and distopt's flat optimizer state dicts after the same two steps: their keys,
    their param groups, their full values; and a flat dict merged with another part's keys,
    loaded into distopt."""
    runs = {}
    for system in ("fsdp", "distopt-optim"):
        model, opt, sched = _run(system)
        _train(model, opt, sched, range(SAVED_AT))
        runs[system] = (model, opt, get_optimizer_state_dict(model, opt, options=FLAT),
                        get_optimizer_state_dict(model, opt, options=FULL_FLAT))
    _, _, fsdp_flat, fsdp_full = runs["fsdp"]
    ddp, opt, flat, full = runs["distopt-optim"]
    groups = {k for k in flat if k.startswith("param_groups.")}
    state_diff = max((full[k].double() - fsdp_full[k].full_tensor().double()
                      if hasattr(fsdp_full[k], "full_tensor")
                      else full[k].double() - fsdp_full[k].double()).abs().max().item()
                     for k in fsdp_full if k.startswith("state."))
    # Another model chunk's keys in the same dict, as torchtitan merges its parts' dicts.
    merged = {**full, "state.other.weight.exp_avg": torch.ones(2),
              "param_groups.other.weight.lr": 5.0}
    fresh, fresh_opt, _ = _run("distopt-grads")
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=merged, options=FULL_FLAT)
    reloaded = get_optimizer_state_dict(fresh, fresh_opt, options=FULL_FLAT)
    # A group whose params disagree on an option cannot be one group: refused on every rank.
    torn = {**full, "param_groups.0.bias.lr": 1.0}
    try:
        set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=torn, options=FLAT)
        torn_error = "no error"
    except ValueError as error:
        torn_error = str(error)
    return {
        "keys": sorted(flat), "fsdp_keys": sorted(fsdp_flat),
        "groups": all(flat[k] == fsdp_flat[k] for k in groups if k.endswith(("lr", "betas"))),
        "group_keys": sorted(groups) == sorted(k for k in fsdp_flat if k in groups),
        "state_diff": state_diff,
        "reloaded": max((reloaded[k].double() - full[k].double()).abs().max().item()
                        if isinstance(full[k], torch.Tensor) else float(reloaded[k] != full[k])
                        for k in full),
        "via_get_state_dict": sorted(get_state_dict(ddp, opt, options=FLAT)[1]) == sorted(flat),
        "torn": torn_error,
    }


def _titan_save_cases() -> list:
    return [(f"titan-{s}-{'async' if a else 'sync'}", titan_round_trip, (s, a))
            for s in DISTOPT for a in (False, True)]


# ---------------------------------------------------------------- async_save


def _live_boxes(*sds: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for sd in sds:
        for value in sd.values():
            if isinstance(value, dict):
                out.extend(_live_boxes(value))
            elif hasattr(value, "shard") and value.shard is not None:
                out.append(value)
    return out


def _read_back(system: str, path: str) -> dict[str, torch.Tensor]:
    """This rank's pieces of the checkpoint at ``path``, read into a fresh run's state dicts."""
    model, opt, _ = _run(system)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    values = {f"model/{k}": v for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        values.update({f"{key}/{fqn}": v for key, v in state.items()})
    out = {k: own for k, v in values.items() if (own := _own(v)) is not None}
    model.release()
    return out


def async_save_is_save(system: str) -> dict:
    """``dcp.async_save`` with torch's default stager and ``dcp.save`` of the same state dicts,
    the live state changed after ``async_save`` returns and before its write ends; and with
    torch's other stager (a ``FileSystemWriter`` caching its staged copy) before and after the
    change. Every checkpoint read back, and the storage of the default stager's copy."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    path = shared_tmpdir("async-save-")
    model, opt, sched = _run(system)
    _train(model, opt, sched, range(SAVED_AT))
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}

    def pieces() -> dict[str, torch.Tensor]:
        return {k: v for k, v in _pieces(model, opt).items() if not k.startswith("param/")}

    at_call = pieces()
    dcp.save(sd, checkpoint_id=f"{path}/sync")
    cached = dcp.FileSystemWriter(f"{path}/blocking", cache_staged_state_dict=True)
    dcp.async_save(sd, checkpoint_id=f"{path}/blocking", storage_writer=cached).result()
    pending = dcp.async_save(sd, checkpoint_id=f"{path}/async")
    live = _live_boxes(msd, osd["state"])
    with torch.no_grad():
        for boxes in live:
            boxes.shard.local.add_(1000.0)  # the step after the save, on the live state
    pending.result()
    moved = pieces()
    # The cached copy again: filled anew from the changed state.
    dcp.async_save(sd, checkpoint_id=f"{path}/blocking-again", storage_writer=cached).result()
    # What the default stager makes: boxes in storages of exactly their bytes, none shared
    # with the live state.
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = _live_boxes_staged(stager.stage(sd))
    stager.close()
    live_ptrs = {t.untyped_storage().data_ptr() for b in live for t in b._chunks.values()}
    own_bytes = all(t.untyped_storage().nbytes() == t.nbytes
                    and t.untyped_storage().data_ptr() not in live_ptrs
                    for b in staged for t in b._chunks.values())
    model.release()
    names = ("sync", "async", "blocking", "blocking-again")
    keys = [sorted(dcp.FileSystemReader(f"{path}/{k}").read_metadata().state_dict_metadata)
            for k in names]
    return {"at_call": at_call, "moved": moved, "own_bytes": own_bytes, "staged": len(staged),
            "same_keys": all(k == keys[0] for k in keys),
            **{name: _read_back(system, f"{path}/{name}") for name in names}}


def _live_boxes_staged(sd: Any) -> list[torch.Tensor]:
    if isinstance(sd, dict):
        return [b for v in sd.values() for b in _live_boxes_staged(v)]
    return [sd] if type(sd).__name__ == "_DcpFlat" else []


# ---------------------------------------------------------------- fixtures, d = 2


@pytest.fixture(scope="module")
def at_two():
    return run_cases(2, [*_titan_save_cases(),
                         ("layout", flat_layout_against_fsdp, ()),
                         *[(f"async-{s}", async_save_is_save, (s,)) for s in DISTOPT]])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("system", DISTOPT)
def test_torchtitans_checkpointer_resumes_a_distopt_run_bit_for_bit(at_two, system,
                                                                     asynchronous):
    name = f"titan-{system}-{'async' if asynchronous else 'sync'}"
    for v in case_result(at_two, name):
        assert v["loaded"]["train_state"] == (SAVED_AT, 24 * SAVED_AT), v["loaded"]
        assert v["loaded"]["last_epoch"] == SAVED_AT, v["loaded"]
        assert v["loaded"]["lr"] == LR * _schedule(SAVED_AT), v["loaded"]
        # torch's flat layout beside the model's FQNs and the other states.
        assert "optimizer.state.0.weight.exp_avg" in v["keys"], v["keys"]
        assert "optimizer.param_groups.4.bias.lr" in v["keys"], v["keys"]
        assert {"0.weight", "lr_scheduler.last_epoch", "train_state.step"} <= set(v["keys"])
        # The same ranks, the same arithmetic in the same order: the same bits.
        assert set(v["resumed"]) == set(v["straight"])
        for key, value in v["straight"].items():
            assert torch.equal(v["resumed"][key], value), key


def test_the_flat_layout_is_fsdp2s(at_two):
    values = case_result(at_two, "layout")
    # Each rank gives the state of the params it holds elements of (a param's step comes from
    # its owners, never made up elsewhere), FSDP2 every param's: together the same keys.
    assert set().union(*(v["keys"] for v in values)) == set(values[0]["fsdp_keys"])
    for v in values:
        assert set(v["keys"]) <= set(v["fsdp_keys"]), v["keys"]
        assert v["groups"] and v["group_keys"], v
        # The same two steps of AdamW over other partial sums: the suite's fp32 bound.
        assert v["state_diff"] <= FP32_TOL, v["state_diff"]
        # A flat dict with another model part's keys loads this part's entries exactly.
        assert v["reloaded"] == 0.0, v["reloaded"]
        assert v["via_get_state_dict"], "get_state_dict takes the option too"
    assert values[0]["torn"] == values[1]["torn"]
    assert "different 'lr'" in values[0]["torn"] and "'0.bias'" in values[0]["torn"]


@pytest.mark.parametrize("system", DISTOPT)
def test_async_save_with_torchs_stager_writes_what_save_writes(at_two, system):
    for v in case_result(at_two, f"async-{system}"):
        assert v["same_keys"]
        assert v["staged"] > 0 and v["own_bytes"], v
        for name in ("sync", "async", "blocking", "blocking-again"):
            assert set(v[name]) == set(v["at_call"]), name
        for key, value in v["at_call"].items():
            # Bit for bit the state at the call, though the live state moved before the write.
            for name in ("sync", "async", "blocking"):
                assert torch.equal(v[name][key], value), (name, key)
            assert not torch.equal(v["moved"][key], value) or "step" in key, key
            assert torch.equal(v["blocking-again"][key], v["moved"][key]), key


# ---------------------------------------------------------------- resharding, d = 2 to 3


def titan_save(system: str, root: str) -> None:
    model, opt, sched = _run(system)
    train_state = TrainState()
    checkpointer = TitanCheckpointer(model, opt, sched, train_state, f"{root}/{system}")
    _train(model, opt, sched, range(SAVED_AT))
    train_state.step = SAVED_AT
    checkpointer.save(SAVED_AT)


def titan_resume(system: str, root: str, saver: str) -> dict[str, torch.Tensor]:
    from test_torch_dcp_state_dict import _ends

    model, opt, sched = _run(system)
    train_state = TrainState()
    TitanCheckpointer(model, opt, sched, train_state, f"{root}/{saver}").load(SAVED_AT)
    _train(model, opt, sched, range(train_state.step, STEPS))
    return _ends(model, opt)


def _scheduled_reference() -> dict[str, torch.Tensor]:
    """One process, torch's AdamW with the schedule on the whole batch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    out = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}/{n}"] = opt.state[p][key]
    return out


RESHARDED = [("distopt-optim", "fsdp"), ("distopt-grads", "fsdp"), ("distopt-params", "fsdp"),
             ("fsdp", "distopt-optim")]


@pytest.fixture(scope="module")
def at_three(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("titan-reshard"))
    run_cases(2, [(f"titan-save-{s}", titan_save, (s, root))
                  for s in sorted({s for _, s in RESHARDED})])
    return run_cases(3, [(f"{loader}<-{saver}", titan_resume, (loader, root, saver))
                         for loader, saver in RESHARDED])


@pytest.mark.slow
@pytest.mark.parametrize("loader,saver", RESHARDED, ids=[f"{a}<-{b}" for a, b in RESHARDED])
def test_torchtitans_checkpoint_moves_between_fsdp2_and_distopt_at_another_size(
        at_three, loader, saver):
    reference = _scheduled_reference()
    for ends in case_result(at_three, f"{loader}<-{saver}"):
        assert_within_adamw_drift(ends, reference)
