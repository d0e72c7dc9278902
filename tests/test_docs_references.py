"""Every path, Note and name that README.md and docs/*.md point at exists, and every argument
of distopt's public API is described in its docstring.

Docs drift when code moves: a file renamed, a function folded into another, a Note dropped, an
argument added without a word on what it does. This test reads the markdown and the
docstrings and checks what it can check mechanically:

* file paths in backticks and markdown links (``optim/base.py``, ``tests/test_parity.py``,
  ``[docs](docs/design.md)``) name a file of the repo; a bare or partial path may be a suffix
  of one (``save.py`` is ``src/distopt/checkpoint/save.py``);
* ``[Note: ...]`` cited in a doc is defined in the code, and design.md's index names the file
  that defines each Note and lists every Note the code defines;
* a name said to be in a file ("`unscale_` in `optim/grad_stats.py`") is defined there;
* a dotted ``distopt.`` name imports;
* every argument of a public function, constructor and method is described in its docstring
  (see ``test_every_public_argument_is_described`` for what is public and what "described"
  means).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md"]
SEARCHED = ("src", "tests", "benchmarks", "examples", "docs", ".ci")
FILES = sorted(p.relative_to(ROOT).as_posix() for top in SEARCHED
               for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts)
# A module anywhere, or a path with a folder in it; bare file names (``summary.json``) and
# placeholders (``checkpoint-N/``) name what a run writes, not files of the repo.
PATH_TOKEN = re.compile(r"^[\w./-]+\.py$|^[\w.-]+/[\w./-]*$")
PLACEHOLDER = re.compile(r"-N\b|\bN/")
NOTE_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", re.M)
NOTE_CITED = re.compile(r"\[Note: ([^\]]+)\]")
NAME_IN_FILE = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?` in `([\w/]+\.py)`")


# What a folder path in a doc starts with when it names the repo's files (other paths name a
# run's output folders, checkpoint keys, ...).
REPO_FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir()} | {
    p.name for p in (ROOT / "src" / "distopt").iterdir() if p.is_dir()} | {"results"}


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def resolves(token: str) -> bool:
    """``token`` names a file or folder of the repo: as given, under src/distopt, or as the
    tail of a path."""
    token = token.rstrip("/")
    if (ROOT / token).exists() or (ROOT / "src" / "distopt" / token).exists():
        return True
    return any(f == token or f.endswith("/" + token) or f"/{token}/" in f"/{f}"
               for f in FILES)


def path_tokens(text: str) -> list[str]:
    tokens = [t for t in _code_spans(text)
              if PATH_TOKEN.match(t) and not PLACEHOLDER.search(t)
              and (t.endswith(".py") or t.split("/")[0] in REPO_FOLDERS)]
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)]
    return tokens + [link for link in links if link and "://" not in link]


def defined_notes() -> dict[str, list[str]]:
    notes: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "distopt").rglob("*.py")):
        for name in NOTE_DEFINITION.findall(path.read_text()):
            rel = path.relative_to(ROOT / "src" / "distopt").as_posix()
            notes.setdefault(name, []).append(rel)
    return notes


def defines(path: Path, name: str) -> bool:
    last = name.split(".")[-1]
    pattern = rf"^\s*(def|class|async def)\s+{re.escape(last)}\b|^\s*{re.escape(last)}\s*[:=]"
    return re.search(pattern, path.read_text(), re.M) is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_exist(doc: Path):
    text = doc.read_text()
    missing = []
    for token in path_tokens(text):
        target = (doc.parent / token) if token.startswith(("..", "./")) else None
        if target is not None and target.exists():
            continue
        if not (resolves(token) or (doc.parent / token).exists()):
            missing.append(token)
    assert not missing, f"{doc.name} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_notes_cited_are_defined(doc: Path):
    notes = defined_notes()
    cited = {" ".join(name.split()) for name in NOTE_CITED.findall(doc.read_text())} - {"..."}
    assert cited <= set(notes), f"{doc.name} cites undefined Notes: {sorted(cited - set(notes))}"


def test_notes_index_is_complete_and_points_at_the_right_files():
    notes = defined_notes()
    index = {}
    for row in re.findall(r"^\| ([^|]+?) \| (`[^|]+`) \|", (ROOT / "docs" / "design.md")
                          .read_text(), re.M):
        name, files = row
        if name.strip() in notes:
            index[name.strip()] = re.findall(r"`([^`]+)`", files)
    assert set(index) == set(notes), (
        f"Notes missing from design.md's index: {sorted(set(notes) - set(index))}")
    for name, files in index.items():
        assert set(notes[name]) <= set(files), (name, notes[name], files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_names_said_to_be_in_a_file_are_defined_there(doc: Path):
    wrong = []
    for name, rel in NAME_IN_FILE.findall(doc.read_text()):
        candidates = [ROOT / "src" / "distopt" / rel, ROOT / rel,
                      *(ROOT / f for f in FILES if f.endswith("/" + rel))]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None or not defines(path, name):
            wrong.append(f"{name} in {rel}")
    assert not wrong, f"{doc.name}: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_dotted_distopt_names_import(doc: Path):
    missing = []
    for span in _code_spans(doc.read_text()):
        if re.search(r"\.(json|py|md|pt)\b", span):
            continue  # a file name, not a module path
        for dotted in re.findall(r"\bdistopt(?:\.[A-Za-z_]\w*)+", span):
            if not _imports(dotted):
                missing.append(dotted)
    assert not missing, f"{doc.name} names what distopt does not have: {sorted(set(missing))}"


def _imports(dotted: str) -> bool:
    return _resolve(dotted) is not _MISSING


_MISSING = object()


def _resolve(dotted: str) -> object:
    """The object a dotted ``distopt.`` name reaches: the longest module prefix that imports,
    then attributes; ``_MISSING`` where there is none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return _MISSING
        return obj
    return _MISSING


def test_the_check_catches_a_wrong_path():
    assert resolves("optim/base.py") and resolves("save.py")
    assert not resolves("optim/no_such_module.py")
    assert path_tokens("see `src/distopt/parallel.py` and [x](docs/nowhere.md#a)") == [
        "src/distopt/parallel.py", "docs/nowhere.md"]


# ---------------------------------------------------------------- every public argument described

# The modules users import, each with an ``__all__``; an integration is walked where its
# framework is installed (without it the module is an ImportError that names its extra).
PUBLIC_MODULES = {
    "distopt": None,
    "distopt.pipelining": None,
    "distopt.checkpoint": None,
    "distopt.optim.recipes": None,
    "distopt.integrations.lightning": "lightning",
    "distopt.integrations.transformers": "transformers",
}
DOC_IMPORT = re.compile(r"^\s*from (distopt(?:\.\w+)*) import \(?([\w, ]+)", re.M)
ARGS_SECTION = re.compile(r"^\s*Args:\s*$", re.M)


def public_api() -> dict[str, object]:
    """Every public function and class, by the first name users reach it under: the
    ``__all__`` of ``PUBLIC_MODULES``, the names the docs import (``from distopt.X import Y``)
    and the functions the docs name by their dotted path (``distopt.memory.
    bytes_per_param_breakdown``). Classes the docs name by path alone (``ParallelGroups``, the
    demo GPT) are pointers for readers to internals, not API to call."""
    named: dict[str, object] = {}
    for module_name, framework in PUBLIC_MODULES.items():
        if framework is not None and importlib.util.find_spec(framework) is None:
            continue
        module = importlib.import_module(module_name)
        named.update((f"{module_name}.{name}", getattr(module, name)) for name in module.__all__)
    for doc in DOCS:
        text = doc.read_text()
        for module_name, names in DOC_IMPORT.findall(text):
            for name in filter(None, (n.strip() for n in names.split(","))):
                named.setdefault(f"{module_name}.{name}", _resolve(f"{module_name}.{name}"))
        for span in _code_spans(text):
            for dotted in re.findall(r"\bdistopt(?:\.[A-Za-z_]\w*)+", span):
                if inspect.isfunction(obj := _resolve(dotted)):
                    named.setdefault(dotted, obj)
    api: dict[str, object] = {}
    seen: set[int] = set()
    for name, obj in named.items():
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and id(obj) not in seen:
            seen.add(id(obj))
            api[name] = obj
    return api


def signatures(name: str, obj: object) -> Iterator[tuple[str, Callable, str]]:
    """``(qualified name, callable, docstring)`` of every callable of ``obj`` whose arguments
    users pass: a function; a class's constructor, documented in the class docstring (or its
    ``__init__``'s; a dataclass's fields also by the docstring under each field), and its
    public methods (names without a leading ``_``), each documented in its own docstring.
    Only what the class's own package defines counts: an ``__init__`` or method inherited
    from torch, Lightning or the builtins is theirs to document."""
    if not inspect.isclass(obj):
        yield name, obj, obj.__doc__ or ""
        return
    own = [k for k in obj.__mro__ if k.__module__.split(".")[0] == obj.__module__.split(".")[0]]
    init_owner = next(k for k in obj.__mro__ if "__init__" in vars(k))
    if init_owner in own:
        doc = (obj.__doc__ or "") + "\n" + (init_owner.__init__.__doc__ or "")
        if dataclasses.is_dataclass(obj):
            yield name, obj, doc + "\n" + field_docstrings(obj)
        else:
            yield name, init_owner.__init__, doc
    seen: set[str] = set()
    for klass in obj.__mro__:
        for attr, value in vars(klass).items():
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if attr.startswith("_") or attr in seen or not inspect.isfunction(function):
                continue
            seen.add(attr)
            if klass in own:
                yield f"{name}.{attr}", function, function.__doc__ or ""


def field_docstrings(cls: type) -> str:
    """The docstring under each field of a dataclass (a string right after ``name: type``,
    as DistoptArguments' fields have), as ``name: text`` lines."""
    body = _class_node(cls).body
    lines = []
    for field, after in zip(body, body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            lines.append(f"{field.target.id}: {after.value.value}")
    return "\n".join(lines)


def _class_node(cls: type) -> ast.ClassDef:
    """The definition of ``cls`` in the source: in its module, or, for a class given the name
    of the package that exports it (``FlatShard.__module__`` is distopt.checkpoint), in a
    module that holds it."""
    modules = [sys.modules[cls.__module__], *(
        module for _, module in sorted(sys.modules.items())
        if getattr(module, cls.__name__, None) is cls)]
    for module in modules:
        source = getattr(module, "__file__", None)
        for node in ast.walk(ast.parse(Path(source).read_text())) if source else ():
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                return node
    raise LookupError(f"no source defines {cls.__qualname__}")


def described(parameter: str, doc: str) -> bool:
    """Whether ``doc`` describes ``parameter``: a line that starts, after its indent, with the
    name and a colon (``name: what it does``, the entries under ``Args:``; ``*args`` and
    ``**kwargs`` with or without their stars). A docstring without an ``Args:`` section, the
    prose of a small function, may instead name it in double backticks (``name`` or
    ``name=value``); once a docstring lists its arguments, each has its entry."""
    name = re.escape(parameter)
    if re.search(rf"^\s*\*{{0,2}}{name}:", doc, re.M):
        return True
    in_prose = re.search(rf"``\*{{0,2}}{name}(=[^`]*)?``", doc)
    return not ARGS_SECTION.search(doc) and in_prose is not None


def undescribed(function: Callable, doc: str) -> list[str]:
    """The parameters of ``function`` that ``doc`` does not describe; ``self``, ``cls`` and
    private parameters (a leading ``_``, e.g. the Trainer's ``_internal_call``) need no
    entry."""
    return [p for p in inspect.signature(function).parameters
            if p not in ("self", "cls") and not p.startswith("_") and not described(p, doc)]


def test_every_public_argument_is_described():
    missing = [f"{name}({parameter})"
               for api_name, obj in public_api().items()
               for name, function, doc in signatures(api_name, obj)
               for parameter in undescribed(function, doc)]
    assert not missing, (
        f"{len(missing)} public argument(s) with no description in their docstring (an entry "
        f"'name: what it does' under Args:): {', '.join(missing)}")


def test_the_api_walk_reaches_constructors_methods_and_fields():
    api = public_api()
    assert {"distopt.DistributedDataParallel", "distopt.save_checkpoint",
            "distopt.pipelining.PipelineStage", "distopt.optim.recipes.muon_param_groups",
            "distopt.checkpoint.merge_state_dicts"} <= set(api)
    walked = {name for api_name, obj in api.items() for name, _, _ in signatures(api_name, obj)}
    assert {"distopt.DistributedDataParallel", "distopt.DistributedOptimizer.step",
            "distopt.DistributedDataParallel.start_param_sync", "distopt.StepResult"} <= walked
    assert "grad_norms: " in field_docstrings(api["distopt.StepResult"])


def test_the_check_catches_an_undescribed_argument():
    def scale(tensor, factor=2.0, *args, inplace=False, **options):
        """Multiply ``tensor`` by ``factor``, in place with ``inplace=True``.

        Args:
            tensor: what is scaled.
            factor: by how much.
            *args: passed on.
            options: passed on.
        """

    def exists(path, verbose=False):
        """Whether ``path`` exists; ``verbose=True`` says why not."""

    @dataclasses.dataclass
    class Window:
        """A window of ``length`` elements."""

        start: int
        length: int
        step: int = 1
        """Elements between two taken."""

    assert undescribed(scale, scale.__doc__) == ["inplace"]  # prose does not do, under Args:
    assert undescribed(exists, exists.__doc__) == []
    assert [(name, undescribed(f, doc)) for name, f, doc in signatures("Window", Window)] == [
        ("Window", ["start"])]
