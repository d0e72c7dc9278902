"""distopt's modules import each other one way: the import graph of src/distopt is acyclic, and
every import runs down distopt's layers.

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

``LAYERS`` lists the layers, lowest first, as docs/design.md does. A layer is a set of
distopt's top-level modules and subpackages (``"ddp"`` is every module under distopt/ddp/,
``"__init__"`` the package itself). A module imports modules of its own layer (acyclically)
and of the layers below it, never of a layer above: where a lower layer needs something of a
higher one, the higher one hands it down when it is imported ([Note: one-way imports] in
checkpoint/__init__.py). A module that no layer names fails the test, so that a new one is
placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: list[tuple[str, ...]] = [
    # the package's plumbing: its version and install name, the extras' check, torch's import,
    # the ranks' fork server and frozen heap, the host memory given back
    ("_version", "_extras", "_torch_import", "_forkserver", "_frozen_heap", "host_memory"),
    ("dtypes", "sharding", "options"),  # dtype names, the sharding strategy, options checked
    ("layout",),  # bucket and shard arithmetic, no communication
    ("comm",),  # collectives
    ("parallel",),  # process groups, meshes, tensor and expert parallelism
    ("cross_rank",),  # what every rank must build alike
    ("ddp",),  # the data-parallel runtime
    ("optim",),  # the optimizers
    ("checkpoint",),  # saves, loads, exports and the optimizers' state dicts
    ("pipelining", "memory", "plan"),  # pipeline stages, the memory theory, the plans
    ("__init__",),  # the public names of ``import distopt``
    ("integrations",),  # the Trainer's and Lightning's doors
    ("train",),  # distopt train and its demo GPT
    ("bench",),  # distopt bench
    ("cli", "__main__"),  # the commands
]
"""distopt's layers, lowest first: top-level modules and subpackages of src/distopt."""

DDP_ROOMS: list[tuple[str, ...]] = [
    ("state", "agreements", "param_owners"),  # the step states, the agreements, the owners
    ("buffers",),  # where params and grads live
    ("grads", "params", "torch_compat"),  # the grad path, sharded params, torch's spellings
    # the wrapper's assembly
    ("construction", "buffer_layout", "module_buffers", "module_params", "stage_methods",
     "tied", "whole_tensor_params", "wrapper", "__init__"),
]
"""The rooms of distopt/ddp/, lowest first, as its ``__init__`` lists them: modules and
subpackages of the ddp package. Rooms of one row do not import each other either."""


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


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index in ``layers`` of the layer that holds ``module``, or None."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next((index for index, layer in enumerate(layers) if top in layer), None)


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Every import of ``graph`` from a lower layer to a higher one, as ``importer -> imported``
    (each module in some layer)."""
    level = {module: layer_of(module, layers) for module in graph}
    return [f"{importer} -> {imported}" for importer in sorted(graph)
            for imported in sorted(graph[importer]) if level[imported] > level[importer]]


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


def test_imports_run_down_the_layers():
    graph = import_graph(SRC)
    unplaced = sorted(module for module in graph if layer_of(module, LAYERS) is None)
    assert not unplaced, "modules in no layer of LAYERS: " + ", ".join(unplaced)
    tops = {module.split(".")[1] if "." in module else "__init__" for module in graph}
    stale = sorted(name for layer in LAYERS for name in layer if name not in tops)
    assert not stale, "LAYERS names what distopt does not hold: " + ", ".join(stale)
    upward = upward_imports(graph, LAYERS)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def ddp_room_of(module: str) -> str | None:
    """The room of distopt/ddp/ that holds ``module`` (None outside ddp/)."""
    parts = module.split(".")
    if parts[:2] != ["distopt", "ddp"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def ddp_imports_against_the_rooms(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` between rooms of ddp/ that do not run down ``DDP_ROOMS``
    (the assembly's row may import within itself)."""
    row = {room: index for index, rooms in enumerate(DDP_ROOMS) for room in rooms}
    top = len(DDP_ROOMS) - 1
    against = []
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            a, b = ddp_room_of(importer), ddp_room_of(imported)
            if a and b and a != b and row[b] >= row[a] and not row[a] == row[b] == top:
                against.append(f"{importer} -> {imported}")
    return against


def test_the_rooms_of_ddp_import_downward():
    graph = import_graph(SRC)
    rooms = {ddp_room_of(m) for m in graph} - {None}
    named = {room for rooms in DDP_ROOMS for room in rooms}
    assert rooms == named, f"rooms of ddp/ not in DDP_ROOMS, or gone: {rooms ^ named}"
    against = ddp_imports_against_the_rooms(graph)
    assert not against, "imports inside ddp/ that do not run down its rooms: " + ", ".join(
        against)


def test_the_rooms_catch_an_import_up_or_across():
    graph = {"distopt.ddp.buffers.bucket": {"distopt.ddp.grads.grad_sync", "distopt.ddp.state"},
             "distopt.ddp.grads.grad_sync": {"distopt.ddp.params.param_unshard"},
             "distopt.ddp.params.param_unshard": {"distopt.ddp.buffers.bucket"},
             "distopt.ddp.wrapper": {"distopt.ddp.construction"},
             "distopt.ddp.construction": set(), "distopt.ddp.state": set()}
    assert ddp_imports_against_the_rooms(graph) == [
        "distopt.ddp.buffers.bucket -> distopt.ddp.grads.grad_sync",
        "distopt.ddp.grads.grad_sync -> distopt.ddp.params.param_unshard"]


def test_the_layers_catch_an_upward_import(tmp_path):
    package = tmp_path / "distopt"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("from .high import g\n")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from ..high import g\n    return g\n")
    (package / "low" / "b.py").write_text("")
    (package / "high.py").write_text("from .low import b\n\ng = b\n")
    graph = import_graph(tmp_path)
    layers = [("low",), ("high",), ("__init__",)]
    assert upward_imports(graph, layers) == ["distopt.low.a -> distopt.high"]
    # within one layer the same import is allowed; the cycle check covers it
    assert upward_imports(graph, [("low", "high"), ("__init__",)]) == []
    assert layer_of("distopt.other", layers) is None


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
