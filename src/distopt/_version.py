"""distopt's version and the name it is installed under, each defined here only.

pyproject.toml reads ``__version__`` from this file when the package is built (statically,
without importing distopt or torch), so the wheel's metadata, ``distopt.__version__`` and
``distopt --version`` cannot disagree. CHANGELOG.md says what each version added.
"""

from __future__ import annotations

__version__ = "0.4.0"

DISTRIBUTION = "torch-distopt"
"""The name on the package index (``pip install torch-distopt``, once published); the import
name and the command stay ``distopt``. The index's ``distopt`` is an unrelated project."""


def pip_install(extra: str | None = None) -> str:
    """The commands that install distopt, or distopt with ``extra``: by its name on the package
    index, and in a clone of the source (where it installs from until it is published)."""
    if extra is None:
        return f"pip install {DISTRIBUTION} (in a clone: pip install -e .)"
    return f"pip install '{DISTRIBUTION}[{extra}]' (in a clone: pip install -e '.[{extra}]')"
