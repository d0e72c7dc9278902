"""Which torch optimizers distopt can shard, and how: element by element, or whole tensors.

[Note: optimizer kinds]
distopt steps a rank's part of the model with an ordinary ``torch.optim`` optimizer, so what the
part may be depends on what the optimizer reads when it updates an element:

* Element-wise optimizers (``ELEMENTWISE_OPTIMIZERS``: Adam, AdamW, SGD, ...) read only that
  element's grad and state, so they give the same result on any split of a parameter: each
  rank owns an equal slice of every bucket, cut anywhere ([Note: layout rule] in
  layout/elementwise.py).
* Whole-tensor optimizers read the whole parameter: Muon orthogonalises each 2-D update with
  Newton-Schulz iterations, Adafactor keeps row and column statistics and scales by the
  parameter's RMS. Each of their params is owned whole by one rank, the buckets laid out so
  that no param crosses a shard boundary ([Note: whole-tensor layout] in layout/whole.py); the
  owner steps it alone, and the ordinary reduce-scatter and all-gather carry it: no collective
  is added, and the bytes sent grow only by the padding of those buckets. Which rank owns
  which param balances a cost per param: for Muon the multiply-adds of Newton-Schulz, for
  Adafactor (whose work is linear) the elements. A user's own class declares its cost with
  ``register_whole_tensor_optimizer``. On a hierarchical mesh
  ([Note: hierarchical data parallelism] in parallel/process_groups.py) the owners are ranks
  of the shard group, and each replica's owner steps the param, as each replica keeps its own state.
* Any other ``torch.optim.Optimizer`` subclass (a repository's own LARS, LAMB or Lion) is owned
  whole too, its cost the elements: whatever its step reads of one param (``torch.norm(p)``
  and ``torch.norm(grad)`` for LARS's trust ratio), the owner holds all of it, so the result
  is that of torch DDP with the same class, on any class that updates each param from its own
  values and state. Only an update that reads several params at once could differ, and
  ``torch.optim`` has two such classes, refused by name (``REFUSED_OPTIMIZERS``): LBFGS
  (its line search re-evaluates the closure and steps the whole model's flattened params) and
  SparseAdam (it takes sparse grads only; distopt reduces dense ones). A user's element-wise
  class may be declared so with ``register_elementwise_optimizer``, to be sharded element by
  element.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..ddp.whole_tensor_params import use_cost_table
from ..layout.whole import newton_schulz_cost
from .block_scaling import DEFAULT_BLOCK_SIZE, needs_scales, num_blocks

WholeTensorCost = Callable[[Sequence[int]], float]
"""The optimizer's work on one parameter of the given shape, in any unit common to the class."""

StateBytes = Callable[[Sequence[int], Mapping[str, Any]], float]
"""Bytes of fp32 state (step counters aside) the class keeps for one whole parameter of the
given shape, under a param group's options."""


@dataclass(frozen=True, slots=True)
class StateKey:
    """One per-element state tensor a class keeps (shaped like the param), by its torch name."""

    name: str
    option: str | None = None
    """Kept only when the param group's value of this option is truthy (SGD's momentum)."""
    square: bool = False
    """It holds squares of grads (Adam's second moment), the state of widest range: below
    fp16's and fp8's smallest numbers unless scaled (see [Note: state precision] in
    optim/state_precision.py)."""
    vectors_only: bool = False
    """Per-element only for 1-D params (Adafactor's full second moment of a vector)."""

    def present(self, shape: Sequence[int], options: Mapping[str, Any]) -> bool:
        if self.vectors_only and len(shape) >= 2:
            return False
        return self.option is None or bool(options.get(self.option))


def newton_schulz_shape_cost(shape: Sequence[int]) -> float:
    """Muon's work on a matrix: its Newton-Schulz products, ``max * min**2`` multiply-adds."""
    if len(shape) != 2:
        raise ValueError(f"Newton-Schulz runs on 2-D matrices, got shape {tuple(shape)}")
    return float(newton_schulz_cost(shape[0], shape[1]))


def numel_cost(shape: Sequence[int]) -> float:
    """The work of an optimizer that touches each element a fixed number of times."""
    return float(math.prod(shape))


def per_element(fp32_tensors: int) -> StateBytes:
    """State of ``fp32_tensors`` tensors shaped like the param (a registered class's default)."""

    def state(shape: Sequence[int], options: Mapping[str, Any]) -> float:
        return 4.0 * fp32_tensors * math.prod(shape)

    return state


def adafactor_matrix_state(shape: Sequence[int], options: Mapping[str, Any]) -> float:
    """Adafactor's row and column statistics of a matrix (of every matrix of a stacked
    tensor), kept in fp32; a vector's full second moment is per-element state."""
    if len(shape) < 2:
        return 0.0
    rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
    return 4.0 * (rows + cols)


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    """How distopt shards one optimizer class, what its owners balance, what it keeps."""

    state_keys: tuple[StateKey, ...] | None
    """Its per-element state tensors; None: not known (a registered class of the user's)."""
    other_state_bytes: StateBytes | None = None
    """fp32 bytes of the state that is not per element (Adafactor's row and column
    statistics of a matrix), or, with unknown keys, of all its state."""
    whole_tensor_cost: WholeTensorCost | None = None
    """None: element-wise shards; else each param is owned whole, and this is its cost."""
    matrices_only: bool = False
    """It steps 2-D matrices only (Muon)."""


_EXP_AVG, _EXP_AVG_SQ = StateKey("exp_avg"), StateKey("exp_avg_sq", square=True)
_ADAM = (_EXP_AVG, _EXP_AVG_SQ, StateKey("max_exp_avg_sq", option="amsgrad", square=True))

_KINDS: dict[type[torch.optim.Optimizer], OptimizerKind] = {
    torch.optim.SGD: OptimizerKind((StateKey("momentum_buffer", option="momentum"),)),
    torch.optim.Adam: OptimizerKind(_ADAM),
    torch.optim.AdamW: OptimizerKind(_ADAM),
    torch.optim.Adagrad: OptimizerKind((StateKey("sum", square=True),)),
    torch.optim.RMSprop: OptimizerKind((
        StateKey("square_avg", square=True), StateKey("momentum_buffer", option="momentum"),
        StateKey("grad_avg", option="centered"))),
    torch.optim.Adamax: OptimizerKind((_EXP_AVG, StateKey("exp_inf"))),
    torch.optim.NAdam: OptimizerKind((_EXP_AVG, _EXP_AVG_SQ)),
    torch.optim.RAdam: OptimizerKind((_EXP_AVG, _EXP_AVG_SQ)),
    torch.optim.ASGD: OptimizerKind((StateKey("ax"),)),
    torch.optim.Rprop: OptimizerKind((StateKey("prev"), StateKey("step_size"))),
    torch.optim.Adadelta: OptimizerKind((
        StateKey("square_avg", square=True), StateKey("acc_delta", square=True))),
    torch.optim.Muon: OptimizerKind((StateKey("momentum_buffer"),), None,
                                    newton_schulz_shape_cost, matrices_only=True),
    torch.optim.Adafactor: OptimizerKind(
        (StateKey("variance", square=True, vectors_only=True),), adafactor_matrix_state,
        numel_cost),
}
"""The one table of optimizer classes: every place that asks how a class shards, what its
owners balance or how much state it keeps reads it through ``kind_of``."""

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls, kind in _KINDS.items() if kind.whole_tensor_cost is None
)
"""Optimizers whose update of an element depends only on that element's grad and state, so
they give the same result on any split of a parameter."""

Cls = TypeVar("Cls", bound=type[torch.optim.Optimizer])


def register_whole_tensor_optimizer(
    optimizer_cls: Cls, cost: WholeTensorCost | None = None,
    state_bytes: StateBytes | None = None,
) -> Cls:
    """Declare that ``optimizer_cls`` (and its subclasses) must see each parameter whole.

    distopt then has each param of its groups owned whole by one data-parallel rank, the owners
    chosen to balance ``cost(shape)`` summed per rank. A class distopt does not know is owned
    whole already, its cost the elements: declaring it gives the cost and the state's size.
    Returns the class, so that it also works as a decorator. See [Note: optimizer kinds].

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass whose step reads a param as a whole
            (a matrix's orthogonalization, a factored second moment); anything else is a
            TypeError. Declaring a class again replaces its entry.
        cost: the work of stepping one param, from its shape, in any unit common to the
            class; the owners are chosen so that each rank's sum is about the same. None: the
            number of elements.
        state_bytes: bytes of fp32 state the class keeps for one param, from its shape and its
            param group's options, ``state_bytes(shape, group_options)``; only distopt's
            memory estimates read it, never the step. None: two fp32 tensors shaped like the
            param (Adam's moments).
    """
    _check_declared(optimizer_cls, "register_whole_tensor_optimizer")
    _KINDS[optimizer_cls] = OptimizerKind(
        None, state_bytes or per_element(2), numel_cost if cost is None else cost
    )
    return optimizer_cls


def register_elementwise_optimizer(
    optimizer_cls: Cls, state_bytes: StateBytes | None = None,
) -> Cls:
    """Declare that ``optimizer_cls`` (and its subclasses) updates each element from that
    element's grad and state alone, so that distopt shards it element by element, as AdamW.

    Without a declaration a class distopt does not know is owned whole, param by param, which
    is exact for any class; an element-wise one declared here is split evenly across the
    ranks instead. Returns the class, so that it also works as a decorator. See
    [Note: optimizer kinds].

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass whose step reads no more than one
            element of each tensor at a time (no norm, mean or shape of a param); anything
            else gives other results than torch.optim's. Declaring a class again replaces its
            entry.
        state_bytes: bytes of fp32 state the class keeps for a param of the given shape,
            ``state_bytes(shape, group_options)``; only distopt's memory estimates read it.
            None: two fp32 tensors shaped like the param (Adam's moments).
    """
    _check_declared(optimizer_cls, "register_elementwise_optimizer")
    _KINDS[optimizer_cls] = OptimizerKind(None, state_bytes or per_element(2))
    return optimizer_cls


REFUSED_OPTIMIZERS: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.LBFGS: (
        "its step re-evaluates the closure several times (a line search) and keeps a history "
        "over the whole model's flattened params, which no rank holds"),
    torch.optim.SparseAdam: (
        "it steps sparse grads only, and distopt reduces dense ones; use torch.optim.Adam or "
        "AdamW (sparse embedding grads are reduced dense and step with them)"),
}
"""torch.optim classes whose update reads more than one param, or grads distopt does not give,
by the reason given in their refusal."""

_UNDECLARED = OptimizerKind(None, per_element(2), numel_cost)
"""The kind of a class distopt does not know: each param owned whole, by its elements."""


def refusal_of(optimizer_cls: type[torch.optim.Optimizer]) -> str | None:
    """Why distopt cannot step ``optimizer_cls``, or None when it can."""
    for klass in optimizer_cls.__mro__:
        if klass in _KINDS:
            return None
        if klass in REFUSED_OPTIMIZERS:
            return REFUSED_OPTIMIZERS[klass]
    return None


def kind_of(optimizer_cls: type[torch.optim.Optimizer]) -> OptimizerKind | None:
    """The table's entry for a class: the nearest declared class in its MRO decides (so a
    subclass of AdamW declared whole-tensor is one); a class no entry covers is owned whole
    (``_UNDECLARED``); None for a class distopt cannot step (``REFUSED_OPTIMIZERS``)."""
    for klass in optimizer_cls.__mro__:
        if klass in _KINDS:
            return _KINDS[klass]
        if klass in REFUSED_OPTIMIZERS:
            return None
    return _UNDECLARED


def whole_tensor_cost(optimizer_cls: type[torch.optim.Optimizer]) -> WholeTensorCost | None:
    """The cost function of a whole-tensor class, or None for an element-wise one."""
    kind = kind_of(optimizer_cls)
    return None if kind is None else kind.whole_tensor_cost


def needs_matrices(optimizer_cls: type[torch.optim.Optimizer]) -> bool:
    """Whether the class steps 2-D matrices only (Muon)."""
    kind = kind_of(optimizer_cls)
    return kind is not None and kind.matrices_only


StateDtypes = Mapping[str, torch.dtype]
"""The dtype each per-element state key is held in between steps (absent: fp32)."""


def state_bytes(
    optimizer_cls: type[torch.optim.Optimizer] | None,
    shape: Sequence[int],
    options: Mapping[str, Any] | None = None,
    state_dtypes: StateDtypes | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> float:
    """Bytes of state (step counters aside) ``optimizer_cls`` keeps for a param of ``shape``
    (a whole param, or an element-wise piece of it) under a group's ``options`` (None: the
    class's defaults), each per-element key in its dtype of ``state_dtypes`` (fp32 when
    absent), fp16 and fp8 keys with one byte per ``block_size`` elements of scales (see
    [Note: state precision]). None (a param no group steps) keeps nothing."""
    if optimizer_cls is None:
        return 0.0
    kind = kind_of(optimizer_cls)
    if kind is None:
        raise TypeError(f"{optimizer_cls.__name__} is not an optimizer class distopt shards")
    if options is None:
        options = _defaults(optimizer_cls)
    dtypes = state_dtypes or {}
    other = 0.0 if kind.other_state_bytes is None else kind.other_state_bytes(shape, options)
    if kind.state_keys is None:  # unknown keys: fp32, whatever was asked
        return other
    numel = math.prod(shape)
    total = other
    for key in kind.state_keys:
        if key.present(shape, options):
            dtype = dtypes.get(key.name, torch.float32)
            total += dtype.itemsize * numel
            if needs_scales(dtype):
                total += num_blocks(numel, block_size)  # one int8 exponent per block
    return total


def state_keys(optimizer_cls: type[torch.optim.Optimizer]) -> tuple[StateKey, ...] | None:
    """The per-element state tensors of a class (under any options), or None where unknown."""
    kind = kind_of(optimizer_cls)
    return None if kind is None else kind.state_keys


def _defaults(optimizer_cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    parameters = inspect.signature(optimizer_cls.__init__).parameters
    return {name: p.default for name, p in parameters.items()
            if p.default is not inspect.Parameter.empty}


def check_optimizer_cls(optimizer_cls: Any, where: str = "optimizer_cls") -> None:
    """Raise unless ``optimizer_cls`` is an optimizer class distopt can step: any
    ``torch.optim.Optimizer`` subclass but those of ``REFUSED_OPTIMIZERS``."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"{where} must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(the class, not an instance), got {optimizer_cls!r}"
        )
    reason = refusal_of(optimizer_cls)
    if reason is not None:
        raise TypeError(
            f"{where} {optimizer_cls.__name__} cannot be stepped by distopt: {reason}. Use an "
            "optimizer whose update of a param reads that param alone: any torch.optim class "
            "but LBFGS and SparseAdam, or your own (each param is then owned whole by one rank)"
        )


def _check_declared(optimizer_cls: Any, who: str) -> None:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"{who} takes a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    reason = REFUSED_OPTIMIZERS.get(optimizer_cls)
    if reason is not None:
        raise TypeError(f"{who}: {optimizer_cls.__name__} cannot be stepped by distopt: {reason}")


# The DDP lays its buffers out for whole_tensor_params= when it is built, before any optimizer
# exists; it sits a layer below this table, so the table hands it the costs.
use_cost_table(whole_tensor_cost)
