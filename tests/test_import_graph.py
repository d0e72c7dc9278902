"""distopt's modules import each other one way: the import graph of src/distopt is acyclic.

The graph is read from the source with ``ast``, so it sees every import statement at any depth:
one deferred into a function to get past a cycle at import time still closes the cycle here.
Imports under ``if TYPE_CHECKING:`` count too. They never run, so they cannot cycle at run
time, but a module that needs another's names even for its annotations depends on it; counting
them keeps the rule one sentence long, and distopt needs no such import against the grain.

An edge goes to the module an import names: ``from .checkpoint import files`` to
``distopt.checkpoint.files``, ``from .checkpoint import save_checkpoint`` to the package
``distopt.checkpoint`` (its ``__init__``). The parent packages Python imports on the way are
not edges: a package's ``__init__`` importing its own submodules would otherwise close a
cycle with every one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_names(src: Path) -> dict[str, Path]:
    """Every module of the distopt package: dotted name -> file."""
    modules = {}
    for path in sorted((src / "distopt").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The distopt modules that module ``name`` (at ``path``) imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".")
                if not is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(src: Path) -> dict[str, set[str]]:
    modules = module_names(src)
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Some cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_is_acyclic():
    graph = import_graph(SRC)
    # the walk found the package
    assert "distopt.optim.optimizers" in graph and "distopt.ddp.wrapper" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_deferred_and_relative_imports(tmp_path):
    package = tmp_path / "distopt"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("def f():\n    from .sub import b\n    return b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
    )
    graph = import_graph(tmp_path)
    assert graph == {
        "distopt": {"distopt.a"},
        "distopt.a": {"distopt.sub.b"},
        "distopt.sub": set(),
        "distopt.sub.b": {"distopt.a"},
    }
    assert find_cycle(graph) == ["distopt.a", "distopt.sub.b", "distopt.a"]
