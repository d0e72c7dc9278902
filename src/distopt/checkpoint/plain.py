"""Come back to distopt: start a run from a plain PyTorch checkpoint (what export.py writes, or
``{"model": model.state_dict(), "optimizer": opt.state_dict()}`` of a plain torch run)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..ddp.params.whole_module import module_entries
from ..optim.remainders import bf16_of_fp32
from .checks import Models, check_pair, check_same_model
from .files import CheckpointError
from .format import (
    Optimizer,
    OwnedPiece,
    check_loaded_state,
    class_path,
    describe,
    group_class_paths,
    hyper_params,
    loaded_entry,
    model_prefixes,
    owned_pieces,
    piece_of,
)
from .install import install_values


def load_plain_checkpoint(source: str | os.PathLike | dict[str, Any], ddp: Models,
                          opt: Optimizer) -> Any:
    """Start a distopt run from ``{"model": state_dict, "optimizer": torch_optimizer_state}``.

    Checks everything before changing anything; needs no communication. Returns
    ``source["extra"]`` (None without one).

    Args:
        source: such a dict, or a file torch.save wrote (``export_checkpoint``'s, or a plain
            torch run's), read with mmap: each rank touches only the elements it owns. The
            optimizer state is that of ``torch.optim.<Class>`` over ``model.parameters()`` (or
            over the same param groups as this optimizer's); for groups of several classes,
            ``"optimizers"`` holds one state per class, as ``export_checkpoint`` writes it.
        ddp: the model to load into, the one the optimizer was built over: its
            DistributedDataParallel (or the wrapped module), or the list of model chunks,
            whose ``"model"`` entry is then a list of state dicts, one per chunk.
        opt: the ``DistributedOptimizer`` or ``BasicOptimizer`` to load into, with the saved
            state's param groups; each rank installs the main params and state of the elements
            it owns, and the groups' options are taken from the file.
    """
    check_pair(ddp, opt)
    if isinstance(source, dict):
        ckpt = source
    else:
        try:
            ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"cannot read {source} with torch.load: {exc}") from None
    values, options = _plan(ckpt, opt)
    with torch.no_grad():
        for model, sd in zip(opt.models, _model_dicts(ckpt), strict=True):
            model.finish_param_sync()
            model.module.load_state_dict(sd)
            if opt.options.store_param_remainders:
                _round_as_split(model, sd)
    install_values(opt, values, options, ckpt.get("loss_scaler"))
    return ckpt.get("extra")


def _round_as_split(model: Any, sd: dict[str, Any]) -> None:
    """With store_param_remainders, make every element of the trainable params the bf16 half
    of the split of its fp32 master, as the owner's split will leave its own shard: each rank
    rounds the whole file alike, so all ranks agree without communicating. (load_state_dict
    rounded ties to even; see [Note: param remainders] in distopt/optimizer.py.)"""
    trainable = set(model.params)
    for name, param in model.module.named_parameters():  # tied params: the first name
        if param in trainable:
            param.detach().copy_(bf16_of_fp32(sd[name].float().reshape(param.shape)))


def _model_dicts(ckpt: dict[str, Any]) -> list[dict[str, Any]]:
    return ckpt["model"] if isinstance(ckpt["model"], list) else [ckpt["model"]]


def _plan(ckpt: Any, opt: Optimizer
          ) -> tuple[list[tuple[OwnedPiece, torch.Tensor, dict[str, Any]]], list[dict[str, Any]]]:
    """Check the file against the model and optimizer; return each owned piece's main values
    and state entries, and the file's param-group options."""
    if not (isinstance(ckpt, dict) and "model" in ckpt
            and ("optimizer" in ckpt or "optimizers" in ckpt)):
        raise CheckpointError(
            "a plain checkpoint is a dict with 'model' (the module's state_dict) and "
            "'optimizer' (the torch optimizer's state_dict), or 'optimizers' (one per class, "
            "keyed by class path, for param groups of several classes)"
        )
    sds = _model_dicts(ckpt)
    if len(sds) != len(opt.models):
        raise CheckpointError(f"the file has {len(sds)} model state dicts, the optimizer "
                              f"{len(opt.models)} models")
    all_names, trainable_names, model_values = [], [], {}
    for prefix, model, sd in zip(model_prefixes(opt), opt.models, sds, strict=True):
        check_same_model({k: describe(v)[0] for k, v in sd.items()},
                         {k: describe(v)[0] for k, v in module_entries(model.module).items()},
                         "state_dict entries", "the plain checkpoint")
        for n, p in model.module.named_parameters():
            all_names.append(prefix + n)
            if p.requires_grad:
                trainable_names.append(prefix + n)
            model_values[prefix + n] = sd[n]

    group_names = [group["params"] for group in hyper_params(opt)]
    options: list[dict[str, Any]] = [{} for _ in group_names]
    plain_state: dict[str, dict[str, Any]] = {}
    for osd, indices in _torch_states(ckpt, group_class_paths(opt)):
        plain_groups = osd.get("param_groups") if isinstance(osd, dict) else None
        if not isinstance(plain_groups, list) or not isinstance(osd.get("state"), dict):
            raise CheckpointError(
                "'optimizer' must be a torch.optim state_dict (state, param_groups)")
        # torch numbers params by their position in the param groups, in order.
        if opt.default_param_groups and len(plain_groups) == 1:
            size = len(plain_groups[0]["params"])
            if size not in (len(all_names), len(trainable_names)):
                raise CheckpointError(
                    f"the optimizer state has {size} params, the model {len(all_names)} "
                    f"({len(trainable_names)} trainable)"
                )
            orders = [all_names if size == len(all_names) else trainable_names]
        else:
            orders = [group_names[i] for i in indices]
            sizes = [len(g["params"]) for g in plain_groups]
            if sizes != [len(o) for o in orders]:
                raise CheckpointError(
                    f"the optimizer state's param groups hold {sizes} params, this optimizer's "
                    f"{[len(o) for o in orders]}: build it with the same param groups"
                )
        name_of = {}
        for index, group, names in zip(indices, plain_groups, orders, strict=True):
            name_of.update(zip(group["params"], names, strict=True))
            options[index] = group
        plain_state.update((name_of[pid], entries) for pid, entries in osd["state"].items()
                           if pid in name_of)

    check_loaded_state(opt, plain_state)
    values = []
    for owned in owned_pieces(opt):
        main = piece_of(model_values[owned.name], owned, "model value").float()
        entries = {key: loaded_entry(value, owned, key)
                   for key, value in plain_state.get(owned.name, {}).items()}
        values.append((owned, main, entries))
    return values, options


def _torch_states(ckpt: dict[str, Any], classes: list[str]
                  ) -> list[tuple[Any, list[int]]]:
    """Each torch optimizer state of the file with the indices of the param groups it holds:
    one state over every group, or under "optimizers" one per class over that class's groups
    (as export writes for a run of several classes)."""
    used = list(dict.fromkeys(classes))
    if "optimizers" not in ckpt:
        if len(used) > 1:
            raise CheckpointError(
                f"the file holds one torch optimizer state ('optimizer'), but this optimizer "
                f"steps its param groups with {len(used)} classes ({', '.join(used)}): pass "
                "one state per class under 'optimizers', keyed by class path (what distopt "
                "export writes for such a run)"
            )
        return [(ckpt["optimizer"], list(range(len(classes))))]
    states = ckpt["optimizers"]
    if isinstance(states, dict):  # keyed by class path, or in memory by the class itself
        states = {class_path(k) if isinstance(k, type) else k: v for k, v in states.items()}
    if not isinstance(states, dict) or set(states) != set(used):
        held = list(states) if isinstance(states, dict) else type(states).__name__
        raise CheckpointError(
            f"the file holds torch optimizer states of {held}, this optimizer steps its param "
            f"groups with {used}: build it with the classes of the run that wrote the "
            'file (a group\'s "optimizer" key)'
        )
    return [(states[cls], [i for i, c in enumerate(classes) if c == cls]) for cls in used]
