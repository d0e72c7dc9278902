"""A sharded param between its uses: metadata reads pass, value reads raise, naming the param.

[Note: reads between uses]
With sharded params a param holds its values only while a module that registers it runs (or
inside ``ddp.gathered_params()``); between uses it is a placeholder, one NaN element seen
through its shape ([Note: sharded params] in ddp/param_storage.py). Code that reads it then
would compute with NaN: an EMA over ``model.parameters()``, captured before wrapping or not,
``torch.save(p)``, ``p.clone()``, a branch of a later forward that reads another module's param
where the first forward did not. torch DDP users write these, and a NaN found days later, in
an averaged model or a saved file, loses their work.

So while a param is a placeholder its class is ``ParamBetweenUses``, an ``nn.Parameter`` whose
``__torch_function__`` lets through what reads only the param's metadata (shape, dtype,
device, ``requires_grad``, ``.grad``, hooks, assigning ``.data``, a ``.to()`` that changes
nothing, the ``*_like`` factories) and raises on everything else, naming the param and the
ways to read it whole. The class is swapped back to ``nn.Parameter`` when the param is
gathered, so a forward pays nothing for it; the object itself never changes, so references
taken before wrapping see the same refusal. Params that are DTensors (tensor parallelism) keep
their class and the NaN placeholder alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

# Property reads that return values (views of the placeholder); every other property passes.
_VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Methods that read metadata only, or make a tensor of the param's shape without reading it.
_METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
    "element_size", "is_floating_point", "is_complex", "is_contiguous", "get_device",
    "data_ptr", "untyped_storage", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "_has_compatible_shallow_copy_type",
    "__hash__", "__len__", "empty_like", "zeros_like", "ones_like", "full_like",
})
# Conversions that are fine when they change nothing (they return the param itself).
_NO_OP_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16",
                                "type", "contiguous"})

_names: dict[int, str] = {}  # id(param) -> its name in the wrapped model, for the refusal


def name_params(names: dict[nn.Parameter, str]) -> None:
    """Record the names the refusal gives these params."""
    _names.update((id(param), name) for param, name in names.items())


def name_of(param: nn.Parameter) -> str:
    """The name ``name_params`` recorded for ``param`` in its wrapped model."""
    return _names.get(id(param), "?")


def show_between_uses(param: nn.Parameter) -> None:
    """The param is a placeholder now: value reads raise. See [Note: reads between uses]."""
    if type(param) is nn.Parameter:
        param.__class__ = ParamBetweenUses


def show_in_use(param: nn.Parameter) -> None:
    """The param holds its values again: a plain ``nn.Parameter``."""
    if type(param) is ParamBetweenUses:
        param.__class__ = nn.Parameter


def is_between_uses(param: torch.Tensor) -> bool:
    """Whether ``param`` is a sharded param's placeholder now (its values are not here)."""
    return type(param) is ParamBetweenUses


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property: name it by the property's own name
        return f"{func.__self__.__name__}.{name}"
    return name


class ParamBetweenUses(nn.Parameter):
    """A sharded param between its uses; see [Note: reads between uses]."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _func_name(func)
        prop, _, access = name.rpartition(".")
        passes = ((access == "__set__") or (access == "__get__"
                                             and prop not in _VALUE_PROPERTIES)
                  or name in _METADATA_METHODS)
        if passes or name in _NO_OP_CONVERSIONS:
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if passes or out is args[0]:
                return out
        if name in ("__repr__", "__format__"):  # printing a param names it, reads nothing
            param = args[0]
            return (f"ParamBetweenUses({_names.get(id(param), 'a sharded parameter')}, "
                    f"shape={tuple(param.shape)}, dtype={param.dtype}: between uses)")
        param = next(a for a in (*args, *kwargs.values()) if type(a) is ParamBetweenUses)
        raise RuntimeError(
            f"parameter '{_names.get(id(param), '?')}' (shape {tuple(param.shape)}) of a "
            f"module wrapped with shard_params=True was read by {name} between its uses, "
            f"where each rank holds only its shard and the parameter is a placeholder. Read "
            f"it inside 'with ddp.gathered_params():' on every rank (an EMA: "
            f"ema.update_parameters(model) there), or take every parameter whole with "
            f"ddp.full_state_dict(); inside a forward, a module that reads another module's "
            f"parameter must do so in the first forward too, where distopt finds such reads"
        )
