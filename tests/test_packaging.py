"""The library needs only torch; the applications' packages come with the ``train`` extra, and
``distopt train`` / ``distopt bench`` without them say so in one line. The wheel that
``python -m build`` makes holds every file of the package and one version, the one
``distopt --version`` shows (.ci/wheel_smoke.sh installs it and tries it outside the tree).
The README's install lines are the forms CI runs."""

from __future__ import annotations

import email
import importlib
import importlib.metadata
import re
import runpy
import shutil
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import distopt
from distopt._extras import BENCH_NEEDS, TRAIN_NEEDS, missing
from distopt._version import DISTRIBUTION
from distopt.cli import main

from early_launches import Command, launch_early

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "distopt"

APPLICATION_PACKAGES = ("matplotlib", "tqdm", "numpy")

# Makes the named packages look not installed: with None in sys.modules, importing them raises
# ModuleNotFoundError and importlib.util.find_spec finds nothing.
BLOCK = "import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"


def _python(code: str, *args: str, blocked: tuple[str, ...] = ()) -> Command:
    """A fresh interpreter running ``code`` with ``blocked`` not installed."""
    prelude = BLOCK.format(blocked=sorted(blocked)) if blocked else ""
    return Command([sys.executable, "-c", prelude + code, *args])


def _run_module(module: str, *args: str, blocked: tuple[str, ...]) -> Command:
    """``python -m module args`` with ``blocked`` not installed."""
    code = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return _python(code, *args, blocked=blocked)


# The fresh interpreters of this module's tests start with the session (early_launches.py).
IMPORTS = launch_early("test_import_distopt_loads_no_application_package", lambda _: [_python(
    # torch itself imports numpy and tqdm when they are installed: count only what distopt adds.
    "import sys, torch\n"
    "before = set(sys.modules)\n"
    "import distopt, distopt.cli, distopt.cli.memory_command\n"
    "print(' '.join(sorted(set(sys.modules) - before)))\n"
    "print('matplotlib' in sys.modules)\n")])
WITHOUT_THE_EXTRA = launch_early("test_library_and_memory_command_work_without_the_extra",
                                 lambda _: [_python(
    # distopt imported first, as the distopt command does: torch's warning that numpy is
    # missing is not printed, so a command's one-line message is the whole of stderr.
    "import sys, distopt, torch\n"
    "from distopt.cli import main\n"
    "assert distopt.theoretical_bytes_per_param(torch.float32, None, 4) == 10.0\n"
    "sys.exit(main(['memory', '--model', 'tiny', '--dp', '2']))\n",
    blocked=APPLICATION_PACKAGES)])
# python -m ENTRY ARGS for each id of the test below
MISSING_EXTRA = {"distopt train": ("distopt", "train", "--nproc", "0"),
                 "torchrun -m distopt.train": ("distopt.train", "--nproc", "0")}
MISSING_EXTRA_RUNS = launch_early(
    "test_missing_extra_is_one_line_not_a_traceback",
    lambda _: [_run_module(*entry, blocked=("matplotlib", "tqdm"))
               for entry in MISSING_EXTRA.values()])


@pytest.mark.slow  # a fresh interpreter
def test_import_distopt_loads_no_application_package():
    (proc,) = IMPORTS.result()
    assert proc.returncode == 0, proc.stderr
    added, matplotlib_loaded = proc.stdout.splitlines()
    assert "distopt" in added.split()
    assert not [m for m in added.split() if m.partition(".")[0] in APPLICATION_PACKAGES]
    assert matplotlib_loaded == "False"


@pytest.mark.slow  # a fresh interpreter
def test_library_and_memory_command_work_without_the_extra():
    (proc,) = WITHOUT_THE_EXTRA.result()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("--model tiny, bf16 params, fp32 grads")
    assert proc.stderr == ""


def _one_line(command: str, needs: str) -> str:
    return (f"{command}: needs {needs} (not installed): pip install 'torch-distopt[train]' "
            "(in a clone: pip install -e '.[train]')")


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("entry", list(MISSING_EXTRA))
def test_missing_extra_is_one_line_not_a_traceback(entry):
    proc = MISSING_EXTRA_RUNS.result()[list(MISSING_EXTRA).index(entry)]
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == _one_line("distopt train", "matplotlib and tqdm") + "\n"


# --nproc 0 is refused at once, should an entry point start without checking.
@pytest.mark.parametrize(
    "entry,argv,blocked,message",
    [
        ("distopt", ["train", "--nproc", "0"], "tqdm", _one_line("distopt train", "tqdm")),
        ("distopt", ["bench", "--help"], "matplotlib", _one_line("distopt bench", "matplotlib")),
        ("distopt.train", ["--nproc", "0"], "matplotlib",
         _one_line("distopt train", "matplotlib")),
        ("distopt.train.launch", ["--nproc", "0"], "tqdm", _one_line("distopt train", "tqdm")),
    ],
    ids=["distopt train", "distopt bench", "python -m distopt.train",
         "python -m distopt.train.launch"],
)
def test_each_entry_point_names_what_it_lacks(monkeypatch, entry, argv, blocked, message):
    monkeypatch.setitem(sys.modules, blocked, None)
    monkeypatch.setattr(sys, "argv", [entry, *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
    assert exited.value.code == message  # printed on stderr, exit status 1


@pytest.mark.parametrize(
    "module,blocked,message",
    [
        ("distopt.integrations.lightning", ("lightning", "lightning.pytorch"),
         "distopt.integrations.lightning needs Lightning: pip install 'torch-distopt[lightning]' "
         "(in a clone: pip install -e '.[lightning]')"),
        ("distopt.integrations.transformers", ("transformers", "accelerate"),
         "distopt.integrations.transformers needs transformers and accelerate: "
         "pip install 'torch-distopt[hf]' (in a clone: pip install -e '.[hf]')"),
    ],
    ids=["lightning", "hf"],
)
def test_a_trainer_door_without_its_extra_names_it_in_one_line(monkeypatch, module, blocked,
                                                               message):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(module)
    assert str(raised.value) == message


def test_missing_sees_blocked_and_absent_modules(monkeypatch):
    assert missing(TRAIN_NEEDS) == []  # the test environment has the extra
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert missing(TRAIN_NEEDS) == ["tqdm"]
    assert missing(("distopt_no_such_package", "torch")) == ["distopt_no_such_package"]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_pyproject_puts_application_packages_in_the_train_extra():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The library needs torch and the checkpoints' digest (checkpoint/digest.py); the
    # application's packages (progress, plots) stay in the extra.
    assert _requirement_names(project["dependencies"]) == {"torch", "xxhash"}
    train = _requirement_names(project["optional-dependencies"]["train"])
    assert set(TRAIN_NEEDS) | set(BENCH_NEEDS) <= train


# What the sdist is built from (pyproject.toml and MANIFEST.in name these); a file added there
# must be added here too, or the build below fails on it.
BUILD_INPUTS = ("pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md", "src")


def _build_wheel(workdir: Path) -> list[Command]:
    """``python -m build`` of the sdist, then the wheel from it, as a release is built. It is
    built from a copy of the build inputs, so that nothing stale in the tree (build/,
    *.egg-info) can add a file to it or hide one, and with this environment's setuptools (the
    dev extra), so that no download is needed."""
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, workdir / "tree" / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (workdir / "tree").mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, workdir / "tree" / name)
    return [Command.module("build", "--no-isolation", "--outdir", str(workdir / "dist"),
                           str(workdir / "tree"))]


WHEEL_BUILD = launch_early(("test_wheel_holds_every_file_of_the_package",
                            "test_wheel_installs_distopt_and_its_metadata_only",
                            "test_one_version_in_the_wheel_the_package_and_the_command",
                            "test_readme_names_the_wheel_the_build_makes"),
                           _build_wheel)


@pytest.fixture(scope="module")
def wheel() -> Iterator[zipfile.ZipFile]:
    """The wheel ``_build_wheel`` made."""
    (proc,) = WHEEL_BUILD.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = (WHEEL_BUILD.workdir / "dist").glob("*.whl")
    with zipfile.ZipFile(path) as opened:
        yield opened


def _package_files() -> set[str]:
    """Every file under src/distopt, as its path in the wheel (caches left out)."""
    return {
        f"distopt/{path.relative_to(PACKAGE).as_posix()}" for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.mark.slow  # builds the wheel
def test_wheel_holds_every_file_of_the_package(wheel):
    in_wheel = {name for name in wheel.namelist() if name.startswith("distopt/")}
    source = _package_files()
    assert "distopt/py.typed" in source, "py.typed marks the package as typed"
    # A module or data file left out breaks every user and no test that runs in the tree: a
    # file that is not Python must be named in pyproject.toml's package-data.
    assert sorted(source - in_wheel) == [], "in src/distopt, not in the wheel: see package-data"
    assert sorted(in_wheel - source) == [], "in the wheel but not in src/distopt"


@pytest.mark.slow  # builds the wheel
def test_wheel_installs_distopt_and_its_metadata_only(wheel):
    # pip install torch-distopt puts these top-level names into site-packages and no other.
    version = distopt.__version__
    info = f"{DISTRIBUTION.replace('-', '_')}-{version}.dist-info"
    assert {name.split("/")[0] for name in wheel.namelist()} == {"distopt", info}
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["distopt"]
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "distopt = distopt.cli:main" in entry_points.splitlines()


@pytest.mark.slow  # builds the wheel
def test_one_version_in_the_wheel_the_package_and_the_command(wheel, capsys):
    name = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(wheel.read(name))  # the core metadata's format
    assert metadata["Name"] == DISTRIBUTION
    assert metadata["Version"] == distopt.__version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"distopt {metadata['Version']} ({DISTRIBUTION})\n"


def test_installed_metadata_is_this_version():
    # make setup installs the tree (editable); its metadata is written at install time, so a
    # version changed since is caught here (the Makefile reinstalls when _version.py changes).
    try:
        installed = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION} is not installed in this environment (make setup does it)")
    assert installed.version == distopt.__version__


# ---------------------------------------------------------------- the README's install lines

README_INSTALL = {  # each form of install line the README may give, and who runs it in CI
    "clone": (re.compile(r"^pip install -e '\.\[(?P<extras>[\w,]+)\]'$"),
              "Makefile", "-e '.[train,dev,hf,lightning,ft]'"),
    "wheel": (re.compile(r"^python -m build && pip install 'dist/(?P<wheel>[\w.-]+\.whl)"
                         r"\[(?P<extras>[\w,]+)\]'$"),
              ".ci/wheel_smoke.sh", 'add base "$WHEEL[train]"'),
    "git": (re.compile(r"^pip install 'torch-distopt\[(?P<extras>[\w,]+)\] @ git\+\S+'$"),
            ".ci/wheel_smoke.sh", 'add git "torch-distopt @ git+file://$REPO"'),
}


def readme_install_lines() -> list[str]:
    """The commands of the README's first code block under "## Install", comments cut."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Install\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_install_lines_are_the_ones_ci_runs():
    """Each install line of the README is a form that CI runs (an editable install from the
    clone, the built wheel, a git URL), with extras that exist and the wheel of this version;
    the Makefile and .ci/wheel_smoke.sh run each form."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    seen = set()
    for line in readme_install_lines():
        form = next((name for name, (pattern, _, _) in README_INSTALL.items()
                     if pattern.match(line)), None)
        assert form is not None, f"the README installs with a form CI does not run: {line}"
        pattern, runner, command = README_INSTALL[form]
        match = pattern.match(line)
        assert set(match["extras"].split(",")) <= extras, line
        if form == "wheel":
            assert match["wheel"] == (f"{DISTRIBUTION.replace('-', '_')}-"
                                      f"{distopt.__version__}-py3-none-any.whl"), line
        assert command in (ROOT / runner).read_text(), (runner, command)
        seen.add(form)
    assert seen == set(README_INSTALL), seen


@pytest.mark.slow  # builds the wheel
def test_readme_names_the_wheel_the_build_makes(wheel):
    (built,) = (WHEEL_BUILD.workdir / "dist").glob("*.whl")
    assert f"dist/{built.name}[" in (ROOT / "README.md").read_text()
