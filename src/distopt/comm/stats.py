"""``CommStats``: what distopt's collectives did, counted and (optionally) timed."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommStats:
    """What distopt's collectives did: calls, bytes and, when ``timed``, seconds of waiting.

    Every DDP wrapper owns one (``ddp.comm_stats``) and passes it to each collective it issues,
    so tests and benchmarks count and time communication through this object alone. ``bytes``
    is the size of the full (unsharded) tensor each call covered. With ``timed`` set, each op
    also adds to ``seconds`` the time this rank spent blocked on it: a synchronous call's whole
    duration, an asynchronous one's ``wait()``; ``synchronize`` (e.g. ``torch.cuda.synchronize``)
    is called before the clock stops, so that device time is counted too. Off by default: the
    hot path then only checks one flag.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    calls_by_group: Counter = field(default_factory=Counter)
    """Calls per (op, the group's global ranks): which group each collective ran over (the
    dense data-parallel group or an expert-data-parallel one, say)."""
    timed: bool = False
    synchronize: Callable[[], Any] | None = None

    def record(self, op: str, tensor: torch.Tensor,
               group: dist.ProcessGroup | None = None) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()
        ranks = (tuple(range(dist.get_world_size())) if group is None
                 else tuple(dist.get_process_group_ranks(group)))
        self.calls_by_group[op, ranks] += 1

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()
        self.calls_by_group.clear()

    def _stop_clock(self, op: str, start: float) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.seconds[op] += time.perf_counter() - start


class _TimedWait:
    """A handle whose ``wait()`` adds the time it blocked to ``stats.seconds[op]``."""

    __slots__ = ("_handle", "_stats", "_op")

    def __init__(self, handle: Any, stats: CommStats, op: str) -> None:
        self._handle, self._stats, self._op = handle, stats, op

    def wait(self) -> Any:
        start = time.perf_counter()
        result = self._handle.wait()
        self._stats._stop_clock(self._op, start)
        return result

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def timed(stats: CommStats | None, op: str, async_op: bool, call: Callable[[], Any]) -> Any:
    """Run ``call`` (which issues collective ``op``) and time it when ``stats.timed``."""
    if stats is None or not stats.timed:
        return call()
    start = time.perf_counter()
    handle = call()
    if not async_op:
        stats._stop_clock(op, start)
        return handle
    return _TimedWait(handle, stats, op)
