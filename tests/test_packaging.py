"""The library needs only torch; the applications' packages come with the ``train`` extra, and
``distopt train`` / ``distopt bench`` without them say so in one line."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from distopt.cli.needs import BENCH_NEEDS, TRAIN_NEEDS, missing

APPLICATION_PACKAGES = ("matplotlib", "tqdm", "numpy")

# Makes the named packages look not installed: with None in sys.modules, importing them raises
# ModuleNotFoundError and importlib.util.find_spec finds nothing.
BLOCK = "import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"


def _python(code: str, *args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    prelude = BLOCK.format(blocked=sorted(blocked)) if blocked else ""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True,
                          text=True, env=env, timeout=120)


def _run_module(module: str, *args: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    """``python -m module args`` with ``blocked`` not installed."""
    code = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return _python(code, *args, blocked=blocked)


def test_import_distopt_loads_no_application_package():
    # torch itself imports numpy and tqdm when they are installed: count only what distopt adds.
    proc = _python(
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import distopt, distopt.cli, distopt.cli.memory\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
        "print('matplotlib' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    added, matplotlib_loaded = proc.stdout.splitlines()
    assert "distopt" in added.split()
    assert not [m for m in added.split() if m.partition(".")[0] in APPLICATION_PACKAGES]
    assert matplotlib_loaded == "False"


def test_library_and_memory_command_work_without_the_extra():
    proc = _python(
        "import sys, torch, distopt\n"
        "from distopt.cli import main\n"
        "assert distopt.theoretical_bytes_per_param(torch.float32, None, 4) == 10.0\n"
        "sys.exit(main(['memory', '--model', 'tiny', '--dp', '2']))\n",
        blocked=APPLICATION_PACKAGES,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("--model tiny, bf16 params, fp32 grads")


def _one_line(command: str, needs: str) -> str:
    return f"{command}: needs {needs} (not installed): pip install 'distopt[train]'"


@pytest.mark.parametrize(
    "entry,args",
    [("distopt", ["train", "--nproc", "0"]), ("distopt.train", ["--nproc", "0"])],
    ids=["distopt train", "torchrun -m distopt.train"],
)
def test_missing_extra_is_one_line_not_a_traceback(entry, args):
    proc = _run_module(entry, *args, blocked=("matplotlib", "tqdm"))
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


def test_missing_sees_blocked_and_absent_modules(monkeypatch):
    assert missing(TRAIN_NEEDS) == []  # the test environment has the extra
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert missing(TRAIN_NEEDS) == ["tqdm"]
    assert missing(("distopt_no_such_package", "torch")) == ["distopt_no_such_package"]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_pyproject_puts_application_packages_in_the_train_extra():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads(
        (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    )["project"]
    assert _requirement_names(project["dependencies"]) == {"torch"}
    train = _requirement_names(project["optional-dependencies"]["train"])
    assert set(TRAIN_NEEDS) | set(BENCH_NEEDS) <= train
