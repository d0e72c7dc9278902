"""Ranks forked from one server that imported torch and distopt once.

``distopt train``'s launcher and ``distopt bench`` start fresh rank processes (a restart's
too). Spawned, each would import torch, torch._dynamo (torch's optimizers import it) and
distopt itself: seconds of CPU per rank. Forked from a server that imported them once, each
starts without them. The server runs no torch op, so no rank inherits a CUDA context or a
thread pool.

[Note: a frozen preload]
What the server imported is some 300,000 objects that Python's garbage collector tracks (over
400,000 with the Hugging Face and Lightning integrations' frameworks), and every rank inherits
them. Left as they are, each full collection in a rank walks all of them: 0.2-0.5 s on the
2-core machine, paid at every automatic collection of the oldest generation and at every
explicit ``gc.collect()`` (the Hugging Face Trainer calls one at the start of each ``train``
and each evaluation), and its writes to their headers make the rank copy the pages it
shared with the server (70 MiB of private memory after one collection, against none frozen).
The server's last preload, ``distopt._frozen_heap``, moves them all to the collector's
permanent generation (``gc.freeze``, as Python's documentation recommends before a fork), so
a rank's collections walk only the objects the rank made.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "distopt")
# Imported after every other preload: see [Note: a frozen preload].
FREEZE = "distopt._frozen_heap"


def forkserver_preloading(*modules: str) -> str:
    """The start method ``"forkserver"``, its server set to import ``PRELOAD`` and the
    given modules (the ranks' own entry point's) before it forks any rank, then to freeze
    what they allocated."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *modules, FREEZE])
    return "forkserver"
