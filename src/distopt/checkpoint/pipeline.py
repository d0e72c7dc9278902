"""Checkpoints of pipelined models: one checkpoint of the whole model, every stage writing its
part, loadable at another pipeline layout or none.

[Note: pipeline checkpoints]
A pipeline stage's module keeps the names its params have in the whole model (torchtitan's
rule: a stage is the whole model with the other stages' layers left out), and distopt's
checkpoints are keyed by name and flat offset ([Note: DP-size independent state] in
format.py). So a pipelined run saves one checkpoint of the whole model: the save is collective
over every rank, each rank writes the pieces it owns of its stages' params under their own
names, with no ``chunk{i}.`` prefix (the names are unique across the stages, and checked to be),
and a param tied across stages is written once, by the stage that counts it ([Note: tied stage
params] in optim/tied.py), under the tie's name, which is the whole model's. The manifest
describes the whole model as one model: the union of every stage's trainable params (by
distopt's names), of their modules' ``state_dict`` entries and of each param group's params,
gathered over the pipeline group; an unpipelined run describes itself the same way. A load
compares that union with this run's, gathered the same way, and each rank then reads the saved
chunks that overlap its own pieces, whatever pipeline and DP layout wrote them: a checkpoint
saved at (pp, dp) = (2, 2) loads at (2, 1), at (4, 1), and into the unpipelined model at any DP
size, and back. A pipelined run needs a mesh over every rank (the pipeline group times the DP
and TP groups is the world).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm import collectives as comm
from ..ddp.params.whole_module import module_entries
from .files import CheckpointError
from .format import (
    Optimizer,
    describe,
    hyper_params,
    param_names,
    whole_names,
)


def pipelined(opt: Optimizer) -> bool:
    """Whether ``opt``'s models are pipeline stages (their mesh has a "pp" dimension)."""
    return opt.parallel.pp_group is not None


@dataclass(frozen=True, slots=True)
class WholeModel:
    """The whole model as every rank of a pipeline sees it: the union over its stages."""

    parameters: list[list[Any]]  # [name, shape, requires_grad] by distopt's names
    state_dict: list[list[Any]]  # [key, shape, dtype] of the modules' state_dict entries
    param_groups: list[list[str]]  # each group's param names
    whole: frozenset[str]  # the params whole-tensor optimizers own whole
    stages: list[list[str]]  # each pipeline rank's trainable params, by distopt's names
    entry_stages: dict[str, int]  # each state_dict entry: the lowest pipeline rank holding it

    def manifest_models(self) -> list[dict[str, Any]]:
        """What the manifest lists under "models": one model, without prefix."""
        return [{"prefix": "", "parameters": self.parameters, "state_dict": self.state_dict}]

    def structure(self) -> dict[str, Any]:
        """What the manifest lists under "pipeline": each pipeline rank's params (its stages'),
        and the params tied across ranks, which each holder loads and the lowest writes."""
        held: dict[str, int] = {}
        for names in self.stages:
            for name in set(names):
                held[name] = held.get(name, 0) + 1
        return {"stages": self.stages, "tied": sorted(n for n, k in held.items() if k > 1)}


def whole_model(opt: Optimizer) -> WholeModel:
    """The union of the stages' models; collective over the pipeline group."""
    names = param_names(opt)
    mine: dict[str, Any] = {"parameters": [], "state_dict": [], "groups": [], "whole": [],
                            "entries": []}
    for model in opt.models:
        # Experts by their global names, every EP rank's ([Note: expert checkpoints] in
        # format.py); a tie by its name.
        experts = model.experts

        def spread(items: list[tuple[str, Any]], experts: Any = experts) -> list[tuple[str, Any]]:
            return items if experts is None else experts.everywhere(items)

        for name, p in spread(list(model.module.named_parameters())):
            if experts is None or not experts.is_expert_entry(name):
                name = names.get(p, name)
            mine["parameters"].append([name, list(p.shape), p.requires_grad])
        entries = spread(list(module_entries(model.module).items()))
        mine["state_dict"] += [[k, *describe(v)] for k, v in entries]
        mine["entries"] += [k for k, _ in entries]
    mine["stage"] = [name for name, _, requires_grad in mine["parameters"] if requires_grad]
    mine["groups"] = [group["params"] for group in hyper_params(opt)]
    mine["whole"] = sorted(whole_names(opt))
    every = comm.all_gather_object(mine, opt.parallel.pp_group)
    return _union(every, [sorted(set(n for part in every for n in part["groups"][i]))
                          for i in range(_group_count(every))])


def _group_count(every: list[dict[str, Any]]) -> int:
    counts = {len(part["groups"]) for part in every}
    if len(counts) > 1:
        raise CheckpointError(
            f"the pipeline stages' optimizers have {sorted(counts)} param groups: build every "
            "stage's optimizer with the same param groups (in the same order), so that group i "
            "of the whole model is the union of every stage's group i"
        )
    return counts.pop()


def _union(every: list[dict[str, Any]], groups: list[list[str]]) -> WholeModel:
    parameters: dict[str, list[Any]] = {}
    state_dict: dict[str, list[Any]] = {}
    for stage, part in enumerate(every):
        for name, shape, requires_grad in part["parameters"]:
            known = parameters.setdefault(name, [name, shape, requires_grad])
            if known[1] != shape:
                raise CheckpointError(
                    f"parameter '{name}' is of shape {tuple(known[1])} on one pipeline stage "
                    f"and {tuple(shape)} on pipeline rank {stage}: the stages of one model name "
                    "each of its params once (as the whole model does), and tied params alike"
                )
        for key, shape, dtype in part["state_dict"]:
            state_dict.setdefault(key, [key, shape, dtype])
    whole = frozenset(n for part in every for n in part["whole"])
    entry_stages: dict[str, int] = {}
    for stage, part in enumerate(every):
        for name in part["entries"]:
            entry_stages.setdefault(name, stage)
    return WholeModel(list(parameters.values()), list(state_dict.values()), groups, whole,
                      [part["stage"] for part in every], entry_stages)


def check_unique_names(opt: Optimizer) -> None:
    """The chunks of one rank must not share a name: they are saved without prefixes."""
    seen: dict[str, int] = {}
    for index, model in enumerate(opt.models):
        for p in model.params:
            name = model.param_names[p]
            if seen.setdefault(name, index) != index:
                raise CheckpointError(
                    f"parameter name '{name}' is in model chunks {seen[name]} and {index}: "
                    "pipeline stages keep the names their params have in the whole model, which "
                    "are unique; build each stage from the whole model, leaving the other "
                    "stages' layers out"
                )


def checkpoint_group(opt: Optimizer) -> dist.ProcessGroup:
    """Every rank: a pipelined checkpoint is one checkpoint of the whole model."""
    parallel = opt.parallel
    size = parallel.pp_size * parallel.dp_size * parallel.replicate_size * parallel.tp_size
    if size != dist.get_world_size():
        raise CheckpointError(
            f"checkpoints of a pipelined model are collective over every rank, but its mesh "
            f"(pipeline x data-parallel x tensor-parallel: {size} ranks) is not the world "
            f"({dist.get_world_size()} ranks): build the mesh over every rank"
        )
    return dist.group.WORLD
