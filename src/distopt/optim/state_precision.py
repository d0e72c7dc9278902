"""Optimizer state held between steps in fewer bytes than fp32 (``state_dtype``).

[Note: state precision]
``state_dtype=torch.bfloat16`` (or a dict per state key) keeps every per-element state tensor
of the inner torch optimizer (a tensor shaped like its main param: Adam's moments, SGD's and
Muon's momentum, RMSprop's square average) in that dtype between steps. The step expands a
chunk's state to fp32 just before the inner step of that chunk and rounds it back just after
(round to nearest, ties to even: torch's ``.to``), so the unchanged ``torch.optim`` code steps
fp32 state, and only one chunk's state is fp32 at a time: with ``state_dtype`` the whole-shard
source steps one bucket's shard per chunk (see [Note: step chunks] in optim/step.py). torch
creates state at a param's first step, in fp32; leaving the chunk rounds it like any other.
Scalars (``step``, NAdam's ``mu_product``) and state that is not per element (Adafactor's row
and column statistics of a matrix) stay as torch keeps them. A step the loss scaler skips
returns before any chunk is stepped, so it leaves the state as it was.

So a step with bf16 state is the fp32-state step from the state rounded once to bf16, and its
result is rounded once more: after one step every element equals the fp32-state step's state
rounded once, and over many steps a run equals plain torch.optim with the state rounded to
bf16 after each step (tests/test_state_dtype.py checks both bit for bit).

fp16 and fp8 (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) are held with block scales
(optim/block_scaling.py). fp16 keeps 11 significant bits but only magnitudes from 6.1e-5
(5.96e-8 with subnormals) to 65504; e4m3 4 bits from 2**-9 to 448; e5m2 3 bits from 2**-16 to
57344. Squares of grads (Adam's ``exp_avg_sq``, 1e-8 to 1e-12 for grads of 1e-4 to 1e-6) are
below all three, and if they flush to zero Adam divides by ``eps`` alone and the update
explodes. So each state tensor of a main param is cut into blocks of ``state_block_size``
elements (32 by default) from its first element, a block never spanning two main params, and
block ``b`` is held as ``round(x / 2**k_b)`` with ``k_b`` the smallest integer that keeps the
block's largest magnitude within the format's max, stored as one int8.

* Why powers of two: dividing by one is exact, so the cast is the one rounding (to nearest,
  ties to even), and the held numbers come back exactly. Quantizing those numbers again with
  the same blocks, or with blocks within them, returns the same numbers (a part's exponent is
  never larger, and its values scale by 2**j, exactly), so a checkpoint loaded at the layout
  that saved it is exact. Against a scale of absmax / max, at most one binade of the format's
  range is lost, at the bottom; the significant bits are the same in every binade, and the
  scale costs one byte.
* Why 32: a smaller block spans a narrower range of magnitudes, so fewer of its elements
  fall to the format's subnormals (fewer significant bits) or to zero. The default run's
  held-out loss with e4m3 state is 3.7% above fp32 state's with blocks of 128, 2.5% with
  blocks of 32 and as much with 16 (docs/mixed-precision.md), for one byte per 32 elements:
  3.1% of fp8's byte.
* e4m3 or e5m2, and rounding (measured on the default ``distopt train`` run, the table in
  docs/mixed-precision.md): what fp8 loses is mostly the second moment's small updates. With
  beta2 = 0.95 an EMA step that adds a small square lowers ``exp_avg_sq`` by at most 5%, less
  than half the gap to the next e5m2 value (6 to 12% of the value) and than half e4m3's over
  part of each binade (3 to 6%), so rounding to nearest drops it and the moment stops
  decaying; e4m3, with the finer grid, does better than e5m2 there, and ``exp_avg`` alone in
  e4m3 (beta1 = 0.9: steps of 10%) loses nothing. ``state_rounding="stochastic"`` rounds
  up or down with probability by distance, so the expected held value is the fp32 one and
  small updates survive on average: both formats then end within 0.5% of fp32 state, e5m2
  (the wider range) slightly ahead.
* Stochastic rounding draws from one generator per device, seeded alike on every rank (the
  replicas of a hierarchical mesh stay equal) and advanced in the same order every step: a run
  repeats bit for bit, but a resumed run draws other numbers than the run it resumes.

So a step with scaled state is the fp32-state step from the state dequantized exactly, with its
result quantized once with fresh block scales; tests/test_state_scaled.py checks after one step
and over many against torch.optim whose state is quantized the same way after each step, bit
for bit. Between steps ``opt.state[main]`` holds the values under the key's name (the narrow
dtype, shaped like the main param) and the int8 exponents under ``key + BLOCK_EXPONENTS``.

Checkpoints hold the state as it is held (bf16 state writes bf16 shards). A load gives every
per-element state tensor the dtype of the loading run: fp32 state loaded into a bf16-state run
is rounded once, bf16 state loaded into an fp32-state run widens exactly, and the export to a
plain torch file widens to fp32, which is what ``torch.optim`` steps. Scaled state is written
as its values and, beside them under ``key + EXPONENTS``, each element's int8 exponent: both
are per-element tensors, which load at any DP size, bucket size or TP layout as all per-element
state does (1 more byte per element on disk, and a transient of as much while saving). A load
dequantizes them exactly and quantizes with its own blocks: exact at the saving layout (and
into fp32 state); at another DP or bucket size the blocks start elsewhere, and an element is
rounded once more where its new block's scale is larger than its old one's (a new block that
joins parts of two old blocks of different scales).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..options import StateDtype, check_state_dtype
from .block_scaling import (
    DEFAULT_BLOCK_SIZE,
    dequantize,
    element_exponents,
    narrow,
    needs_scales,
    pow2,
    quantize,
)
from .kinds import StateKey, state_keys

BLOCK_EXPONENTS = ".block_exponents"
"""Suffix of the state key that holds the int8 exponents of a scaled key's blocks."""
EXPONENTS = ".exponents"
"""Suffix of the key that holds a scaled key's exponents per element, in state dicts and
checkpoints (layout independent)."""


def resolve_state_dtypes(
    state_dtype: StateDtype, classes: Iterable[type[torch.optim.Optimizer]]
) -> dict[str, torch.dtype]:
    """The dtype of each per-element state key of ``classes`` that is not held in fp32.

    Raises for a key none of the classes keeps; the same verdict on every rank, before any
    collective.
    """
    check_state_dtype(state_dtype)
    if state_dtype is None:
        return {}
    classes = list(dict.fromkeys(classes))
    known: dict[str, list[tuple[type, StateKey]]] = {}
    open_ended = False  # a registered class whose keys distopt does not know
    for cls in classes:
        keys = state_keys(cls)
        if keys is None:
            open_ended = True
            continue
        for key in keys:
            known.setdefault(key.name, []).append((cls, key))
    if isinstance(state_dtype, Mapping):
        unknown = sorted(k for k in state_dtype if k not in known)
        if unknown and not open_ended:
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"state_dtype names {unknown}, not a state key of {names}, whose per-element "
                f"state keys are {sorted(known)}: name those, or pass one dtype for all"
            )
        dtypes = dict(state_dtype)
    else:
        dtypes = dict.fromkeys(known, state_dtype)
    return {k: d for k, d in dtypes.items() if d != torch.float32}


def resolve_block_size(state_block_size: int | None, dtypes: Mapping[str, torch.dtype]) -> int:
    """Elements per scale; raises where a block size is given but no key is held in a dtype
    with scales (bf16 and fp32 need none)."""
    if state_block_size is None:
        return DEFAULT_BLOCK_SIZE
    if not any(needs_scales(d) for d in dtypes.values()):
        held = sorted({str(d).removeprefix("torch.") for d in dtypes.values()}) or ["float32"]
        raise ValueError(
            f"state_block_size={state_block_size} sets the scales of state held in fp16 or fp8, "
            f"but the state is held in {', '.join(held)}, which needs no scales: drop "
            "state_block_size, or hold the state in torch.float16 or torch.float8_e4m3fn"
        )
    return state_block_size


def check_rounding(state_rounding: str, dtypes: Mapping[str, torch.dtype]) -> None:
    """Stochastic rounding needs some state held below fp32."""
    if state_rounding == "stochastic" and not dtypes:
        raise ValueError(
            "state_rounding='stochastic' rounds state narrowed to state_dtype, but all state is "
            "held in fp32: pass state_dtype (e.g. torch.float8_e5m2) or drop state_rounding"
        )


class StatePrecision:
    """The dtypes per-element state is held in, and the conversions around an inner step."""

    def __init__(self, state: dict[nn.Parameter, dict[str, Any]],
                 dtypes: Mapping[str, torch.dtype],
                 block_size: int = DEFAULT_BLOCK_SIZE, stochastic: bool = False) -> None:
        self.state = state  # the inner optimizers' one state dict (optim/base.py)
        self.dtypes = dict(dtypes)
        self.block_size = block_size
        self.stochastic = stochastic
        # One stream per device, seeded alike on every rank: replicas of a shard (a
        # hierarchical mesh) draw the same numbers and stay equal.
        self._generators: dict[torch.device, torch.Generator] = {}

    @contextlib.contextmanager
    def fp32(self, mains: list[nn.Parameter]) -> Iterator[None]:
        """Inside the block the state of ``mains`` is fp32 (copies); after it, held again."""
        held = self._widen_all(mains)
        try:
            yield
        finally:
            self._narrow_all(mains, held)

    def held_dtype(self, key: str) -> torch.dtype:
        return self.dtypes.get(key, torch.float32)

    def hold(self, main: nn.Parameter, entries: dict[str, Any]) -> dict[str, Any]:
        """Loaded state entries of ``main`` in the dtypes this run holds (fp32 for the keys
        not named): rounded once, or widened exactly; scaled values with their per-element
        exponents are dequantized first."""
        for key in [k for k in entries if k.endswith(EXPONENTS)]:
            exponents = entries.pop(key)
            name = key.removesuffix(EXPONENTS)
            entries[name] = scaled_values(entries[name], exponents)
        self._narrow(main, entries)
        return entries

    def saved(self, main: nn.Parameter, entries: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``main`` as state dicts and checkpoints hold them: each scaled
        key's block exponents as one exponent per element (new tensors)."""
        out = {}
        for key, value in entries.items():
            if key.endswith(BLOCK_EXPONENTS):
                name = key.removesuffix(BLOCK_EXPONENTS)
                numel = entries[name].numel()
                value = element_exponents(value, numel, self.block_size).view(main.shape)
                key = name + EXPONENTS
            out[key] = value
        return out

    def _widen_all(self, mains: list[nn.Parameter]) -> dict[tuple[int, str], torch.Tensor]:
        """Widen the state of ``mains`` to fp32; return the unscaled held tensors by (id of
        their entries, key), for ``_narrow_all`` to round the stepped state back into."""
        held: dict[tuple[int, str], torch.Tensor] = {}
        plain: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for main in mains:
            entries = self.state.get(main)
            for key, value in _per_element(main, entries):
                exponents = entries.pop(key + BLOCK_EXPONENTS, None)
                if exponents is not None:
                    entries[key] = dequantize(value, exponents, self.block_size)
                elif value.dtype != torch.float32:
                    plain.append((entries, key, value))
                    held[id(entries), key] = value
        if plain:
            # One fp32 block for the chunk and one copy kernel for all of its tensors: a
            # chunk of many small params pays no allocation and dispatch per tensor.
            values = [value for _, _, value in plain]
            flat = torch.empty(sum(v.numel() for v in values), dtype=torch.float32,
                               device=values[0].device)
            wide = [piece if v.dim() == 1 else piece.view(v.shape) for piece, v in
                    zip(flat.split([v.numel() for v in values]), values, strict=True)]
            torch._foreach_copy_(wide, values)
            for (entries, key, _), value in zip(plain, wide, strict=True):
                entries[key] = value
        return held

    def _narrow_all(self, mains: list[nn.Parameter],
                    held: dict[tuple[int, str], torch.Tensor]) -> None:
        """Narrow the stepped state of ``mains`` back: unscaled state rounded to nearest into
        the tensors it was held in (new ones for state the step created), in one copy kernel;
        the rest one tensor at a time. Either way each element is rounded once, to the same
        bits as ``.to``."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for main in mains:
            entries = self.state.get(main)
            for key, value in _per_element(main, entries):
                dtype = self.held_dtype(key)
                if value.dtype == dtype:
                    continue
                if needs_scales(dtype) or dtype == torch.float32 or self.stochastic:
                    self._narrow_one(main, entries, key, value, dtype)
                    continue
                target = held.get((id(entries), key))
                if target is None or target.dtype != dtype or target.shape != value.shape:
                    target = torch.empty_like(value, dtype=dtype)
                targets.append(target)
                sources.append(value)
                entries[key] = target
        if targets:
            torch._foreach_copy_(targets, sources)  # round to nearest even, as ``.to``

    def _narrow(self, main: nn.Parameter, entries: dict[str, Any] | None) -> None:
        for key, value in _per_element(main, entries):
            dtype = self.held_dtype(key)
            if value.dtype != dtype:
                self._narrow_one(main, entries, key, value, dtype)

    def _narrow_one(self, main: nn.Parameter, entries: dict[str, Any], key: str,
                    value: torch.Tensor, dtype: torch.dtype) -> None:
        if needs_scales(dtype):
            values, exponents = quantize(value.reshape(-1).float(), dtype, self.block_size,
                                         self._generator(value.device))
            entries[key] = values.view(main.shape)
            entries[key + BLOCK_EXPONENTS] = exponents
        elif dtype == torch.float32:
            entries[key] = value.float()  # widened exactly
        else:
            entries[key] = narrow(value.float(), dtype, self._generator(value.device))

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if not self.stochastic:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(0)
        return self._generators[device]


def scaled_values(values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The fp32 values of scaled state held as ``values`` with one exponent per element (as
    state dicts and checkpoints hold it); a new tensor."""
    return values.float() * pow2(exponents.reshape(values.shape))


def _per_element(main: nn.Parameter, entries: dict[str, Any] | None
                 ) -> list[tuple[str, torch.Tensor]]:
    """The per-element float state tensors among ``entries`` (a list: callers change the dict)."""
    if not entries:
        return []
    return [(key, value) for key, value in entries.items()
            if isinstance(value, torch.Tensor) and value.dim() >= 1
            and value.shape == main.shape and value.is_floating_point()]
