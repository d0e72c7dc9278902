"""fp32 masters kept as a bf16 param and an int16 remainder (``store_param_remainders``)."""

from __future__ import annotations

import torch

# [Note: param remainders]
# With ``store_param_remainders`` (bf16 params only) a rank keeps no fp32 main params: the bf16
# model param holds the high 16 bits of each fp32 master and an int16 remainder the low 16, so
# the two together are the fp32 master, bit for bit, at 2 bytes per owned element instead of 4.
# The step rebuilds the fp32 masters of one bucket's shard at a time (a transient of one
# bucket), steps that bucket's pieces, and splits the result back before the next bucket.
# bf16/fp16 grads get their fp32 copies the same way, so no fp32 main grads are kept either
# (main params have no ``.grad`` between steps). What the step needs of all grads before
# changing any param (the loss scaler's inf verdict, the global norm for clipping) comes from
# a first pass over the buckets, each bucket's grads copied to fp32, unscaled and their norms
# taken, then dropped; the second pass copies and unscales again (the same bits), clips with
# the global coefficient, counts zeros and steps. The inner optimizer is element-wise and
# counts ``step`` per param, so stepping one bucket's pieces at a time is the fp32-master
# path's step, bit for bit; the norms are summed in the fp32-master path's order. The peak
# of a step is then one bucket shard's fp32 masters and fp32 grads and the inner optimizer's
# temporaries of that bucket (AdamW's foreach step: one more fp32 tensor), against the
# fp32-master path's temporaries of the whole shard; docs/mixed-precision.md has the numbers.
# Splitting cannot use the fp32-master path's cast (round to nearest, ties to even): at an
# exact tie (low half 0x8000) rounding down would leave a remainder of +0x8000, one past what
# an int16 holds. The split rounds to nearest with ties away from zero instead: a low half of
# 0x8000 or more adds one to the high half (bf16 is sign and magnitude, so one more is one ulp
# further from zero) and leaves the remainder low - 0x10000 in [-0x8000, -1]; a lower
# one is kept as is, in [0, 0x7fff]. So the model param equals the fp32-master path's cast
# except at exact ties whose high half is even, where it is one ulp further from zero; the
# fp32 master is the same, and so is every later step given the same grads (in training the
# next forward sees the tie's param, so the grads differ a little from then on;
# docs/mixed-precision.md measures how much). Between steps the main params are
# placeholders (a zero-stride view of one scalar): read the masters with
# ``opt.main_param_values()``; checkpoints read and write them inside
# ``opt.main_params_materialized()``, so a checkpoint holds fp32 masters either way and loads
# into an optimizer with or without the option. A plain checkpoint's fp32 weights load as the
# masters, and every rank rounds all of its params with ``bf16_of_fp32``, as the split does.


def split_fp32(master: torch.Tensor, high: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 ``master`` as bf16 ``high`` and int16 ``remainder``; see
    [Note: param remainders]."""
    bits = master.view(torch.int32)
    # The remainder is the low half read as an int16: low when it is below 0x8000, and
    # low - 0x10000 (what rounding the high half up leaves) when it is not. Narrowing an int32
    # keeps its low 16 bits, so this is one conversion, with no temporary.
    remainder.copy_(bits)
    # Adding 0x8000 carries into the high half exactly when low >= 0x8000. (Only NaNs with a
    # high half of 0x7fff or 0xffff wrap around, into 0x8000 and 0x0000 with a negative
    # remainder; join_fp32 wraps back to the same bits.) One int32 temporary of the shard.
    high.view(torch.int16).copy_((bits + 0x8000).bitwise_right_shift_(16))


def bf16_of_fp32(master: torch.Tensor) -> torch.Tensor:
    """The bf16 param ``split_fp32`` leaves for fp32 ``master`` (nearest, ties away from
    zero); a new tensor."""
    bits = (master.view(torch.int32) + 0x8000).bitwise_right_shift_(16)
    return bits.to(torch.int16).view(torch.bfloat16)


def join_fp32(high: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that bf16 ``high`` and int16 ``remainder`` split; a new tensor."""
    bits = high.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(remainder).view(torch.float32)
