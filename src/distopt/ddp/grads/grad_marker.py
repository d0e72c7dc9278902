"""What ``p.grad`` holds for a param of a distopt model: the reduced grad, as torch scripts read it.

[Note: p.grad under distopt]
The DDP moves each grad out of ``p.grad`` into its bucket as soon as autograd has accumulated it
(ddp/wrapper.py), and after the reduce-scatter a rank holds the reduced grad of its own shard only
(with sharded grads, nothing else): no rank holds the whole reduced grad that torch's DDP leaves
in ``p.grad``. What torch scripts do with ``p.grad`` needs far less than the whole tensor, so
once its grad is moved a param's ``.grad`` is a ``GradInBuffer``: a tensor of the param's shape,
dtype and device without storage, whose operations are answered from the reduced grads:

* the norms. At the end of the step's grad sync (ddp/grads/grad_sync.py) every rank takes, per
  param, the fp32 norm (types 2 and inf) of the piece of the reduced grad it holds, and one small
  all-gather over the data-parallel group gives every rank every rank's pieces, combined in rank
  order: the sum of the squares and the largest magnitude of each param's reduced grad, the same
  bits on every rank (``ddp/grads/grad_reads.py``). ``p.grad.norm()``, ``torch.linalg.vector_norm``,
  ``torch._foreach_norm`` (so ``clip_grad_norm_``, ``get_total_norm``, whatever their ``foreach``)
  read them and communicate nothing: a read on one rank alone (a script logging on its master
  process) starts no collective that the other ranks do not join. torch's total norm is then torch's
  own arithmetic on these norms, so ``error_if_nonfinite`` raises as torch's. Against torch's DDP a
  norm differs only by the fp32 rounding of the same squares summed in another order (and of an
  average over the ranks taken by another collective).
* scaling in place (``mul_``, ``div_``, ``_foreach_mul_`` by a scalar: ``clip_grad_norm_``'s
  clip) applies torch's own op to the pieces this rank holds, which are the grads the
  optimizer steps (main grads are views of them, or copies made in the step), and scales the
  agreed statistics alike: element-wise, so exact, and with no communication.
* clamping in place (``clamp_``, ``_foreach_clamp_min_``/``max_``: ``clip_grad_value_``) clamps
  the pieces; which grads the bound changes is known from the agreed largest magnitudes, alike on
  every rank, and their statistics are agreed again, one small all-gather per call that changes
  some grad (per param in torch's default loop over the grads, two in all with
  ``foreach=True``). A clamp, like every write, must run on every rank, as in torch's DDP, where
  one rank's clipping alone would leave its replica apart.
* writes, as one rule: an element-wise op (tagged ``torch.Tag.pointwise``, and ``zero_``,
  ``fill_``, ``copy_``) in place into ``p.grad`` or with ``out=p.grad``, its other operands
  scalars, ``p.grad`` itself or tensors of the param's shape (or broadcasting to it): a rank's
  piece is a contiguous range of the flattened param, so the op on the piece with the same range
  of each operand (expanded to the param's shape) writes exactly what torch's writes there; then
  the param's statistics are agreed again (one small all-gather). Gradient noise
  (``p.grad.add_(noise)``), ``torch.nan_to_num(p.grad, ..., out=p.grad)``, ``copy_``, ``zero_``,
  signSGD's ``sign_`` and Gradient Centralization's ``p.grad.add_(-p.grad.mean(dim=1,
  keepdim=True))`` are such writes. Out of place (``p.grad.abs()``) an op makes a new tensor of
  the whole grad: refused by name, naming the reduction that answers (``p.grad.norm(1)``).
* reductions the statistics do not hold (``sum``, ``mean``, ``amax``, ``amin``, ``max``,
  ``min``, norms of other orders, each whole or along dimensions: a row of a matrix may straddle
  two ranks' pieces): each rank reduces the grad in fp64 with the reduction's neutral element
  outside its piece, and one small all-gather combines the ranks' results in rank order (sums
  of disjoint elements, maxima of them: exact up to fp64 rounding, the same bits on every rank).
  These reads communicate, so they run on every rank (``ddp/grads/grad_reductions.py``).
* ``p.grad is None``: present means "this param has a grad since the last zero". With
  ``find_unused_parameters`` the statistics carry each rank's used flags, and a param that some
  other rank used gets its ``p.grad`` too, as torch's DDP gives it; one that no rank used keeps
  None.
* assignments, seen at the step (``take_grad_writes``, from the markers, ddp/grads/grad_markers.py):
  a param whose ``p.grad`` the loop set to None (DINO's ``cancel_gradients_last_layer``) is left
  out of the step as torch.optim leaves it (no update, weight decay or step count): the rule
  for a param no rank used (``unused_params``), its piece zeroed so that no norm of the step
  counts it. ``p.grad = t`` (the param's shape) is the grad: each rank copies its own range of
  ``t`` into its piece. The loop runs on every rank, so every rank sees the same.

A write, like a clamp, must run on every rank, as in torch's DDP, where one rank's write alone
would leave its replica apart. What needs the whole tensor (``p.grad.clone()``, indexing,
``cumsum``, a write into another tensor from ``p.grad``) raises one error that names the param,
what works, and the optimizer's options for the rest (``clip_grad=``, ``clip_grad_value=``,
``log_grad_norms=``); so do tensor-parallel DTensor params (torch's ``p.grad`` would be a
DTensor whose norm is a collective over the mesh), experts (each rank holds other experts under
the same names, so a norm over ``model.parameters()`` would differ by rank) and params tied
across pipeline stages (the step sums their grads over the stages), each by name. A param
owned whole by one rank (Muon's and Adafactor's layout) answers as any other: its owner's piece
is all of it, the others' nothing. Every rank runs the same code, so a refusal raises on every
rank at the same call, before any collective.

When: the statistics are taken at the end of every backward outside ``no_sync()`` (the
reductions are waited for there, as torch's DDP waits at the end of its backward) and their
all-gather is started there, on every rank; it is waited for at the first read, or by the next
backward or zero of the grads, so a read between backward and step finds them and a step that
reads nothing does not wait for them (``distopt bench``'s ``wait_agree``). Three backwards
leave their reductions to later and agree at the step's first read, or at the step, which then
must run on every rank: with
``overlap_grad_reduce=False`` (nothing is launched before the sync's finish), on a pipeline
stage (``hold_step``: the backward's end must not wait for its reductions) and a backward inside
another one (reentrant activation checkpointing: the outer backward goes on, and its end has no
callback of distopt's). Reads are refused, by name, during a backward, after one inside
``no_sync()`` (torch's DDP leaves this rank's own grads there; distopt's buffers hold them, or
their reduction, neither torch's), after ``opt.step()`` (whose unscaling and clipping change the
buffers in place); after the grads were zeroed ``p.grad`` is None, or reads zeros. Reads
answer the grads as scaled by the loss, as torch's do, until
``torch.amp.GradScaler.unscale_(opt)``: then they answer the unscaled grads, and writes act on
them ([Note: torch's GradScaler] in optim/amp.py).

Cost: per backward outside ``no_sync()``, two norms (type 2, and the largest magnitude from
one ``aminmax`` pass on a CPU, where torch's norm of type inf is tens of times slower) of the
reduced grads this rank holds (a read of 1/d of the grads each) and one all-gather of 2 fp64
numbers per param from each rank (3 with ``find_unused_parameters``, waited for at once, since
``p.grad is None`` reads its flags), always: whether some rank will read ``p.grad``
cannot be known alike on every rank before the read, and a read must not communicate. The
reductions are waited for at the backward's end instead of at the step, which runs right after
it; only a backward outside ``no_sync()`` followed by another (accumulation without
``no_sync()``) loses the overlap of its last reductions with the next forward, as under torch's
DDP. None of this runs under ``no_sync()``.

The marker keeps torch's meaning of zeroing: ``opt.zero_grad()`` and ``ddp.zero_grad()``
remove the markers with the step's grads; with ``set_to_none=False`` each marker stays, zeroed,
and answers every read as the zeros torch's zeroed grad holds (no communication; a write into
it must leave it zero). A ``zero_grad()`` of the wrapped module itself clears the markers alone
(``p.grad = None``, or ``zero_()`` with ``set_to_none=False``, which the marker records, and
which between backward and step also zeroes the pieces): the next backward finds them cleared
and starts a new step's grads, as ``opt.zero_grad()`` would have. Markers cleared for some
params and not for others are an error at the next backward, since distopt zeroes a step's
grads as a whole. A tensor hook that runs before autograd's accumulation removes the marker,
so autograd writes the next grad as into an empty ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from .grad_messages import OUT_OF_PLACE, refusal
from .grad_reads import GradReads
from .grad_reductions import REDUCTIONS, ShardedReduction, sharded_reduction, vector_norm

aten = torch.ops.aten



class _Slot:
    """One param's ``p.grad``, shared by the marker and its aliases (``p.grad.data``)."""

    __slots__ = ("name", "param", "reads", "zeroed")

    def __init__(self, param: nn.Parameter, name: str, reads: GradReads) -> None:
        self.param = param
        self.name = name
        self.reads = reads
        self.zeroed = False


class GradInBuffer(torch.Tensor):
    """``p.grad`` of a param whose grad distopt holds in its buffers; see
    [Note: p.grad under distopt]."""

    slot: _Slot

    @staticmethod
    def __new__(cls, param: nn.Parameter, name: str, reads: GradReads,
                slot: _Slot | None = None) -> GradInBuffer:
        marker = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        marker.slot = slot or _Slot(param, name, reads)
        return marker

    @property
    def param_name(self) -> str:
        return self.slot.name

    @property
    def zeroed(self) -> bool:
        return self.slot.zeroed

    def _alias(self) -> GradInBuffer:
        return GradInBuffer(self.slot.param, self.slot.name, self.slot.reads, self.slot)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if func in _FLAGS:  # zero_, detach and aliases: whatever the grads are now
            return handler(func, *args, **kwargs)
        if any(m.slot.zeroed and not m.slot.reads.live for m in _markers(args, kwargs)):
            return _on_zeros(func, args, kwargs)
        if handler is not None:
            return handler(func, *args, **kwargs)
        if func in REDUCTIONS:
            return _reduce(func, *args, **kwargs)
        if _pointwise(func) and _written(func, args, kwargs):
            return _pointwise_write(func, args, kwargs)
        marker = _markers(args, kwargs)[0]
        if _pointwise(func):  # out of place: a new tensor of the whole grad
            raise RuntimeError(_refusal(marker, func, OUT_OF_PLACE))
        raise RuntimeError(_refusal(marker, func))

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"GradInBuffer(param='{self.slot.name}', shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")

    def __deepcopy__(self, memo: Any) -> None:
        return None  # a copy of the model has no grads in distopt's buffers


def _markers(args: Any, kwargs: Any) -> list[GradInBuffer]:
    found = []
    for value in [*args, *kwargs.values()]:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, GradInBuffer):
                found.append(item)
    return found


def _refusal(marker: GradInBuffer, func: Any, why: str = "") -> str:
    return refusal(marker.slot.name, func, why)


def _by_reads(markers: list[GradInBuffer]) -> dict[GradReads, list[int]]:
    """Positions of ``markers`` grouped by the model whose buffers hold them."""
    groups: dict[GradReads, list[int]] = {}
    for k, marker in enumerate(markers):
        groups.setdefault(marker.slot.reads, []).append(k)
    return groups


def _only_self(func: Any, marker: Any, *others: Any) -> GradInBuffer:
    """``marker``, which must be the op's ``self``; refused where a marker is another operand
    (``x.mul_(p.grad)`` needs the whole tensor)."""
    if not isinstance(marker, GradInBuffer):
        raise RuntimeError(_refusal(_markers(others, {})[0], func))
    for other in others:
        if _markers([other], {}):
            raise RuntimeError(_refusal(marker, func))
    return marker


def _scalar(func: Any, marker: GradInBuffer, value: Any) -> Any:
    """A scalar operand: a number, or a tensor of one element (torch's clip coefficient)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise RuntimeError(_refusal(marker, func))
    return value


# ---------------------------------------------------------------------- the handlers


def _zero(func: Any, marker: GradInBuffer) -> GradInBuffer:
    # Between backward and step the pieces are zeroed as any element-wise write; either way
    # the marker answers zeros, and the next backward starts a new step if every marker is.
    if marker.slot.reads.live and not marker.slot.zeroed:
        _pointwise_write(aten.zero_.default, (marker,), {})
    marker.slot.zeroed = True
    return marker


def _on_zeros(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` with each marker zeroed outside a step's grads (``zero_grad(set_to_none=
    False)``) as the zeros it holds: torch's values, with no communication. A write into such
    a marker must leave it zero: the grads start again at the next backward."""
    zeros: dict[_Slot, torch.Tensor] = {}

    def as_zeros(value: Any) -> Any:
        if isinstance(value, GradInBuffer) and value.slot.zeroed and not value.slot.reads.live:
            if value.slot not in zeros:
                zeros[value.slot] = torch.zeros(value.shape, dtype=value.dtype,
                                                device=value.device)
            return zeros[value.slot]
        return value

    result = func(*tree_map(as_zeros, args), **tree_map(as_zeros, kwargs))
    back = {}
    for written in _written(func, args, kwargs):
        if isinstance(written, GradInBuffer) and written.slot in zeros:
            if bool((zeros[written.slot] != 0).any()):
                raise RuntimeError(
                    f"p.grad of parameter '{written.slot.name}' was written by {func} after "
                    "it was zeroed (zero_grad(set_to_none=False)), before any backward: "
                    "distopt starts the grads again at the next backward; write p.grad "
                    "after it"
                )
            back[id(zeros[written.slot])] = written
    return tree_map(lambda r: back.get(id(r), r), result)


# Element-wise though not tagged so: what they write into each element depends on it alone.
_ELEMENTWISE = frozenset({aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor,
                          aten.copy_.default})


def _pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in func.tags or func in _ELEMENTWISE


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The operands ``func`` writes into: ``self`` of an op in place, ``out=``."""
    written = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            written.extend(value if isinstance(value, (list, tuple)) else [value])
    return written


def _pointwise_write(func: Any, args: Any, kwargs: Any) -> GradInBuffer:
    """An element-wise op in place into ``p.grad`` (or with ``out=p.grad``): on this rank's
    piece, a contiguous range of the flattened param, with the same range of each operand of
    the param's shape (or one that broadcasts to it), then the param's statistics agreed
    again. Every rank checks the operands alike before the agreement's collective."""
    written = _written(func, args, kwargs)
    target = written[0] if len(written) == 1 else None
    if not isinstance(target, GradInBuffer):  # x.add_(p.grad) reads the whole grad
        raise RuntimeError(_refusal(_markers(args, kwargs)[0], func))
    slot, shape = target.slot, target.shape
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, GradInBuffer) and value.slot is not slot:
            raise RuntimeError(_refusal(value, func))  # another param's grad
        if isinstance(value, torch.Tensor) and not isinstance(value, GradInBuffer) and (
                value.numel() != 1 and _broadcast(value.shape, shape) != shape):
            raise RuntimeError(_refusal(target, func, (
                f": its operand of shape {tuple(value.shape)} does not broadcast to the "
                f"parameter's shape {tuple(shape)}")))

    def apply(values: torch.Tensor, start: int) -> None:
        def piece_of(value: Any) -> Any:
            if isinstance(value, GradInBuffer):
                return values
            if isinstance(value, torch.Tensor):
                if value.numel() == 1:
                    return value.reshape(())
                return value.expand(shape).reshape(-1)[start:start + values.numel()]
            return value

        func(*tree_map(piece_of, args), **tree_map(piece_of, kwargs))

    slot.reads.write_(slot.param, apply)
    slot.zeroed = False  # it holds what was written
    return target


def _broadcast(a: torch.Size, b: torch.Size) -> torch.Size | None:
    try:
        return torch.broadcast_shapes(a, b)
    except RuntimeError:
        return None


def _whole(spec: ShardedReduction) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: spec.partial(x.reshape(-1))


def _reduce(func: Any, marker: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A sum, mean, max, min or norm of ``p.grad`` (whole or along some dimensions) that the
    agreed statistics do not answer: one small collective, so on every rank."""
    _only_self(func, marker, *args, *kwargs.values())
    spec = sharded_reduction(func, marker.shape, marker.dtype, args, kwargs)
    reduced = marker.slot.reads.reduce([marker.slot.param], spec.partial, spec.fill,
                                       spec.combine)[0]
    return spec.finish(reduced)


def _same(func: Any, marker: GradInBuffer, *args: Any) -> GradInBuffer:
    return marker  # nn.Module.zero_grad(set_to_none=False) detaches in place


def _alias(func: Any, marker: GradInBuffer, *args: Any) -> GradInBuffer:
    if func is aten.view.default:  # what ``p.grad *= c`` ends with: itself, as ``p.grad``
        if list(args[0]) != list(marker.shape):
            raise RuntimeError(_refusal(marker, func))
        return marker
    return marker._alias()  # p.grad.data, p.grad.detach(): the same grad


def _vector_norm(func: Any, marker: GradInBuffer, ord: Any = 2, dim: Any = None,
                 keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    _only_self(func, marker)
    whole = dim is None or sorted(d % max(marker.dim(), 1) for d in dim) == list(
        range(marker.dim()))
    if not whole or float(ord) not in (2.0, math.inf):  # one collective: see _reduce
        return _reduce(func, marker, ord, dim, keepdim, dtype=dtype)
    norm = marker.slot.reads.norms([marker.slot.param], ord, [dtype or marker.dtype])[0]
    return norm.reshape([1] * marker.dim()) if keepdim else norm


def _foreach_norm(func: Any, tensors: list[torch.Tensor], ord: Any = 2,
                  dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    markers = [t for t in tensors if isinstance(t, GradInBuffer)]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    plain = [k for k, t in enumerate(tensors) if not isinstance(t, GradInBuffer)]
    if plain:  # the grads of params outside distopt's buffers (torch's ignore list)
        for k, norm in zip(plain, func([tensors[k] for k in plain], ord, dtype=dtype),
                           strict=True):
            out[k] = norm
    for reads, positions in _by_reads(markers).items():
        params = [markers[k].slot.param for k in positions]
        if float(ord) in (2.0, math.inf):  # the agreed statistics: no communication
            norms = reads.norms(params, ord, [dtype or markers[k].dtype for k in positions])
        else:  # one collective for all of them, on every rank
            spec = vector_norm(float(ord), (0,), False, torch.float64)
            norms = [spec.finish(t).reshape(()).to(dtype or markers[k].dtype) for k, t in zip(
                positions, reads.reduce(params, _whole(spec), spec.fill, spec.combine),
                strict=True)]
        at = [k for k, t in enumerate(tensors) if isinstance(t, GradInBuffer)]
        for k, norm in zip(positions, norms, strict=True):
            out[at[k]] = norm
    return out  # type: ignore[return-value]


def _scale(divide: bool) -> Callable[..., Any]:
    def scale(func: Any, marker: Any, other: Any) -> GradInBuffer:
        if isinstance(other, torch.Tensor) and other.numel() != 1:  # by a tensor, element-wise
            return _pointwise_write(func, (marker, other), {})
        _only_self(func, marker, other)
        marker.slot.reads.scale_([marker.slot.param], _scalar(func, marker, other),
                                 divide=divide)
        return marker

    return scale


def _foreach_scale(divide: bool) -> Callable[..., Any]:
    def scale(func: Any, tensors: list[torch.Tensor], other: Any) -> None:
        markers = [t for t in tensors if isinstance(t, GradInBuffer)]
        per_tensor = isinstance(other, (list, tuple))
        if isinstance(other, torch.Tensor) or not per_tensor:
            for marker in markers:
                _scalar(func, marker, other)
        plain = [k for k, t in enumerate(tensors) if not isinstance(t, GradInBuffer)]
        if plain:
            func([tensors[k] for k in plain], [other[k] for k in plain] if per_tensor else other)
        at = [k for k, t in enumerate(tensors) if isinstance(t, GradInBuffer)]
        for reads, positions in _by_reads(markers).items():
            if per_tensor:
                for k in positions:
                    reads.scale_([markers[k].slot.param], other[at[k]], divide=divide)
            else:
                reads.scale_([markers[k].slot.param for k in positions], other,
                             divide=divide)

    return scale


def _clamp(func: Any, marker: Any, min: Any = None, max: Any = None) -> GradInBuffer:
    _only_self(func, marker, min, max)
    if func is aten.clamp_max_.default:  # clamp_max_(self, max): the one bound is the max
        min, max = None, min
    marker.slot.reads.clamp_([marker.slot.param], _bound(func, marker, min),
                             _bound(func, marker, max))
    return marker


def _bound(func: Any, marker: GradInBuffer, value: Any) -> float | None:
    value = _scalar(func, marker, value)
    return None if value is None else float(value)


def _foreach_clamp(low: bool) -> Callable[..., Any]:
    def clamp(func: Any, tensors: list[torch.Tensor], bound: Any) -> None:
        markers = [t for t in tensors if isinstance(t, GradInBuffer)]
        plain = [t for t in tensors if not isinstance(t, GradInBuffer)]
        if plain:
            func(plain, bound)
        for reads, positions in _by_reads(markers).items():
            value = _bound(func, markers[positions[0]], bound)
            reads.clamp_([markers[k].slot.param for k in positions],
                         value if low else None, None if low else value)

    return clamp


_FLAGS = frozenset({aten.zero_.default, aten.detach_.default, aten.detach.default,
                    aten.alias.default, aten.view.default})

_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.zero_.default: _zero,
    aten.detach_.default: _same,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _alias,
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _scale(divide=False),
    aten.mul_.Scalar: _scale(divide=False),
    aten.div_.Tensor: _scale(divide=True),
    aten.div_.Scalar: _scale(divide=True),
    aten._foreach_mul_.Scalar: _foreach_scale(divide=False),
    aten._foreach_mul_.Tensor: _foreach_scale(divide=False),
    aten._foreach_mul_.ScalarList: _foreach_scale(divide=False),
    aten._foreach_div_.Scalar: _foreach_scale(divide=True),
    aten._foreach_div_.Tensor: _foreach_scale(divide=True),
    aten._foreach_div_.ScalarList: _foreach_scale(divide=True),
    aten.clamp_.default: _clamp,
    aten.clamp_min_.default: _clamp,
    aten.clamp_max_.default: _clamp,
    aten._foreach_clamp_min_.Scalar: _foreach_clamp(low=True),
    aten._foreach_clamp_max_.Scalar: _foreach_clamp(low=False),
}
