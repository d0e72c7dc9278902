"""The dtypes distopt trains in, by the short names its commands and configs use."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of one of ``DTYPES``' dtypes: ``torch.bfloat16`` -> ``"bf16"``."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
