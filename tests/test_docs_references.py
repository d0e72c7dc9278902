"""Every path, Note and name that README.md and docs/*.md point at exists.

Docs drift when code moves: a file renamed, a function folded into another, a Note dropped.
This test reads the markdown and checks what it can check mechanically:

* file paths in backticks and markdown links (``optim/base.py``, ``tests/test_parity.py``,
  ``[docs](docs/design.md)``) name a file of the repo; a bare or partial path may be a suffix
  of one (``save.py`` is ``src/distopt/checkpoint/save.py``);
* ``[Note: ...]`` cited in a doc is defined in the code, and design.md's index names the file
  that defines each Note and lists every Note the code defines;
* a name said to be in a file ("`unscale_` in `optim/grad_stats.py`") is defined there;
* a dotted ``distopt.`` name imports.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
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
            return False
        return True
    return False


def test_the_check_catches_a_wrong_path():
    assert resolves("optim/base.py") and resolves("save.py")
    assert not resolves("optim/no_such_module.py")
    assert path_tokens("see `src/distopt/parallel.py` and [x](docs/nowhere.md#a)") == [
        "src/distopt/parallel.py", "docs/nowhere.md"]
