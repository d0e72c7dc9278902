"""Session-wide fixtures: the worker pools of dist_harness live until the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dist_harness import close_pools


@pytest.fixture(scope="session", autouse=True)
def _worker_pools() -> Iterator[None]:
    """Keep the spawned gloo groups of every world size alive across test modules."""
    yield
    close_pools()
