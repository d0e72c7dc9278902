"""Host memory freed but kept by the C allocator, given back to the system.

[Note: stranded host memory]
The first optimizer step creates the optimizer state lazily, bucket by bucket, between the
step's temporaries of the same size (fp32 copies of a bucket's shard). glibc's malloc serves
allocations under its mmap threshold (which rises to 32 MiB as large blocks are freed) from its
heaps, so once the temporaries are freed their memory is left in holes between state tensors:
resident, but of no use to the later steps, whose temporaries land elsewhere. On a 510M-param
model in the lean tier that left 0.35 GiB per rank resident after the first step, above
``distopt.transient_bound`` (``benchmarks/memory_wall.py``). One ``malloc_trim(0)`` after the
first step hands those holes back (glibc returns free pages in the middle of its heaps too); later
steps reuse their own memory. Elsewhere than glibc it does nothing.

[Note: the heap at the edge of memory]
Trimming once is not enough where the model fills the machine. Every step and every forward
allocate and free blocks of a bucket's or a gather unit's size (gathered params, grads in
flight, the step's fp32 copies), and glibc's dynamic threshold soon serves all of them from the
heap: a freed block whose neighbours are still live stays resident, and the holes add up. A
2.04B-param GPT in the lean tier at d = 4 was killed for memory on a 23.5 GiB machine with
glibc's defaults and trained at 5.50 GiB per rank with ``MALLOC_MMAP_THRESHOLD_=1048576``
(benchmarks/README.md, "The lean tier at 2.0B"). So a process whose params or grads distopt
shards on the CPU (the modes for models at the edge of memory) sets glibc's mmap threshold to
1 MiB itself, with ``mallopt``, when its first such DDP is built: every block of 1 MiB or more
is then mapped on its own and unmapped when freed, and nothing large is stranded. The cost is
a page fault per 4 KiB page of each such block at its first touch (counted in
benchmarks/README.md). The threshold is the process's, not distopt's: a user who set
``MALLOC_MMAP_THRESHOLD_`` keeps it, and ``DISTOPT_MMAP_THRESHOLD=off`` (or a number of bytes)
turns distopt's choice off (or changes it). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter (malloc.h)."""
EDGE_OF_MEMORY_MMAP_THRESHOLD = 1 << 20
"""Blocks at least this large are mapped on their own ([Note: the heap at the edge of
memory])."""
THRESHOLD_VARIABLE = "DISTOPT_MMAP_THRESHOLD"


@functools.cache
def _libc():  # noqa: ANN202 - a ctypes library or None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def _malloc_function(name: str):  # noqa: ANN202 - a ctypes function or None
    libc = _libc()
    return None if libc is None else getattr(libc, name, None)  # None: not glibc


def release_freed_host_memory() -> bool:
    """Give the system back the memory the C heap holds freed; True where it could try."""
    trim = _malloc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def edge_of_memory_threshold() -> int | None:
    """The mmap threshold distopt sets for sharded runs on the CPU, in bytes; None where it
    leaves glibc alone (the user set ``MALLOC_MMAP_THRESHOLD_``, or ``DISTOPT_MMAP_THRESHOLD``
    is ``off``). Raises, naming the variable, on a value that is neither."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    value = os.environ.get(THRESHOLD_VARIABLE, "").strip()
    if not value:
        return EDGE_OF_MEMORY_MMAP_THRESHOLD
    if value.lower() in ("off", "0", "none"):
        return None
    try:
        threshold = int(value)
    except ValueError:
        threshold = -1
    if threshold <= 0:
        raise ValueError(
            f"{THRESHOLD_VARIABLE}={value!r}: give a number of bytes (1048576 maps every block "
            "of 1 MiB or more on its own) or 'off' to leave glibc's malloc as it is"
        )
    return threshold


_applied: list[int] = []


def keep_heap_from_stranding() -> int | None:
    """Set glibc's mmap threshold for this process, once; see [Note: the heap at the edge of
    memory]. Returns the threshold set, or None where nothing was set."""
    threshold = edge_of_memory_threshold()
    if threshold is None:
        return None
    if _applied:
        return _applied[0]
    mallopt = _malloc_function("mallopt")
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, threshold):
        return None
    _applied.append(threshold)
    return threshold
