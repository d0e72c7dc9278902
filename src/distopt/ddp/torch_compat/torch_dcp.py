"""torch's DCP state-dict functions, taught distopt's models and optimizers.

[Note: torch's DCP state dicts]
``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict`` and their
model and optimizer forms) is how torchtitan, and any FSDP2 or torch DDP script that
checkpoints with ``torch.distributed.checkpoint``, saves and loads. Its output is a layout
every torch system shares: keys are the model's FQNs, each param's optimizer state has the
param's shape and torch's names, ``param_groups`` list FQNs. So ``dcp.save`` of one system's
state dicts loads into another's, at any data-parallel size.

torch's functions read a ``torch.optim`` optimizer param by param, and a distopt optimizer
holds its state in shards of flat buffers over fp32 main params. So distopt answers them
itself: every public function first calls ``_verify_options``, then the private functions
that get and load (``_get_model_state_dict``, ``_get_optim_state_dict``,
``_load_model_state_dict``, ``_load_optim_state_dict``, ``_verify_state_dict``), each looked
up in torch's module when it runs. ``install`` wraps them: where the model is a distopt DDP
(or the module one wraps) or an optimizer is distopt's, ``_verify_options`` returns a
``DistoptCall`` instead of torch's info, and the others hand a ``DistoptCall`` to the
functions of checkpoint/torch_layout.py, which build and load torch's layout from distopt's
shards ([Note: torch's layout from flat shards] there). Anything else is torch's, untouched.
Scripts that imported torch's functions before distopt are served too, since the functions
look their helpers up at call time. What distopt cannot serve is refused in
``_verify_options``, on every rank alike, before any collective.

Installed when a DDP is built (importing torch's module takes half a second, once per
process); the checkpoint layer, above this one, hands its functions down when it is imported
(``use_handlers``), as it does for ``opt.state_dict()`` ([Note: one-way imports] in
checkpoint/__init__.py), and the optimizers register their class (``register_optimizer``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .. import param_owners

_HANDLERS: dict[str, Callable[..., Any]] = {}
_OPTIMIZER_CLASSES: list[type] = []
# DDP -> weakref to the distopt optimizer that steps it, for a model's state dict asked for
# without its optimizer (``get_model_state_dict(ddp)``): its entries are the fp32 masters.
_STEPPED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_handlers(**handlers: Callable[..., Any]) -> None:
    """The checkpoint layer's functions: ``get_model``, ``get_optim``, ``load_model``,
    ``load_optim`` and ``check`` (each taking a ``DistoptCall`` first)."""
    _HANDLERS.update(handlers)


def register_optimizer(optimizer: Any) -> None:
    """Count instances of ``optimizer``'s class as distopt optimizers, and know it as the one
    that steps its models (the latest built wins, as it holds their buffers' layout)."""
    if type(optimizer) not in _OPTIMIZER_CLASSES:
        _OPTIMIZER_CLASSES.append(type(optimizer))
    for model in optimizer.models:
        _STEPPED_BY[model] = weakref.ref(optimizer)


def optimizer_of(ddp: Any) -> Any | None:
    """The live distopt optimizer built last over ``ddp``, or None."""
    ref = _STEPPED_BY.get(ddp)
    return None if ref is None else ref()


@dataclass
class DistoptCall:
    """What torch's ``_verify_options`` returns for a distopt model: the DDP, the distopt
    optimizer given (None for a model alone) and torch's ``StateDictOptions``."""

    ddp: Any
    optimizer: Any
    options: Any
    optim_only: bool


def _is_distopt_optimizer(optim: Any) -> bool:
    return isinstance(optim, tuple(_OPTIMIZER_CLASSES))


def _wrapper_of(model: nn.Module, ddp_class: type) -> Any | None:
    """The distopt DDP that ``model`` is, or that wraps ``model``; None for any other."""
    if isinstance(model, ddp_class):
        return model
    for param in model.parameters():
        owner = param_owners.owner_of(param)
        if owner is not None and owner.module is model:
            return owner
        break
    return None


def _resolve(model: nn.Module, optims: tuple[Any, ...], ddp_class: type, options: Any,
             optim_only: bool, submodules: Any) -> DistoptCall | None:
    """A ``DistoptCall`` where distopt serves the call, None where torch does; raises where
    neither can (the same on every rank: it reads nothing but the arguments)."""
    ddp = _wrapper_of(model, ddp_class)
    ours = [o for o in optims if _is_distopt_optimizer(o)]
    if ddp is None and not ours:
        return None
    if ddp is None:
        raise ValueError(
            "torch's DCP state-dict functions were given a distopt optimizer with a model that "
            f"is not a distopt DistributedDataParallel ({type(model).__name__}): pass the "
            "distopt.DistributedDataParallel the optimizer steps (or the module it wraps)")
    if len(ours) != len(optims) or len(ours) > 1:
        raise ValueError(
            "torch's DCP state-dict functions over a distopt model take one distopt optimizer "
            f"at a time (given {len(optims)} optimizer(s), {len(ours)} of them distopt's): "
            "call them once per model and its distopt.DistributedOptimizer")
    if submodules is not None:
        raise ValueError("submodules= (deprecated in torch) is not supported over a distopt "
                         "model: filter the returned state dict's keys instead")
    optimizer = ours[0] if ours else optimizer_of(ddp)
    if optimizer is not None and ddp not in optimizer.models:
        raise ValueError(
            "the distopt optimizer given to torch's DCP state-dict functions does not step "
            "the model given with it: pass the DDP it was built over")
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    call = DistoptCall(ddp, optimizer, options or StateDictOptions(), optim_only)
    _HANDLERS["check"](call)
    return call


def install(ddp_class: type) -> None:
    """Have torch's DCP state-dict functions serve distopt's models (idempotent); see
    [Note: torch's DCP state dicts]."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    if getattr(torch_state_dict, "_distopt_installed", False):
        return
    verify = torch_state_dict._verify_options

    @functools.wraps(verify)
    def _verify_options(model: nn.Module, optims: Any, *args: Any, **kwargs: Any) -> Any:
        call = _resolve(model, tuple(optims), ddp_class, kwargs.get("options"),
                        kwargs.get("optim_only", args[0] if args else False),
                        kwargs.get("submodules"))
        return verify(model, optims, *args, **kwargs) if call is None else call

    torch_state_dict._verify_options = _verify_options
    for name, handler, ours in (
        ("_get_model_state_dict", "get_model", lambda call, model: (call,)),
        ("_get_optim_state_dict", "get_optim", lambda call, model, optims: (call,)),
        ("_load_model_state_dict", "load_model", lambda call, model, sd: (call, sd)),
        ("_load_optim_state_dict", "load_optim", lambda call, model, optims, sd: (call, sd)),
        ("_verify_state_dict", None, None),
    ):
        setattr(torch_state_dict, name, _dispatching(getattr(torch_state_dict, name),
                                                     handler, ours))
    torch_state_dict._distopt_installed = True


def _dispatching(original: Callable[..., Any], handler: str | None,
                 arguments: Callable[..., tuple[Any, ...]] | None) -> Callable[..., Any]:
    """``original``, except that a call whose info is a ``DistoptCall`` goes to the handler
    (with the arguments ``arguments`` picks) or, without one, does nothing."""

    @functools.wraps(original)
    def dispatch(*args: Any) -> Any:
        call = next((a for a in args if isinstance(a, DistoptCall)), None)
        if call is None:
            return original(*args)
        if handler is None:
            return None
        info_at = args.index(call)
        return _HANDLERS[handler](*arguments(call, *args[:info_at]))

    return dispatch
