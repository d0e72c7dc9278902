"""A failed or timed-out collective, named by what it was moving.

[Note: a stuck rank]
A rank that stops (SIGSTOP, a hang, a dead host) leaves its peers waiting in the next
collective. On gloo every wait is bounded by the process group's timeout
(``init_process_group(timeout=...)``, ``distopt train --timeout``); the waits on bucket
collectives and control values run inside ``failures_named``, so what the timeout raises is a
``CollectiveError`` that names the collective, the bucket and the seconds waited, not gloo's bare
"Timed out waiting ... for recv". On NCCL the watchdog aborts the process after the timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch.distributed as dist


class CollectiveError(dist.DistBackendError):
    """A collective that failed or timed out on this rank, named with what it was moving."""


@contextlib.contextmanager
def failures_named(op: str, what: str, cause: str = "") -> Iterator[None]:
    """Re-raise a failure of collective ``op`` on ``what`` (e.g. "bucket 3 (4096 fp32
    elements)") as a CollectiveError naming both; ``cause``: another way the ranks can part,
    named after the stuck rank. See [Note: a stuck rank]."""
    start = time.monotonic()
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"{op} of {what} failed on rank {rank} after {time.monotonic() - start:.1f} s: "
            f"{exc}. Another rank stopped, hung or died before this collective"
            f"{'; or ' + cause if cause else ''}; the process group's timeout "
            "(init_process_group(timeout=...), distopt train --timeout) bounds the wait"
        ) from exc
