"""``torchrun ... -m distopt.train [options]``: one rank of a training run, for launchers that
start the processes themselves (several machines, schedulers)."""

import sys

from .config import parse_args
from .worker import run_worker

try:
    config = parse_args(sys.argv[1:])
except ValueError as error:
    sys.exit(f"distopt train: error: {error}")
run_worker(config)
