"""Session-wide fixtures: the worker pools of dist_harness live until the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dist_harness import close_pools, context


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the test processes' fork server now, so that its imports (torch, distopt, the
    integrations' frameworks: seconds of CPU) run while pytest collects, on the other core."""
    from multiprocessing import forkserver

    context()  # sets the modules the server preloads
    forkserver.ensure_running()


@pytest.fixture(scope="session", autouse=True)
def _worker_pools() -> Iterator[None]:
    """Keep the spawned gloo groups of every world size alive across test modules."""
    yield
    close_pools()
