"""A sharded param between its uses: metadata reads pass, value reads raise, naming the param.

[Note: reads between uses]
With sharded params a param holds its values only while a module that registers it runs (or
inside ``ddp.gathered_params()``); between uses it is a placeholder, one NaN element seen
through its shape ([Note: sharded params] in ddp/buffers/param_storage.py). Code that reads it then
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

[Note: writes between uses]
An element-wise op in place on a param between uses has one meaning on shards: open_clip's
``model.logit_scale.clamp_(0, math.log(100))`` after every step, ``p.mul_(0.5)``,
``p.copy_(t)``, ``p.fill_(x)``, ``p.zero_()``, ``p += t``, as FSDP2 applies them to its shards.
Any op torch tags ``torch.Tag.pointwise`` (and ``zero_``, ``fill_``, ``copy_``), in place on
the param, its other operands scalars, the param itself or tensors of the param's shape (or
broadcasting to it), writes each element from that element alone; this rank's piece of the
param is a contiguous range of the flattened param inside its shard of the bucket
(``ShardedParams`` registers where), so the op on the piece with the same range of each operand
(expanded to the param's shape) writes exactly what torch's writes there, with no
communication. Every rank runs the same loop, so every rank writes its own piece. The write
lands in the rank's shard of the params, whose version counter the optimizer reads: the next
step takes it up into the fp32 masters (and zeroes the remainders with
``store_param_remainders``), as it takes up a write inside ``gathered_params()`` ([Note:
writes into the params] in optim/main_params.py). As torch, the write needs ``torch.no_grad()``
for a param that requires grad. An operand that is another param between uses, or one that
does not broadcast to the param's shape, or an op out of place, stays refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves, tree_map

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
# id(param) -> where this rank's piece of it lives: (a 1-D view of the rank's shard of the
# params, the piece's offset in the flattened param); see [Note: writes between uses].
# Keyed by id alone, as ``_names``: a weak reference to the param would forbid the tensor swaps
# that give a meta-device model its memory (ddp/params/materialize.py), and each wrapper
# records its own params' entries, so a reused id is always written over before it is read.
_pieces: dict[int, Callable[[], tuple[torch.Tensor, int]]] = {}
# Python's in-place operators, by the op they are.
_IN_PLACE_OPERATORS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_",
                       "__itruediv__": "div_", "__ifloordiv__": "floor_divide_",
                       "__ipow__": "pow_", "__imod__": "remainder_"}
# Element-wise though not tagged so: what they write into each element depends on it alone.
_ELEMENTWISE = frozenset({"zero_", "fill_", "copy_"})


def name_params(names: dict[nn.Parameter, str]) -> None:
    """Record the names the refusal gives these params."""
    _names.update((id(param), name) for param, name in names.items())


def name_of(param: nn.Parameter) -> str:
    """The name ``name_params`` recorded for ``param`` in its wrapped model."""
    return _names.get(id(param), "?")


def locate_pieces(param: nn.Parameter, locate: Callable[[], tuple[torch.Tensor, int]]) -> None:
    """Where this rank's piece of ``param`` lives between uses: ``locate()`` gives a 1-D view
    of it in the rank's shard and its offset in the flattened param ([Note: writes between
    uses])."""
    _pieces[id(param)] = locate


def _locate(param: nn.Parameter) -> Callable[[], tuple[torch.Tensor, int]] | None:
    return _pieces.get(id(param))


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
        if (_pointwise_in_place(name) and args and type(args[0]) is ParamBetweenUses
                and _locate(args[0]) is not None):
            return _write_piece(func, name, args, kwargs)
        param = next(a for a in tree_leaves((args, kwargs)) if type(a) is ParamBetweenUses)
        raise RuntimeError(_refusal(param, name))


@functools.cache
def _pointwise_in_place(name: str) -> bool:
    """Whether the op named ``name`` writes in place into its first operand, element by
    element ([Note: writes between uses])."""
    name = _IN_PLACE_OPERATORS.get(name, name)
    if name.startswith("_") or not name.endswith("_"):
        return False
    if name in _ELEMENTWISE:
        return True
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags
                                      for o in packet.overloads())


def _write_piece(func: Any, name: str, args: tuple, kwargs: dict) -> nn.Parameter:
    """The element-wise op ``func`` in place on this rank's piece of the param ``args[0]``,
    with the same range of each operand of the param's shape; see [Note: writes between
    uses]."""
    target = args[0]
    shape = target.shape
    if torch.is_grad_enabled() and target.requires_grad:  # torch's own refusal, by name
        raise RuntimeError(
            f"a leaf Variable that requires grad is being used in an in-place operation "
            f"({name} on parameter '{name_of(target)}'): write it under torch.no_grad(), as "
            "with torch's own parameters"
        )
    piece, start = _locate(target)()

    def piece_of(value: Any) -> Any:
        if value is target:
            return piece
        if type(value) is ParamBetweenUses:  # another param, read whole
            raise RuntimeError(_refusal(value, name))
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if not _broadcasts(value.shape, shape):
            raise RuntimeError(
                f"{name} on parameter '{name_of(target)}' (shape {tuple(shape)}) between its "
                f"uses with an operand of shape {tuple(value.shape)}, which does not "
                f"broadcast to the parameter's shape: each rank writes its piece of the "
                f"parameter from the same piece of each operand"
            )
        return value.expand(shape).reshape(-1)[start : start + piece.numel()]

    operands = tree_map(piece_of, (args, kwargs))
    with torch.no_grad(), DisableTorchFunctionSubclass():
        func(*operands[0], **operands[1])
    return target


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False


def _refusal(param: nn.Parameter, name: str) -> str:
    return (f"parameter '{_names.get(id(param), '?')}' (shape {tuple(param.shape)}) of a "
            f"module wrapped with shard_params=True was read by {name} between its uses, "
            f"where each rank holds only its shard and the parameter is a placeholder. Read "
            f"it inside 'with ddp.gathered_params():' on every rank (an EMA: "
            f"ema.update_parameters(model) there), or take every parameter whole with "
            f"ddp.full_state_dict(); inside a forward, a module that reads another module's "
            f"parameter must do so in the first forward too, where distopt finds such reads; "
            f"element-wise ops in place on the parameter (p.clamp_(...), p.mul_(x), "
            f"p.copy_(t), under torch.no_grad()) apply to each rank's shard")
