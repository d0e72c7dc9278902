"""Checks in flight that distopt's next collective waits for.

A check whose collective is started and not waited for (the forward check of sharded params,
[Note: every rank runs every forward] in ddp/params/forward_check.py) leaves here what settles it:
waiting for its collective and raising, on every rank alike, where the ranks disagree. Every
collective distopt starts settles the checks held first, so a check's round trip overlaps
whatever runs before the next collective (a gather already in flight, a backward's compute
up to its first reduction) while no collective of distopt's can start on ranks that parted.
"""

from __future__ import annotations

from collections.abc import Callable

_held: list[Callable[[], None]] = []


def hold(settle: Callable[[], None]) -> None:
    """Keep ``settle`` until distopt's next collective (or the next ``settle()``)."""
    _held.append(settle)


def settle() -> None:
    """Run every check held, oldest first; a check that raises is not run again."""
    while _held:
        _held.pop(0)()
