"""``distopt train``: validate the options, then start the ranks with PyTorch's elastic launcher.

The launcher (``torch.distributed.launcher.elastic_launch``, the engine behind torchrun) runs one
process per rank on this machine, rendezvouses them over c10d on a free local port, and with
``--max-restarts N`` restarts the whole group when any rank dies; the restarted ranks resume from
the latest checkpoint. For several machines use torchrun directly (see docs/train.md):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m distopt.train [options]
"""

from __future__ import annotations

import sys
import uuid

import torch

from .._forkserver import forkserver_preloading
from .._version import pip_install
from .config import TrainConfig, parse_args


def _fail(message: str) -> int:
    print(f"distopt train: error: {message}", file=sys.stderr)
    return 2


def check_device(config: TrainConfig) -> int:
    """The number of ranks to start, checked against the device; raises ValueError."""
    if config.device_type() == "cpu":
        return config.nproc or 2
    if not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device (a CPU build of torch, "
                         "or no GPU visible); use --device cpu")
    gpus = torch.cuda.device_count()
    if config.nproc is not None and config.nproc > gpus:
        raise ValueError(f"--nproc {config.nproc} on --device cuda needs one GPU per rank, but "
                         f"{gpus} are visible; use --nproc {gpus} or fewer")
    return config.nproc or gpus


def validate(config: TrainConfig, nproc: int) -> None:
    """Every check that needs no process group; raises ValueError with the fix."""
    from .data import load_corpus

    config.check_world_size(nproc)
    groups = config.ft_groups or 1
    if config.batch_size % (groups * nproc):
        raise ValueError(f"--batch-size {config.batch_size} does not split over the "
                         f"{groups} x {nproc} ranks of --ft-groups {groups}; pick a multiple "
                         f"of {groups * nproc}")
    corpus = load_corpus(config.data, max_bytes=config.max_bytes)
    for split, data in (("train", corpus.train), ("held-out", corpus.heldout)):
        if data.numel() <= config.seq_len:
            raise ValueError(
                f"the {split} split has {data.numel()} bytes, fewer than --seq-len "
                f"{config.seq_len} + 1; use more data or a shorter --seq-len"
            )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ValueError as error:
        return _fail(str(error))
    try:
        nproc = check_device(config)
        validate(config, nproc)
    except ValueError as error:
        return _fail(str(error))
    if config.ft_groups is not None:
        from .._extras import FT_NEEDS, missing
        from . import ft

        if missing(FT_NEEDS):
            return _fail(f"--ft-groups needs torchft (not installed): {pip_install('ft')}")
        try:
            ft.check_schedule(config, nproc)
        except ValueError as error:
            return _fail(str(error))
        return ft.launch_groups(config, launch_group, nproc)
    return launch_group(config)


def launch_group(config: TrainConfig) -> int:
    """Start this machine's ranks under the elastic launcher and wait for them; with
    --ft-groups, one replica group's (train/ft.py runs one per group)."""
    nproc = check_device(config)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker import run_worker

    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"distopt-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone does
        max_restarts=config.max_restarts,
        monitor_interval=0.2,
        # Every rank, and every rank a restart starts again: see distopt/_forkserver.py.
        start_method=forkserver_preloading("distopt.train.worker"),
    )
    try:
        elastic_launch(launch, run_worker)(config)
    except ChildFailedError as error:
        return _fail(f"a rank failed and no restart was left (--max-restarts "
                     f"{config.max_restarts}):\n{error}")
    return 0


if __name__ == "__main__":
    from .._extras import TRAIN_NEEDS, require

    require("distopt train", TRAIN_NEEDS)
    sys.exit(main())
