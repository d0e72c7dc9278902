"""torch's flat optimizer layout (``StateDictOptions(flatten_optimizer_state_dict=True)``) over
distopt: what torchtitan's checkpointer saves and loads.

[Note: torch's flat optimizer layout]
With ``flatten_optimizer_state_dict=True`` torch's ``get_optimizer_state_dict`` gives one flat
dict instead of ``{"state", "param_groups"}``: each state value under
``state.{fqn}.{name}`` (nested dicts one dotted level each) and each group option under
``param_groups.{fqn}.{option}``, repeated for every param of the group. Keys that name params
make the dict mergeable with other optimizers' (torchtitan merges the dicts of its model chunks'
optimizers into one, beside the model's entries) and resharding-proof, since DCP matches keys.

distopt gives the nested layout of torch_layout.py and flattens it here, so the values are the
same boxes of this rank's flat shards. A load takes the flat dict whatever the option says, as
torch does (a dict without ``"state"`` is flat), and rebuilds the nested layout the way torch's
``_unflatten_optim_state_dict`` does: each of this optimizer's param groups takes its params'
FQNs in its own order and its options from the first param's keys (every param of a group must
hold the same options), each param its ``state.{fqn}.*`` entries. Keys of params this model lacks
are ignored (another model chunk's, in a merged dict), as torch ignores them.
"""

from __future__ import annotations

from typing import Any

import torch

from .files import CheckpointError

STATE, GROUPS = "state", "param_groups"


def flatten(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` (torch's nested layout, FQN-keyed) in torch's flat layout."""
    out: dict[str, Any] = {}

    def put(prefix: str, entries: dict[Any, Any]) -> None:
        for key, value in entries.items():
            if isinstance(value, dict):
                put(f"{prefix}.{key}", value)
            else:
                out[f"{prefix}.{key}"] = value

    for fqn, entries in osd[STATE].items():
        put(f"{STATE}.{fqn}", entries)
    for group in osd[GROUPS]:
        for fqn in group["params"]:
            for key, value in group.items():
                if key != "params":
                    out[f"{GROUPS}.{fqn}.{key}"] = value
    return out


def is_flat(osd: Any) -> bool:
    """Whether ``osd`` is in the flat layout, by torch's rule: a dict without ``"state"``."""
    return isinstance(osd, dict) and STATE not in osd


def unflatten(flat: dict[str, Any], groups: list[list[str]], options: list[list[str]]
              ) -> dict[str, Any]:
    """The nested layout of ``flat`` for an optimizer whose param groups hold the FQNs
    ``groups`` and the options ``options`` (each group's option names); see [Note: torch's
    flat optimizer layout]."""
    state: dict[str, dict[str, Any]] = {}
    fqns = {fqn for group in groups for fqn in group}
    for key, value in flat.items():
        if not key.startswith(f"{STATE}."):
            continue
        fqn, name = _split(key.removeprefix(f"{STATE}."), fqns)
        if fqn is not None:
            state.setdefault(fqn, {})[name] = value  # distopt's state names are flat
    out_groups = []
    for group, names in zip(groups, options, strict=True):
        out: dict[str, Any] = {"params": list(group)}
        for name in names:
            values = [(fqn, flat[f"{GROUPS}.{fqn}.{name}"]) for fqn in group
                      if f"{GROUPS}.{fqn}.{name}" in flat]
            if len(values) < len(group):
                lacking = next(f for f in group if f"{GROUPS}.{f}.{name}" not in flat)
                raise CheckpointError(f"the flat optimizer state dict has no "
                                      f"'{GROUPS}.{lacking}.{name}'")
            first_fqn, first = values[0]
            for fqn, value in values[1:]:
                if not _same(value, first):
                    raise CheckpointError(
                        f"params of one param group hold different '{name}': {first!r} for "
                        f"'{first_fqn}', {value!r} for '{fqn}'; every param of a group must "
                        "hold its group's options")
            out[name] = first
        out_groups.append(out)
    return {STATE: state, GROUPS: out_groups}


def _split(rest: str, fqns: set[str]) -> tuple[str | None, str]:
    """``rest`` (``{fqn}.{name}``) as the FQN among ``fqns`` it starts with and the name; an
    FQN ends at a dot, and no FQN of a param is another's prefix up to a dot (a param has no
    children), so at most one matches."""
    at = rest.find(".")
    while at != -1:
        if rest[:at] in fqns:
            return rest[:at], rest[at + 1 :]
        at = rest.find(".", at + 1)
    return None, rest


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False
