"""The argument types ``distopt memory``'s parsers share."""

from __future__ import annotations

import argparse


def positive_count(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number (e.g. 7e9)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value
