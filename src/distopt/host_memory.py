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
is then mapped on its own and unmapped when freed, and nothing large is stranded.

The cost is a page fault per 4 KiB page of each such block at its first touch, every time: a
gather's buffer is fresh pages at every forward and backward (``distopt bench`` counts them,
``page_faults_per_step``). So the threshold is set only where the heap's holes could matter:
where the state the ranks of this host will hold (the DDP's params, grads, fp32 masters and an
Adam's two moments, sharded as the DDP shards them, times the ranks on the host) exceeds half
of the memory the host has available when the DDP is built. The ranks on the host are
torchrun's ``LOCAL_WORLD_SIZE``, or else every rank of the DP group (the larger guess, which
sets the threshold sooner).

Below that, the holes fit twice over, and every DDP on the CPU, sharded or not, asks the
opposite of glibc: keep the blocks. glibc's own threshold starts at 128 KiB and rises only as
mapped blocks are freed, and its heap gives back any free top larger than twice the threshold,
so a step's gathers, grads in flight and fp32 copies were still mapped and faulted afresh,
thousands of pages a step (mlp8 at d = 2: benchmarks/README.md, "What torch's spellings cost a
step"). A roomy host sets the mmap threshold to glibc's largest, 32 MiB, and the heap's trim
threshold to 64 MiB: each step's blocks come back from the heap, faulted once. (Where memory is
tight and nothing is sharded, glibc is left alone, as it always was.)

The settings are the process's, not distopt's: a user who set ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` keeps them, and ``DISTOPT_MMAP_THRESHOLD=off`` (or a number of bytes)
turns distopt's choice off (or sets that threshold whatever the memory). Elsewhere than glibc
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
EDGE_OF_MEMORY_MMAP_THRESHOLD = 1 << 20
"""Blocks at least this large are mapped on their own where memory is tight ([Note: the heap at
the edge of memory])."""
ROOMY_MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``): where memory
is roomy, every block below it comes from the heap."""
ROOMY_TRIM_THRESHOLD = 64 << 20
"""Free memory at the heap's top kept where memory is roomy, rather than given back and faulted
in again at the next step."""
GLIBC_TRIM_THRESHOLD = 128 << 10
"""glibc's own trim threshold (``DEFAULT_TRIM_THRESHOLD``), given back where a later DDP finds
memory tight after an earlier one found it roomy."""
TIGHT_SETTINGS = {M_MMAP_THRESHOLD: EDGE_OF_MEMORY_MMAP_THRESHOLD,
                  M_TRIM_THRESHOLD: GLIBC_TRIM_THRESHOLD}
THRESHOLD_VARIABLE = "DISTOPT_MMAP_THRESHOLD"
GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
TIGHT_FRACTION = 0.5
"""The share of the host's available memory above which the ranks' projected state sets the
1 MiB threshold ([Note: the heap at the edge of memory])."""


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


def available_host_bytes() -> int | None:
    """The memory the host has available (``MemAvailable`` of /proc/meminfo); None where
    unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_state_bytes(numel: int, param_itemsize: int, grad_itemsize: int, dp_size: int, *,
                     shard_grads: bool, shard_params: bool,
                     ranks_on_host: int | None = None) -> int:
    """The state the ranks of this host will hold for a DDP of ``numel`` trainable elements
    (grads and params sharded as the flags say): params, grads, fp32 masters of low-precision
    params and an Adam's two fp32 moments, each rank its shards of the sharded ones
    (docs/design.md's table). ``ranks_on_host`` defaults to torchrun's ``LOCAL_WORLD_SIZE``,
    else ``dp_size``."""
    if ranks_on_host is None:
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", dp_size))
    sharded = 8 + (4 if param_itemsize < 4 else 0)
    whole = 0
    for itemsize, is_sharded in ((grad_itemsize, shard_grads or shard_params),
                                 (param_itemsize, shard_params)):
        if is_sharded:
            sharded += itemsize
        else:
            whole += itemsize
    per_rank = numel * whole + -(-numel * sharded // max(dp_size, 1))
    return ranks_on_host * per_rank


def memory_is_tight(host_state_bytes: int | None, available: int | None) -> bool:
    """Whether ``host_state_bytes`` (the state all ranks of the host will hold) exceeds
    ``TIGHT_FRACTION`` of ``available``; True where either is unknown."""
    if host_state_bytes is None or available is None:
        return True
    return host_state_bytes > TIGHT_FRACTION * available


def heap_settings(host_state_bytes: int | None = None, *, sharded: bool = True
                  ) -> dict[int, int]:
    """The ``mallopt`` settings distopt makes for runs on the CPU, by parameter; empty where it
    leaves glibc alone (the user set glibc's own variables, ``DISTOPT_MMAP_THRESHOLD`` is
    ``off``, or memory is tight and neither grads nor params are ``sharded``).
    ``host_state_bytes``: the state all ranks of the host will hold, None where unknown (taken
    as tight). Raises, naming the variable, on a value that is neither a number of bytes nor
    ``off``."""
    if any(name in os.environ for name in GLIBC_VARIABLES):
        return {}
    value = os.environ.get(THRESHOLD_VARIABLE, "").strip()
    if not value:
        if memory_is_tight(host_state_bytes, available_host_bytes()):
            return dict(TIGHT_SETTINGS) if sharded else {}
        return {M_MMAP_THRESHOLD: ROOMY_MMAP_THRESHOLD, M_TRIM_THRESHOLD: ROOMY_TRIM_THRESHOLD}
    if value.lower() in ("off", "0", "none"):
        return {}
    try:
        threshold = int(value)
    except ValueError:
        threshold = -1
    if threshold <= 0:
        raise ValueError(
            f"{THRESHOLD_VARIABLE}={value!r}: give a number of bytes (1048576 maps every block "
            "of 1 MiB or more on its own) or 'off' to leave glibc's malloc as it is"
        )
    return {M_MMAP_THRESHOLD: threshold}


_applied: list[dict[int, int]] = []


def tune_heap(host_state_bytes: int | None = None, *, sharded: bool = True) -> dict[int, int]:
    """Make ``heap_settings(host_state_bytes, sharded=sharded)`` for this process, once, or
    again where a later DDP finds memory tight after an earlier one found it roomy; see [Note:
    the heap at the edge of memory]. Returns the settings in effect, empty where nothing was
    set."""
    settings = heap_settings(host_state_bytes, sharded=sharded)
    if _applied and (_applied[-1] == TIGHT_SETTINGS or settings != TIGHT_SETTINGS):
        return _applied[-1]
    mallopt = _malloc_function("mallopt")
    if not settings or mallopt is None:
        return {}
    made = {param: value for param, value in settings.items() if mallopt(param, value)}
    _applied.append(made)
    return made
