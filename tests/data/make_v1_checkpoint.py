"""Writes tests/data/v1-checkpoint: a checkpoint in distopt's first on-disk layout (format
version 1: ``main/``, ``state/``, ``model/`` keys), as ``save_checkpoint`` wrote it before the
torch layout. Kept to show how the fixture was made; run with a distopt of that layout:

    PYTHONPATH=src:tests python tests/data/make_v1_checkpoint.py

Two ranks, ``shard_params``, fp32, AdamW; test_checkpoint_torch_layout.py's model, batches and
learning rate, saved after ``SAVED_AT`` steps with ``extra={"step": SAVED_AT}``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dist_harness import run_cases

OUT = Path(__file__).parent / "v1-checkpoint"


def _save(root: str) -> None:
    import test_checkpoint_torch_layout as t  # its model, batches, lr

    import distopt

    ddp, opt = t.build_distopt("params")
    t.train(ddp, opt, range(t.SAVED_AT))
    distopt.save_checkpoint(root, ddp, opt, extra={"step": t.SAVED_AT})


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    run_cases(2, [("save", _save, (str(OUT),))])
