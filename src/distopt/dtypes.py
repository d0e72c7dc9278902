"""The dtypes distopt trains in, by the short names its commands and configs use."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

STATE_DTYPES: dict[str, torch.dtype] = {
    **DTYPES,
    "fp8-e4m3": torch.float8_e4m3fn,
    "fp8-e5m2": torch.float8_e5m2,
}
"""The dtypes optimizer state can be held in (``--state-dtype``), by short name."""


def parse_state_dtype(text: str) -> torch.dtype | dict[str, torch.dtype]:
    """``--state-dtype``: one short name (``fp8-e4m3``), or one per state key
    (``exp_avg=fp8-e4m3,exp_avg_sq=fp8-e5m2``). Raises ValueError naming the bad part."""
    if "=" not in text:
        if text not in STATE_DTYPES:
            raise ValueError(f"must be one of {', '.join(STATE_DTYPES)} or key=name pairs "
                             f"(exp_avg=bf16,exp_avg_sq=fp8-e5m2), got {text}")
        return STATE_DTYPES[text]
    per_key = {}
    for part in text.split(","):
        key, _, name = part.partition("=")
        if not key or name not in STATE_DTYPES:
            raise ValueError(f"'{part}' is not key=name with a name of "
                             f"{', '.join(STATE_DTYPES)}")
        per_key[key] = STATE_DTYPES[name]
    return per_key


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of one of ``DTYPES``' dtypes: ``torch.bfloat16`` -> ``"bf16"``."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
