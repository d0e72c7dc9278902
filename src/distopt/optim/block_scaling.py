"""Flat fp32 tensors as fp16 or fp8 values with one power-of-two scale per block of elements.

Pure tensor arithmetic, no torch.distributed; the rules and their reasons are in
[Note: state precision] (optim/state_precision.py). A tensor of ``n`` elements is cut into
blocks of ``block_size`` elements from its first (the last block may be shorter); block ``b``
is held as ``values[b] = round(x[b] / 2**k[b])`` in the narrow dtype, with ``k[b]`` the
smallest exponent that keeps the block's largest magnitude within the dtype's max, stored as
one int8. Dividing by a power of two is exact, so the one rounding is the cast to the narrow
dtype (to nearest, ties to even), and ``values * 2**k`` gives the held numbers back exactly.
"""

from __future__ import annotations

import math

import torch

SCALED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
"""Dtypes held with block scales: their range is too narrow for state as it comes."""

DEFAULT_BLOCK_SIZE = 32
"""Elements per scale: one int8 per 32 elements costs 1/32 B per element (3.1% of fp8's
byte); why 32 and not 128 is measured in [Note: state precision]."""

# Exponents of the scale, kept where 2**k and 2**-k are both normal fp32 numbers.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126


def needs_scales(dtype: torch.dtype) -> bool:
    """Whether state held in ``dtype`` is held with block scales."""
    return dtype in SCALED_DTYPES


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def pow2(exponents: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponents`` in fp32, exactly: the exponent written into the float's bits."""
    biased = exponents.to(torch.int32) + 127
    return torch.bitwise_left_shift(biased, 23).view(torch.float32)


def block_exponents(flat: torch.Tensor, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """The int8 scale exponent of each block of the fp32 1-D ``flat`` for ``dtype``: the
    smallest ``k`` with ``absmax / 2**k <= max of dtype``."""
    absmax = _per_block(flat.abs(), block_size, lambda blocks: blocks.amax(dim=1))
    # absmax = m * 2**e and max = fm * 2**fe, mantissas in [0.5, 1): k = e - fe, plus one
    # when m > fm. Zero and nan blocks get k = -fe (any scale holds them).
    mantissa, exponent = torch.frexp(absmax)
    max_mantissa, max_exponent = math.frexp(torch.finfo(dtype).max)
    k = exponent - max_exponent + (mantissa > max_mantissa).to(torch.int32)
    return k.clamp_(_MIN_EXPONENT, _MAX_EXPONENT).to(torch.int8)


def quantize(flat: torch.Tensor, dtype: torch.dtype, block_size: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, exponents)``: the fp32 1-D ``flat`` in ``dtype`` and its blocks' scale
    exponents (int8, one per block); rounded to nearest, or stochastically with
    ``generator``."""
    exponents = block_exponents(flat, dtype, block_size)
    scaled = scale_blocks(flat, pow2(-exponents), block_size)
    return narrow(scaled, dtype, generator), exponents


def narrow(x: torch.Tensor, dtype: torch.dtype,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` (within ``dtype``'s range) in ``dtype``: to nearest (ties to even), or with
    ``generator`` stochastically: to the neighbour on the far side of ``x`` with probability
    its share of the gap, so that the expected value is ``x``."""
    nearest = x.to(dtype)
    if generator is None:
        return nearest
    back = nearest.float()
    # The dtype's next value away from `nearest`, on x's side: one step of the bit pattern
    # (sign and magnitude), up in magnitude where |x| > |nearest|; from zero, x's sign.
    bits = nearest.view(torch.int8 if dtype.itemsize == 1 else torch.int16)
    step = torch.where(x.abs() > back.abs(), 1, -1).to(bits.dtype)
    smallest = torch.where(x < 0, torch.iinfo(bits.dtype).min + 1, 1).to(bits.dtype)
    other_bits = torch.where(back == 0, smallest, bits + step)
    other = other_bits.view(dtype).float()
    gap = (other - back).abs()
    share = torch.where(gap > 0, (x - back).abs() / gap, torch.zeros_like(gap))
    up = torch.rand(x.shape, generator=generator, device=x.device) < share
    return torch.where(up & torch.isfinite(other), other_bits, bits).view(dtype)


def dequantize(values: torch.Tensor, exponents: torch.Tensor, block_size: int) -> torch.Tensor:
    """The fp32 numbers held as ``values`` (any shape, flattened into blocks) and their
    blocks' ``exponents``; a new tensor of ``values``' shape."""
    flat = values.reshape(-1).float()
    return scale_blocks(flat, pow2(exponents), block_size).view(values.shape)


def scale_blocks(flat: torch.Tensor, factors: torch.Tensor, block_size: int) -> torch.Tensor:
    """A new fp32 tensor: each block of the 1-D ``flat`` times its factor."""
    out = torch.empty_like(flat, dtype=torch.float32)
    full = flat.numel() - flat.numel() % block_size
    whole = full // block_size
    torch.mul(flat[:full].view(whole, block_size), factors[:whole, None],
              out=out[:full].view(whole, block_size))
    if full < flat.numel():
        torch.mul(flat[full:], factors[whole], out=out[full:])
    return out


def element_exponents(exponents: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """Each element's scale exponent (int8), for a form that does not know the blocks."""
    return exponents.repeat_interleave(block_size)[:numel]


def _per_block(flat: torch.Tensor, block_size: int, reduce) -> torch.Tensor:
    full = flat.numel() - flat.numel() % block_size
    parts = [reduce(flat[:full].view(-1, block_size))]
    if full < flat.numel():
        parts.append(reduce(flat[full:].view(1, -1)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]
