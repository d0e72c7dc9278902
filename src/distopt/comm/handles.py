"""Handles of collectives: one that needed no communication, and one of several messages with a
last local step (what the point-to-point algorithms of gloo.py and the fp32 sums return)."""

from __future__ import annotations


class _Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class _Composite:
    """Handle of several collectives, with a last local step run once all have finished."""

    __slots__ = ("_works", "_then")

    def __init__(self, works: list, then=None) -> None:
        self._works, self._then = works, then

    def wait(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def finish(self, async_op: bool) -> _Composite | None:
        """The handle for an async call; a synchronous one waits now and returns None, as
        torch.distributed does."""
        if async_op:
            return self
        self.wait()
        return None
