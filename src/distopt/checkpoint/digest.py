"""Each checkpoint file's digest: the XXH3-64 of its 8 MiB blocks' XXH3-64s, taken as a save
writes the file and again, from its last block to its first, before a load reads it.

[Note: the files' digest]
Every load verifies every file against the manifest before it reads anything into the model,
and every save takes the digest of every byte it writes: at 1.0B params, d = 4, 3 GB a rank,
each way. zlib's CRC32 runs at 4-5 GB/s a core on this project's machines, so four ranks on
two cores spent about 1.3 s of a save on it, where torch's road computes none; XXH3-64 runs at
about 20 GB/s (benchmarks/README.md, "torch's checkpoint road and distopt's").

XXH3 of a whole file, unlike a CRC, cannot be assembled from its blocks' digests taken in any
order, and the check before a load reads each file backwards (crc.py's [Note: checking a file
from its end]). So the digest is a two-level one: each ``BLOCK`` of the file (the last one
shorter) hashed alone, and the file's digest the XXH3-64 of those 8-byte digests in file order,
seeded with the file's length. A write of any size, at any offset, updates it in one pass.

Checkpoints written before this digest list each file's zlib CRC32 (``"crc32"``) and are
verified by it (crc.py); a manifest entry says which it holds (``"xxh3"`` or ``"crc32"``).
"""

from __future__ import annotations

import os
import struct

import xxhash

from .crc import blocks_from_end

BLOCK = 8 << 20  # bytes hashed alone; the check before a load reads this many at a time
KEY = "xxh3"  # the manifest's name for this digest, beside "bytes"


def _fold(block_digests: list[int], nbytes: int) -> int:
    """The file's digest from its blocks' digests, in file order, and its length."""
    packed = struct.pack(f"<{len(block_digests)}Q", *block_digests)
    return xxhash.xxh3_64_intdigest(packed, seed=nbytes)


class StreamDigest:
    """The digest of the bytes given to ``update``, in order, in writes of any size."""

    __slots__ = ("_blocks", "_current", "_filled", "nbytes")

    def __init__(self) -> None:
        self._blocks: list[int] = []
        self._current = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current block hashed so far
        self.nbytes = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(BLOCK - self._filled, len(view))
            self._current.update(view[:take])
            self._filled += take
            self.nbytes += take
            view = view[take:]
            if self._filled == BLOCK:
                self._blocks.append(self._current.intdigest())
                self._current.reset()
                self._filled = 0

    def intdigest(self) -> int:
        blocks = self._blocks + ([self._current.intdigest()] if self._filled else [])
        return _fold(blocks, self.nbytes)


def file_digest(path: str | os.PathLike) -> tuple[int, int]:
    """(bytes, digest) of the file at ``path``, read from its last block to its first; see
    [Note: the files' digest]."""
    digests: dict[int, int] = {}
    size = 0
    for index, data in blocks_from_end(path, BLOCK):
        digests[index] = xxhash.xxh3_64_intdigest(data)
        size += len(data)
    return size, _fold([digests[i] for i in sorted(digests)], size)
