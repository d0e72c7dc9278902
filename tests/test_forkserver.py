"""Ranks forked from the library's fork server (the test pools' ranks are): what the server
imported is frozen out of the rank's garbage collections, and the collector still frees what
the rank makes. See [Note: a frozen preload] in src/distopt/_forkserver.py."""

from __future__ import annotations

import gc
import weakref

import torch

from dist_harness import case_result, run_cases


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def collections_in_a_rank() -> dict:
    freed = []
    cycle = _Cycle()
    weak = weakref.ref(cycle, lambda _: freed.append(True))
    del cycle  # unreachable now, but only a collection frees a cycle
    found = gc.collect()
    tracked = gc.get_objects()
    return {
        "frozen": gc.get_freeze_count(),
        # A function of torch's, imported by the server: frozen, so no longer listed.
        "torch_function_tracked": any(o is torch.nn.functional.relu for o in tracked),
        "freed_cycle": bool(freed) and weak() is None and found >= 1,
    }


def test_the_preload_is_frozen_and_new_garbage_is_still_collected():
    for value in case_result(run_cases(2, [("gc", collections_in_a_rank, ())]), "gc"):
        assert value["frozen"] > 100_000  # torch alone is some 280,000 objects
        assert not value["torch_function_tracked"]
        assert value["freed_cycle"]
