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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_host_memory() -> bool:
    """Give the system back the memory the C heap holds freed; True where it could try."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
