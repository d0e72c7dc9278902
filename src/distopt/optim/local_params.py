"""The params of torch DDP's ignore list, stepped by the one optimizer on each rank.

[Note: ignored params stepped locally]
torch DDP's ignore list (``_set_params_and_buffers_to_ignore_for_model``) leaves those params
out of the reductions: each rank keeps its own copy and its own local ``p.grad``, and the one
torch optimizer over ``ddp.parameters()`` steps each rank's copy with that rank's grad. distopt's
DDP leaves them out of its buffers alike ([Note: torch DDP's spellings] in
ddp/torch_compat/torch_spellings.py), so its optimizer steps them beside its main params, as torch's
would: one inner torch optimizer per class over them (the classes and options of the param groups
that hold them, which follow the groups' options, ``lr`` set by a scheduler included, at each
step), stepping the param itself with its plain ``p.grad``; no communication, and a param
whose ``p.grad`` is None is skipped as torch.optim skips it. ``opt.zero_grad()`` zeroes their
grads as torch.optim's does.

Around the step they are treated as the DDP's grads where that is element-wise: unscaled by
the loss scale (an inf or nan in them skips the step on every rank, as the verdict is agreed),
clamped by ``clip_grad_value``, and multiplied by the ``clip_grad`` coefficient. The global norm
that coefficient comes from counts the DDP's reduced grads only: torch's
``clip_grad_norm_(ddp.parameters())`` counts each rank's own ignored grads, which gives each
rank its own coefficient and lets the replicas of the DDP's params drift apart (and a sharded
optimizer's shards would be clipped by different coefficients); distopt keeps one coefficient
on every rank. ``state_dtype`` and ``offload_dir`` apply to the DDP's params only: the state
of the ignored params is torch's own, in memory.

Their state differs by rank, so it is saved where a format holds one rank's values: a sharded
optimizer's ``opt.state_dict()`` (each rank's part, marked with its rank) carries it under
``"local_state"``, by the module's param names, and its ``load_state_dict`` puts it back. The
forms that load on other ranks or at another size (the whole ``state_dict()`` of a replicated
optimizer, ``consolidate_state_dict``, ``sharded_state_dict``, ``distopt.save_checkpoint``,
torch's DCP state dicts, plain checkpoints and the heal state of fault-tolerant replicas)
refuse an optimizer with ignored params by name, at save and at load, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .param_groups import NAMES_KEY, OptimizerClass, build_inner_optimizers

LOCAL_STATE_KEY = "local_state"
"""The key of a rank's part of the state dict that holds the ignored params' state."""


class LocalParams:
    """The ignored params of each param group and the inner torch optimizers that step them;
    see [Note: ignored params stepped locally]."""

    def __init__(self, per_group: Sequence[list[nn.Parameter]],
                 param_groups: Sequence[dict[str, Any]],
                 group_classes: Sequence[OptimizerClass], optimizer_cls: OptimizerClass,
                 optimizer_kwargs: dict[str, Any], device: torch.device,
                 names: dict[nn.Parameter, str]) -> None:
        self.names = names
        self.params = [p for params in per_group for p in params]
        self._indices = [i for i, params in enumerate(per_group) if params]
        groups = [{**_options(param_groups[i]), "params": list(per_group[i])}
                  for i in self._indices]
        self.groups = groups
        self.optimizers, _ = build_inner_optimizers(
            groups, [group_classes[i] for i in self._indices], optimizer_cls,
            optimizer_kwargs, device)
        self._by_name = {names[p]: p for p in self.params}

    def grads(self) -> list[torch.Tensor]:
        """Their local grads, where set."""
        return [p.grad for p in self.params if p.grad is not None]

    def step(self, inner_groups: Sequence[dict[str, Any]]) -> None:
        """Step each rank's copy with its own grad, with the options of the groups they were
        given in (``inner_groups``: the optimizer's ``param_groups``, whose options a scheduler
        may have changed)."""
        for index, group in zip(self._indices, self.groups, strict=True):
            group.update(_options(inner_groups[index]))
        for inner in self.optimizers:
            inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for inner in self.optimizers:
            inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's state of each ignored param, by name (copies)."""
        out = {}
        for inner in self.optimizers:
            for param, entries in inner.state.items():
                out[self.names[param]] = {k: v.detach().clone() if isinstance(v, torch.Tensor)
                                          else v for k, v in entries.items()}
        return out

    def check_loadable(self, saved: Any) -> None:
        """Raise ``KeyError`` where ``saved`` names params this rank does not step."""
        if not isinstance(saved, dict):
            raise KeyError(f"no state of the ignored params ({', '.join(self._by_name)}) "
                           f"under {LOCAL_STATE_KEY!r}")
        unknown = sorted(set(saved) - set(self._by_name))
        if unknown:
            raise KeyError(f"state of {', '.join(unknown)}, which are not ignored params of "
                           "this optimizer")

    def load_state_dict(self, saved: dict[str, dict[str, Any]]) -> None:
        """Put ``state_dict()`` of this rank back."""
        for inner in self.optimizers:
            inner.state.clear()
            for group in inner.param_groups:
                for param in group["params"]:
                    entries = saved.get(self.names[param])
                    if entries is not None:
                        inner.state[param] = {
                            k: v.detach().clone().to(param.device) if isinstance(
                                v, torch.Tensor) and v.dim() > 0 else
                            (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in entries.items()}


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", NAMES_KEY)}
