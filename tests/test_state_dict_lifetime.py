"""Tensors distopt hands out stay readable and saveable after the block or step that made them.

With sharded params a bucket's gathered storage is freed after each use ([Note: sharded params]
in ddp/buffers/param_storage.py). A state dict taken inside ``with ddp.gathered_params():`` views
that storage, as do ``p.detach()`` kept from the block or from a forward hook; read after the free,
they would point at no bytes (a segfault), and ``torch.save`` of them would write a file that
``torch.load`` refuses. [Note: views that outlive a gather] in ddp/buffers/gathered_views.py leaves
the storage to such views instead. Each case trains torch's DDP and distopt's (in every sharding
mode) from the same init on the same ranks, then compares what distopt handed out, read after
its block or step, with torch's values. A view with no bytes is reported, not read, so that the
pool's worker survives the code these tests guard against.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from dist_harness import case_result, pools_at_two_and_three
from test_torch_ddp_conformance import STEPS, TRAJECTORY_TOL, _train, _wrapped

# name -> (the conformance file's mode, distopt's extra options)
MODES = {
    "optim": ("optim", {}),
    "grads": ("grads", {}),
    "params": ("params", {}),
    "params-kept": ("params", {"reshard_after_forward": False}),
}


def _pair(mode: str) -> tuple[tuple[nn.Module, torch.optim.Optimizer],
                              tuple[nn.Module, torch.optim.Optimizer]]:
    """Torch's DDP and distopt's in ``mode``, each trained ``STEPS`` steps from the same init."""
    base, options = MODES[mode]
    pairs = []
    for kind in ("torch", "distopt"):
        ddp, opt = _wrapped(kind, base, distopt_options=options if kind == "distopt" else None)
        _train(ddp, opt, range(STEPS))
        pairs.append((ddp, opt))
    if pairs[1][0].options.shard_params:
        assert pairs[1][0].param_pools, "sharded params without a pool"
    else:
        pairs[1][0].finish_param_sync()
    return pairs[0], pairs[1]


def _has_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte ``t`` views (reading it otherwise reads freed
    memory)."""
    end = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.numel() == 0 or t.untyped_storage().nbytes() >= (end + 1) * t.element_size()


def _difference(ours: dict[str, torch.Tensor] | str, ref: dict[str, torch.Tensor]
                ) -> float | str:
    """The largest difference of ``ours`` from ``ref`` over every key of ``ref``, or what makes
    ``ours`` unreadable."""
    if isinstance(ours, str):
        return ours
    if list(ours) != list(ref):
        return f"keys {list(ours)} != {list(ref)}"
    empty = [k for k, v in ours.items() if not _has_bytes(v)]
    if empty:
        return f"no bytes behind {empty}"
    return max((ours[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _saved_and_loaded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | str:
    """``torch.load`` of ``torch.save(state)``, or the error either raised."""
    stream = io.BytesIO()
    try:
        torch.save(state, stream)
        stream.seek(0)
        return torch.load(stream)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"


def _cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _left_to_views(ddp: nn.Module) -> int:
    return sum(pool.left_to_views for pool in getattr(ddp, "param_pools", {}).values())


def state_dict_after_the_block(mode: str) -> dict:
    """``with ddp.gathered_params(): sd = ddp.state_dict()`` (and ``ddp.module.state_dict()``,
    ``p.detach()`` of each param), each read, saved and loaded after the block, against torch
    DDP's state dict after the same steps; the params themselves, read after the block; how
    many storages were left to views, before the block (a training step leaves none) and after."""
    (torch_ddp, _), (ddp, _) = _pair(mode)
    reference = _cloned(torch_ddp.state_dict())
    reference_params = {n: p.detach().clone() for n, p in torch_ddp.named_parameters()}
    left_by_training = _left_to_views(ddp)
    with ddp.gathered_params():
        state = ddp.state_dict()
        module_state = ddp.module.state_dict()
        kept = {n: p.detach() for n, p in ddp.named_parameters()}
        named = dict(ddp.named_parameters())
    out = {
        "state": _difference(state, reference),
        "module_state": _difference({f"module.{k}": v for k, v in module_state.items()},
                                    reference),
        "kept": _difference(kept, reference_params),
        "left_by_training": left_by_training,
        "left_by_block": _left_to_views(ddp) - left_by_training,
    }
    # Save and load only what has bytes: torch.save of a freed view writes a storage of none.
    out["saved"] = _difference(_saved_and_loaded(state), reference)
    try:
        read = {n: p.detach().clone() for n, p in named.items()}
        out["params"] = _difference(read, reference_params)
    except RuntimeError as error:  # sharded params between uses: refused by name
        out["params"] = str(error).splitlines()[0]
    return out


def views_kept_from_a_forward(mode: str) -> dict:
    """A forward pre-hook that keeps ``module.weight.detach()`` of the first layer in a third
    training step, read after the step: torch's view follows its param, so it holds the
    updated weight; distopt's holds it too where params are always whole, and with sharded
    params the weight as that forward read it (the storage left to it)."""
    pairs = _pair(mode)
    kept: dict[str, torch.Tensor] = {}
    for kind, (ddp, opt) in zip(("torch", "distopt"), pairs, strict=True):
        def keep(module: nn.Module, _args: tuple, kind: str = kind) -> None:
            kept[kind] = module.weight.detach()
            kept[f"{kind}-then"] = module.weight.detach().clone()
        inner = ddp.module
        handle = inner[0].register_forward_pre_hook(keep)
        _train(ddp, opt, range(STEPS, STEPS + 1))
        handle.remove()
    ddp = pairs[1][0]
    sharded = ddp.options.shard_params
    if not sharded:
        ddp.finish_param_sync()
    expected = kept["torch-then"] if sharded else kept["torch"]
    return {"sharded": sharded, "left": _left_to_views(ddp),
            "view": _difference({"w": kept["distopt"]}, {"w": expected}),
            "moved": (kept["torch"] - kept["torch-then"]).abs().max().item()}


def full_state_dicts_are_copies(mode: str) -> dict:
    """``ddp.full_state_dict()`` and torch's ``get_model_state_dict(ddp,
    full_state_dict=True)`` against torch DDP's state dict after the same steps, then read,
    saved and loaded after a further training step: the full state dict and the params of
    torch's against what they were."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    (torch_ddp, torch_opt), (ddp, opt) = _pair(mode)
    reference = _cloned(torch_ddp.state_dict())
    left = _left_to_views(ddp)
    full = ddp.full_state_dict()
    dcp = get_model_state_dict(ddp, options=StateDictOptions(full_state_dict=True))
    left_by_full = _left_to_views(ddp) - left
    at_call = {"full": _cloned(full), "dcp": _cloned(dcp)}
    out = {"full": _difference({f"module.{k}": v for k, v in full.items()}, reference),
           "dcp": _difference({f"module.{k}": v for k, v in dcp.items()}, reference),
           "left_by_full": left_by_full}
    _train(ddp, opt, range(STEPS, STEPS + 1))
    _train(torch_ddp, torch_opt, range(STEPS, STEPS + 1))
    out["full_after"] = _difference(full, at_call["full"])
    # torch's function gives the module's buffers themselves (as torch's does over its DDP):
    # they move with the step; the params are the optimizer's masters, gathered: copies.
    params = [n.removeprefix("module.") for n, _ in torch_ddp.named_parameters()]
    out["dcp_after"] = _difference({k: dcp[k] for k in params},
                                   {k: at_call["dcp"][k] for k in params})
    out["full_saved"] = _difference(_saved_and_loaded(full), at_call["full"])
    out["dcp_saved"] = _difference(_saved_and_loaded(dcp), _cloned(dcp))
    return out


def _cases() -> list:
    return [case for mode in MODES for case in (
        (f"block-{mode}", state_dict_after_the_block, (mode,)),
        (f"forward-{mode}", views_kept_from_a_forward, (mode,)),
        (f"full-{mode}", full_state_dicts_are_copies, (mode,)),
    )]


two, three, both = pools_at_two_and_three(_cases)


def _close(value: float | str) -> bool:
    return not isinstance(value, str) and value <= TRAJECTORY_TOL


@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_dict_taken_in_the_block_reads_and_saves_torch_ddps_values_after_it(both,
                                                                                   mode):
    for v in case_result(both, f"block-{mode}"):
        for what in ("state", "module_state", "kept", "saved"):
            assert _close(v[what]), (what, v[what])
        assert v["left_by_training"] == 0, v  # a training step leaves no storage behind
        if MODES[mode][0] == "params":
            assert v["left_by_block"] >= 1, v  # the state dict's storage, left to it
            assert "between its uses" in v["params"], v["params"]  # the param itself: refused
        else:
            assert v["left_by_block"] == 0 and _close(v["params"]), v


@pytest.mark.parametrize("mode", list(MODES))
def test_a_view_kept_from_a_forward_reads_after_the_step(both, mode):
    for v in case_result(both, f"forward-{mode}"):
        assert v["moved"] > 100 * TRAJECTORY_TOL, v  # the step moved the weight: the two differ
        assert _close(v["view"]), v
        assert v["left"] == (1 if v["sharded"] else 0), v  # the view's bucket, and no other


@pytest.mark.parametrize("mode", list(MODES))
def test_full_state_dicts_are_torch_ddps_values_and_stay_after_a_step(both, mode):
    for v in case_result(both, f"full-{mode}"):
        for what in ("full", "dcp", "full_after", "dcp_after", "full_saved", "dcp_saved"):
            assert _close(v[what]), (what, v[what])
        assert v["left_by_full"] == 0, v  # copies: no gathered storage kept for them
