"""The collectives a DDP runs every step that carry no gradient or param bytes, by name, and a
switch, private to distopt's benchmarks, that builds DDPs without them.

Two promises cost a collective each time they are kept: a read of ``p.grad`` on one rank
communicates nothing, so each backward's grad statistics are agreed over the ranks in advance
([Note: p.grad under distopt] in ddp/grads/grad_marker.py); and a forward on one rank alone under
sharded params is refused on every rank instead of hanging, so each forward and backward starts
with a check ([Note: every rank runs every forward] in ddp/params/forward_check.py). ``OPS`` names
them in ``CommStats``, so that ``distopt bench`` reports the time a step spends in them apart from
its reductions and gathers, and ``benchmarks/agreements.py`` times the same steps with and without
them (``without()``) side by side. A DDP built inside ``without()`` refuses every ``p.grad`` read
and checks no forward; it is for measuring, never for training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

GRAD_STATISTICS = "agree_grad_statistics"
FORWARD_CHECK = "forward_check"
OPS = (GRAD_STATISTICS, FORWARD_CHECK)
"""The ``CommStats`` op names of the agreements."""

_enabled = True


def enabled() -> bool:
    """Whether a DDP built now runs the agreements (always, outside ``without()``)."""
    return _enabled


@contextlib.contextmanager
def without() -> Iterator[None]:
    """DDPs built inside run no agreements: for benchmarks that measure what they cost."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
