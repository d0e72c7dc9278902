"""``torchrun ... -m distopt.train [options]``: one rank of a training run, for launchers that
start the processes themselves (several machines, schedulers)."""

import sys

from .._extras import TRAIN_NEEDS, require
from .config import parse_args
from .launch import check_device
from .worker import run_worker

# Every rank checks before the group forms: were rank 0 alone to fail later, for want of the
# progress bar or the plot, the other ranks would wait for it in a collective.
require("distopt train", TRAIN_NEEDS)

try:
    config = parse_args(sys.argv[1:])
    check_device(config)
except ValueError as error:
    sys.exit(f"distopt train: error: {error}")
run_worker(config)
