"""Every module of the package stays small enough to read in one sitting: at most
``MAX_LINES`` lines. A module that grows past it is split along the seams its code already has
(docs/design.md, "The objects"), not trimmed of comments."""

from __future__ import annotations

from pathlib import Path

import distopt

MAX_LINES = 500
PACKAGE = Path(distopt.__file__).parent


def modules_over(root: Path, limit: int) -> dict[str, int]:
    """The modules under ``root`` longer than ``limit`` lines, with their lengths."""
    sizes = {str(path.relative_to(root)): len(path.read_text().splitlines())
             for path in root.rglob("*.py")}
    return {name: n for name, n in sorted(sizes.items()) if n > limit}


def test_no_module_is_over_the_limit():
    over = modules_over(PACKAGE, MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines: {over}; split each along its seams"


def test_the_check_names_each_long_module(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert modules_over(tmp_path, MAX_LINES) == {"sub/long.py": MAX_LINES + 1}
