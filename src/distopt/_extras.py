"""What distopt's applications need beyond torch: the ``train`` extra.

The library needs only torch. ``distopt train`` draws a progress bar (tqdm) and a loss plot
(matplotlib), ``distopt bench`` a bar chart (matplotlib); ``pip install 'torch-distopt[train]'``
installs both. The commands look for these packages before they start anything, so that a
missing one costs one line of error up front, not a traceback at the end of a run or from
every rank.

The command line (``cli/``) checks before it imports a command; ``torchrun -m distopt.train``
and ``python -m distopt.train.launch`` start without it and check for themselves, and
``distopt bench`` looks for its peers' packages the same way. Those applications sit below the
command line in distopt's layers (docs/design.md), so the check lives in the lowest layer,
beside the install name it prints.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from ._version import pip_install

TRAIN_NEEDS = ("matplotlib", "tqdm")
"""Imported by ``distopt train``'s rank 0: the loss plot and the progress bar."""
BENCH_NEEDS = ("matplotlib",)
"""Imported by ``distopt bench``: the bar chart."""
FT_NEEDS = ("torchft",)
"""Imported by ``distopt train --ft-groups``: the Manager, its process group, the Lighthouse."""


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    return importlib.util.find_spec(module) is not None


def missing(modules: Sequence[str]) -> list[str]:
    """The top-level ``modules`` that are not installed, without importing any of them."""
    return [module for module in modules if not _installed(module)]


def require(command: str, modules: Sequence[str], extra: str = "train") -> None:
    """Exit with status 1 and one line naming what ``command`` lacks and how to install it."""
    absent = missing(modules)
    if absent:
        raise SystemExit(
            f"{command}: needs {' and '.join(absent)} (not installed): {pip_install(extra)}"
        )
