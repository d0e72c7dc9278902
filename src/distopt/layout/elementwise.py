"""Pure arithmetic of buckets and shards: where every parameter lives in a flat buffer, and which
slice of it each data-parallel rank owns. No torch.distributed, no tensors: unit-testable alone.

[Note: layout rule]
Parameters are placed back to back, in the order given (the DDP wrapper passes them in reverse
registration order, which approximates the order in which backward produces their grads), with
no padding between them. They are grouped into buckets of about ``bucket_size`` elements: a bucket
is closed when the next parameter would overflow it, so a parameter never spans two buckets, and a
parameter larger than ``bucket_size`` gets a bucket of its own. Each bucket's end is padded to a
multiple of ``dp_size * SHARD_ALIGN`` elements, so every rank's shard of every bucket

* has the same size (reduce-scatter and all-gather need equal chunks), for any dp_size;
* starts at a multiple of ``SHARD_ALIGN`` elements from the buffer's start, which is a 64-byte
  boundary for every dtype of at least one byte (the buffer itself is 64-byte aligned).

Shards ignore parameter boundaries: a parameter may be split over several ranks. For every
(parameter, rank) pair that overlaps we keep the three ranges of Megatron's distributed optimizer:
world range (in the bucket), local range (in the rank's shard) and param range (in the flat
parameter). The padding is the only memory beyond the parameters themselves: at most
``dp_size * SHARD_ALIGN - 1`` elements per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

SHARD_ALIGN = 64
"""Every shard size is a multiple of this many elements (64 bytes for 1-byte dtypes, more above)."""


@dataclass(frozen=True, slots=True)
class Range:
    """Half-open interval ``[start, end)`` of element indices."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def shifted(self, offset: int) -> Range:
        return Range(self.start + offset, self.end + offset)

    def intersect(self, other: Range) -> Range | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives: its bucket, and its range in the bucket and in the buffer."""

    index: int  # position in the sequence given to the layout function
    bucket: int
    bucket_range: Range
    buffer_range: Range
    # The rank that owns the parameter whole (layout/whole.py); None where shards ignore
    # parameter boundaries ([Note: layout rule]).
    owner: int | None = None


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one parameter that one rank owns, in the three coordinate systems."""

    param_index: int
    bucket: int
    world_range: Range  # in the bucket
    local_range: Range  # in this rank's shard of the bucket
    param_range: Range  # in the flattened parameter


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """One bucket: a padded, contiguous range of the buffer holding whole parameters."""

    index: int
    buffer_range: Range  # includes the padding (at the end, or per shard when whole_tensor)
    num_param_elements: int  # elements that belong to parameters (the rest is padding)
    param_indices: tuple[int, ...]  # in the order given to the layout function
    dp_size: int
    # Every parameter lies inside one rank's shard, with padding at the end of each shard;
    # see [Note: whole-tensor layout] in layout/whole.py.
    whole_tensor: bool = False

    @property
    def shard_size(self) -> int:
        return self.buffer_range.size // self.dp_size

    def shard_range(self, rank: int) -> Range:
        """Rank's shard in bucket coordinates."""
        return Range(rank * self.shard_size, (rank + 1) * self.shard_size)


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """The layout of one flat buffer: its buckets and where each parameter lives."""

    dp_size: int
    numel: int  # total, padding included
    buckets: tuple[BucketLayout, ...]
    params: tuple[ParamSlot, ...]  # in the order given to the layout function

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """Every (param, rank) overlap for ``rank``, ordered by bucket then by position."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} outside [0, {self.dp_size})")
        return self._pieces(lambda bucket: bucket.shard_range(rank))

    def whole_pieces(self) -> list[ShardPiece]:
        """Every parameter whole, as if one rank owned every bucket (replicated optimizers)."""
        return self._pieces(lambda bucket: Range(0, bucket.buffer_range.size))

    def _pieces(self, owned: Callable[[BucketLayout], Range]) -> list[ShardPiece]:
        pieces = []
        for bucket in self.buckets:
            shard = owned(bucket)
            for index in bucket.param_indices:
                slot = self.params[index]
                world = slot.bucket_range.intersect(shard)
                if world is None:
                    continue
                pieces.append(
                    ShardPiece(
                        param_index=index,
                        bucket=bucket.index,
                        world_range=world,
                        local_range=world.shifted(-shard.start),
                        param_range=world.shifted(-slot.bucket_range.start),
                    )
                )
        return pieces


MIN_CHUNK = 65_536
TARGET_BUCKETS = 4
TARGET_BUCKETS_GLOO = 2


def default_bucket_size(
    dp_size: int, total_numel: int, *, target_buckets: int = TARGET_BUCKETS
) -> int:
    """Elements per bucket when the caller gives none.

    Three forces: a bucket must be large enough that each rank's chunk of it (bucket / d)
    amortises the per-collective latency (at least ``MIN_CHUNK`` elements per rank); small
    enough that a model is cut into several buckets (``target_buckets``), so the first
    reduce-scatter starts while most of backward is still ahead; and never above Megatron's 40M
    elements (or 1M per rank for very large groups), past which overlap gains nothing and the
    last bucket's exposed communication grows. On gloo, ``DistributedDataParallel`` asks for
    ``TARGET_BUCKETS_GLOO``: there the collectives run on the same CPU cores as the compute,
    so overlap hides less and each extra collective costs its fixed price in CPU time.
    """
    upper = max(40_000_000, 1_000_000 * dp_size)
    per_target = -(-total_numel // target_buckets)
    return max(min(upper, per_target), MIN_CHUNK * dp_size)


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_layout_inputs(
    numels: Sequence[int], *, bucket_size: int, dp_size: int, shard_align: int
) -> None:
    """Raise on sizes no layout can have."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    if shard_align < 1:
        raise ValueError(f"shard_align must be >= 1, got {shard_align}")
    if any(n < 1 for n in numels):
        raise ValueError("every parameter must have at least one element")


def build_layout(
    numels: Sequence[int], *, bucket_size: int, dp_size: int, shard_align: int = SHARD_ALIGN,
    units: Sequence[int] | None = None,
) -> BufferLayout:
    """Lay out parameters of the given element counts; see [Note: layout rule].

    ``units``: per parameter, the gather unit it belongs to (sharded params); a bucket never
    holds two units' params, so that a unit is gathered without its neighbours (see
    [Note: gather units] in ddp/params/gather_units.py). ``shard_align`` exists for tests that
    reproduce hand-drawn pictures (``shard_align=1``).
    """
    check_layout_inputs(numels, bucket_size=bucket_size, dp_size=dp_size,
                        shard_align=shard_align)

    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index, numel in enumerate(numels):
        new_unit = units is not None and current and units[current[-1]] != units[index]
        if current and (current_numel + numel > bucket_size or new_unit):
            groups.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        groups.append(current)

    buckets: list[BucketLayout] = []
    slots: list[ParamSlot | None] = [None] * len(numels)
    offset = 0
    for bucket_index, indices in enumerate(groups):
        bucket_start = offset
        for index in indices:
            start = offset - bucket_start
            slots[index] = ParamSlot(
                index=index,
                bucket=bucket_index,
                bucket_range=Range(start, start + numels[index]),
                buffer_range=Range(offset, offset + numels[index]),
            )
            offset += numels[index]
        used = offset - bucket_start
        offset = bucket_start + pad_to(used, dp_size * shard_align)
        buckets.append(
            BucketLayout(
                index=bucket_index,
                buffer_range=Range(bucket_start, offset),
                num_param_elements=used,
                param_indices=tuple(indices),
                dp_size=dp_size,
            )
        )
    assert all(s is not None for s in slots)
    return BufferLayout(
        dp_size=dp_size,
        numel=offset,
        buckets=tuple(buckets),
        params=tuple(s for s in slots if s is not None),
    )
