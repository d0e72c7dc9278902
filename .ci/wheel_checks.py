"""What a user of the installed wheel does first, run by .ci/wheel_smoke.sh inside a fresh
virtual environment that holds the wheel and at most one extra:

    python wheel_checks.py EXTRA OUT     EXTRA: none, train, hf or lightning; OUT: a scratch folder

Every environment: ``import distopt`` from site-packages, one version (metadata, module and
command), ``distopt --help``, ``distopt memory``. Then each of the extras train, hf and
lightning: the one installed is used for real (a short run of its command or example), and each
of the others must be missing and say so in one line that names the install command.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import distopt

DISTRIBUTION = "torch-distopt"


def install(extra: str) -> str:
    """What a missing extra's one line tells the user to run."""
    return f"pip install '{DISTRIBUTION}[{extra}]' (in a clone: pip install -e '.[{extra}]')"


REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXTRAS = ("train", "hf", "lightning")


def run(*argv: str | Path, ok: bool = True) -> subprocess.CompletedProcess:
    """Run a command of the environment; print its output if it did not end as expected."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600)
    if (proc.returncode == 0) != ok:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{argv[0]} {' '.join(map(str, argv[1:]))}: exit {proc.returncode}")
    return proc


def check_installed_package() -> None:
    # The wheel's copy, not the repository's src/ (the repository is not on sys.path here).
    assert Path(distopt.__file__).is_relative_to(sys.prefix), distopt.__file__
    assert (Path(distopt.__file__).parent / "py.typed").is_file(), "py.typed not installed"
    # Nothing else installed provides a top-level distopt (the index's "distopt" is unrelated).
    assert importlib.metadata.packages_distributions()["distopt"] == [DISTRIBUTION]
    version = importlib.metadata.version(DISTRIBUTION)
    assert distopt.__version__ == version, (distopt.__version__, version)
    shown = run(BIN / "distopt", "--version").stdout
    assert shown == f"distopt {version} ({DISTRIBUTION})\n", shown
    assert run(BIN / "distopt", "--help").stdout.startswith("usage: distopt <command>")
    memory = run(BIN / "distopt", "memory", "--model", "small", "--dp", "8").stdout
    assert memory.startswith("--model small"), memory
    print(f"{DISTRIBUTION} {version}: import, --version, --help, memory: ok")


def use_train(out: Path) -> None:
    """A 2-rank, 20-step run of the demo GPT on the default data (the Python standard library's
    sources), with a checkpoint, the loss plot and the summary."""
    run(BIN / "distopt", "train", "--nproc", "2", "--device", "cpu", "--steps", "20",
        "--warmup", "5", "--eval-every", "10", "--eval-batches", "2", "--max-bytes", "200000",
        "--save-every", "10", "--no-progress", "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2, summary["world_size"]
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"], summary
    assert (out / "loss.png").is_file() and (out / "checkpoints").is_dir()
    print(f"train: distopt train, 2 ranks, 20 steps: held-out loss "
          f"{summary['heldout_loss_start']:.3f} -> {summary['heldout_loss_end']:.3f}: ok")


def use_hf(out: Path) -> None:
    """examples/hf_trainer.py: DistoptTrainer on 2 ranks, 2 steps, one checkpoint."""
    proc = run(BIN / "torchrun", "--nproc-per-node", "2", REPO / "examples" / "hf_trainer.py",
               "--steps", "2", "--save-steps", "2", "--output-dir", out)
    assert proc.stdout.count("bytes/param of training state") == 2, proc.stdout[-2000:]
    assert (out / "checkpoint-2" / "distopt").is_dir()
    print("hf: DistoptTrainer, 2 ranks, 2 steps, a checkpoint: ok")


def use_lightning(out: Path) -> None:
    """examples/lightning_gpt.py: DistoptStrategy on 2 devices, 10 steps, one validation."""
    proc = run(sys.executable, REPO / "examples" / "lightning_gpt.py", "--devices", "2",
               "--steps", "10", "--global-batch", "8", "--save", out / "last.ckpt")
    assert "step 10: loss" in proc.stdout, proc.stdout[-2000:]
    assert (out / "last.ckpt").exists()
    print("lightning: DistoptStrategy, 2 devices, 10 steps, a checkpoint: ok")


def expect_train_missing() -> None:
    absent = [m for m in ("matplotlib", "tqdm") if find_spec(m) is None]
    assert absent, "the train extra's packages came with another extra"
    err = run(BIN / "distopt", "train", "--steps", "20", ok=False).stderr
    want = (f"distopt train: needs {' and '.join(absent)} (not installed): "
            f"{install('train')}\n")
    assert err == want, err


def expect_import_refused(module: str, message: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        assert str(e) == message, str(e)
    else:
        raise AssertionError(f"{module} imported without its extra")


def expect_hf_missing() -> None:
    expect_import_refused("distopt.integrations.transformers",
                          "distopt.integrations.transformers needs transformers and accelerate: "
                          f"{install('hf')}")


def expect_lightning_missing() -> None:
    expect_import_refused("distopt.integrations.lightning",
                          "distopt.integrations.lightning needs Lightning: "
                          f"{install('lightning')}")


USE = {"train": use_train, "hf": use_hf, "lightning": use_lightning}
MISSING = {"train": expect_train_missing, "hf": expect_hf_missing,
           "lightning": expect_lightning_missing}


def main() -> None:
    extra, out = sys.argv[1], Path(sys.argv[2])
    assert extra == "none" or extra in EXTRAS, extra
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    check_installed_package()
    for name in EXTRAS:
        if name == extra:
            (out / name).mkdir(parents=True)
            USE[name](out / name)
        else:
            MISSING[name]()
    absent = [name for name in EXTRAS if name != extra]
    print(f"without {', '.join(absent)}: one line each naming the install command: ok")


if __name__ == "__main__":
    main()
