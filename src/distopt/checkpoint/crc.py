"""The CRC32 of a file read from its end to its start, equal to ``zlib.crc32`` of it read forward.

[Note: checking a file from its end]
A load checks every file's CRC32 before it reads anything into the model (load.py), then DCP
reads the same bytes from the start. Where the page cache cannot hold the checkpoint (1.0B
params at d = 4 write 12 GB on a machine whose ranks hold 16 of its 23 GiB), whatever a pass
reads first is evicted by what it reads last: a check read forward leaves the files' ends in the
cache, and the DCP read that follows reads every byte from the disk again. Read from the end
instead, the check finds the ends where the save left them, cached, and leaves the starts
cached, where the DCP read begins: the two passes read each byte from the disk about once
between them, as a single read would. Where the cache holds the files the direction changes
nothing (the same bytes, read in blocks of ``BLOCK``).

A CRC32 is a linear function of its bytes, so the blocks' own CRC32s, taken in any order, fold
into the file's: ``crc(A + B) = shift(crc(A), len(B)) ^ crc(B)``, where ``shift`` appends
``len(B)`` zero bytes to the CRC register, a 32 x 32 matrix over GF(2) (zlib's
``crc32_combine``, which Python's zlib does not expose). All blocks but the last have one
length, so one matrix serves a whole file.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from functools import lru_cache

BLOCK = 8 << 20  # bytes read at a time, into one reused buffer
_POLY = 0xEDB88320  # CRC-32's polynomial, reflected, as zlib takes it


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """``matrix`` (32 columns, each an int of 32 bits) applied to ``vector`` over GF(2)."""
    out, column = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[column]
        vector >>= 1
        column += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, column) for column in matrix)


@lru_cache(maxsize=16)
def _shift(nbytes: int) -> tuple[int, ...] | None:
    """The operator that appends ``nbytes`` zero bytes to a CRC register; None: the identity."""
    one_bit = (_POLY, *(1 << n for n in range(31)))
    power = _square(_square(_square(one_bit)))  # one zero byte: eight zero bits
    out = None
    while nbytes:
        if nbytes & 1:
            out = power if out is None else tuple(_times(power, column) for column in out)
        nbytes >>= 1
        if nbytes:
            power = _square(power)
    return out


def combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC32 of A + B from ``first`` = crc32(A), ``second`` = crc32(B) and len(B)."""
    shift = _shift(second_bytes)
    return (first if shift is None else _times(shift, first)) ^ second


def blocks_from_end(path: str | os.PathLike, block: int) -> Iterator[tuple[int, memoryview]]:
    """The file at ``path`` in blocks of ``block`` bytes (the last one shorter), from its last
    block to its first, as (index, bytes) in one reused buffer: each is valid until the next;
    see [Note: checking a file from its end]."""
    buffer = bytearray(block)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        for index in reversed(range(-(-os.fstat(f.fileno()).st_size // block))):
            f.seek(index * block)
            filled = 0
            while filled < block and (got := f.readinto(view[filled:])):
                filled += got
            yield index, view[:filled]


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """(bytes, CRC32) of the file at ``path``, read from its last block to its first; see
    [Note: checking a file from its end]. A file that shrinks while it is read gives the CRC32
    of what was read, which no manifest lists."""
    crcs: dict[int, tuple[int, int]] = {}
    for index, data in blocks_from_end(path, BLOCK):
        crcs[index] = (len(data), zlib.crc32(data))
    size, crc = 0, 0
    for index in sorted(crcs):
        length, block_crc = crcs[index]
        crc = combine(crc, block_crc, length)
        size += length
    return size, crc
