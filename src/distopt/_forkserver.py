"""Ranks forked from one server that imported torch and distopt once.

``distopt train``'s launcher and ``distopt bench`` start fresh rank processes (a restart's
too). Spawned, each would import torch, torch._dynamo (torch's optimizers import it) and
distopt itself: seconds of CPU per rank. Forked from a server that imported them once, each
starts without them. The server runs no torch op, so no rank inherits a CUDA context or a
thread pool.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "distopt")


def forkserver_preloading(*modules: str) -> str:
    """The start method ``"forkserver"``, its server set to import ``PRELOAD`` and the
    given modules (the ranks' own entry point's) before it forks any rank."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *modules])
    return "forkserver"
