"""Session-wide fixtures: the worker pools of dist_harness live until the session ends; the
launches of early_launches start once the tests are collected."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

import cpu_report
import early_launches
from dist_harness import SESSION_TMP, close_pools, context


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", action="store_true",
                     help="at the end, how busy the cores were and what the pools used "
                          "(tests/cpu_report.py)")


def pytest_configure(config: pytest.Config) -> None:
    cpu_report.start()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Make the session's temporary directory, which the test processes inherit, and start
    their fork server now, so that its imports (torch, distopt, the integrations' frameworks:
    seconds of CPU) run while pytest collects, on the other core."""
    from multiprocessing import forkserver

    os.environ[SESSION_TMP] = tempfile.mkdtemp(prefix="distopt-tests-")
    context()  # sets the modules the server preloads
    forkserver.ensure_running()


@pytest.fixture(scope="session", autouse=True)
def _worker_pools() -> Iterator[None]:
    """Keep the spawned gloo groups of every world size alive across test modules."""
    yield
    close_pools()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected tests' launches (see early_launches.py) while the others run."""
    if not session.config.option.collectonly:
        early_launches.start_for(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    early_launches.stop_all()
    shutil.rmtree(os.environ.pop(SESSION_TMP), ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.getoption("--cpu-report"):
        terminalreporter.section("CPU")
        for line in cpu_report.lines():
            terminalreporter.write_line(line)
