"""Buckets of whole-tensor params cut so that their shards come out equal: the padding of
[Note: whole-tensor layout] (layout/whole.py) as a packing problem. Pure arithmetic.

[Note: whole-tensor bucketing]
A whole-tensor bucket of ``d`` shards of ``S`` elements holds each param whole in one shard, so
its padding is ``d S`` minus its params' elements, and ``S`` is at least its largest param and
its elements over ``d``. The padding is therefore set by which params share a bucket, before
anyone picks owners: at d = 4, four layers of a GPT's matrices (1024x256, 256x1024, 768x256,
256x256; 4, 4, 3 and 1 units of 65,536) cut into two buckets of two layers each split at best
into shards of 7 units holding 6 on average, 14% of the buckets; the same four layers cut as
(4 4 1 3 4 | 4 1 3 4 4 | 1 3 4 4 1 3) split exactly into shards of 4, 4 and 4.

``cut_buckets`` chooses the cuts: params stay in the given order (a bucket is ready when its
last grad is, so buckets of consecutive params keep backward's order), each bucket within its
capacity, and among all such cuts it takes the one with the least padding, then the fewest
buckets (fewer launches), then the most even sizes (each bucket's reduction starts as early
as the others'). That is a shortest path over the cut positions (dynamic programming over
``n`` positions and the buckets ending at each, at most ``MAX_BUCKET_PARAMS`` params long); the
buckets ending at a position are priced by ``pack`` in the order of a lower bound of their
padding (their lower-bound shard), and the pricing stops once no bound can beat the best
priced, so most buckets are never packed.

``pack`` splits one bucket's params into ``d`` parts with the smallest shard it finds: the
lower bound above (rounded up to the shard alignment) when best-fit decreasing or a bounded
depth-first search reaches it, else the smallest capacity best-fit decreasing fills, found by
bisection below the longest-processing-time split. The search is bounded
(``PACK_SEARCH_NODES``), so ``pack`` is exact where a bucket splits without padding and the
search finds it, and otherwise a good split; buckets of the same sizes are priced once (a
transformer's layers repeat). A Llama-7B-shaped model (291 params) is cut in about a second
at d = 64.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from functools import lru_cache

from .elementwise import pad_to

MAX_BUCKET_PARAMS = 256
"""A bucket of whole-tensor params holds at most this many (bounds the cutting's time)."""

PACK_SEARCH_NODES = 5_000
"""The depth-first search of ``pack`` stops after looking at this many (param, part) pairs."""


def pack(sizes: Sequence[int], parts: int, align: int) -> tuple[int, list[list[int]]]:
    """The smallest shard ``pack`` finds (a multiple of ``align``) that holds ``sizes`` in
    ``parts`` parts, and the positions in ``sizes`` each part holds; see
    [Note: whole-tensor bucketing]."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    shard, bins = _pack_sorted(tuple(sizes[i] for i in order), parts, align)
    return shard, [sorted(order[k] for k in part) for part in bins]


@lru_cache(maxsize=4096)
def _pack_sorted(
    sizes: tuple[int, ...], parts: int, align: int
) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``pack`` for sizes in decreasing order: equal multisets are priced once."""
    total = sum(sizes)
    lower = pad_to(max(sizes[0], -(-total // parts)), align)
    # Longest processing time first: a split always found, the search's upper end.
    heap = [(0, p) for p in range(parts)]
    best: list[list[int]] = [[] for _ in range(parts)]
    for k, size in enumerate(sizes):
        load, least = heapq.heappop(heap)
        best[least].append(k)
        heapq.heappush(heap, (load + size, least))
    loads = [load for load, _ in heap]
    upper = pad_to(max(loads), align)
    if upper > lower:
        found = _best_fit(sizes, parts, lower) or _search(sizes, parts, lower)
        if found is not None:
            upper, best = lower, found
        low = lower  # no split found below or at low (the lower bound: none exists)
        while upper - low > align:
            middle = pad_to((low + upper) // 2, align)
            if middle >= upper:
                break
            found = _best_fit(sizes, parts, middle)
            if found is None:
                low = middle
            else:
                upper, best = middle, found
    return upper, tuple(tuple(part) for part in best)


def _best_fit(sizes: tuple[int, ...], parts: int, shard: int) -> list[list[int]] | None:
    """Largest first into the fullest part it fits, or None if one fits nowhere."""
    by_load = [(0, p) for p in range(parts)]  # (load, part), increasing
    bins: list[list[int]] = [[] for _ in range(parts)]
    for k, size in enumerate(sizes):
        fullest = bisect.bisect_right(by_load, (shard - size, parts)) - 1
        if fullest < 0:
            return None
        load, p = by_load.pop(fullest)
        bins[p].append(k)
        bisect.insort(by_load, (load + size, p))
    return bins


def _search(sizes: tuple[int, ...], parts: int, shard: int) -> list[list[int]] | None:
    """A depth-first search for a split into parts of at most ``shard``, largest first,
    trying each distinct part load once; None when none is found within the node budget."""
    loads, bins = [0] * parts, [[] for _ in range(parts)]
    nodes = 0

    def place(k: int) -> bool:
        nonlocal nodes
        if k == len(sizes):
            return True
        size = sizes[k]
        # A part the param fills exactly is the one to take: no other choice does better.
        if shard - size in loads:
            choices: Sequence[int] = (loads.index(shard - size),)
        else:
            choices = range(parts)
        tried = set()
        for p in choices:
            nodes += 1
            if nodes > PACK_SEARCH_NODES:
                return False
            if loads[p] in tried or loads[p] + size > shard:
                continue
            tried.add(loads[p])
            loads[p] += size
            bins[p].append(k)
            if place(k + 1):
                return True
            loads[p] -= size
            bins[p].pop()
        return False

    return bins if place(0) else None


def cut_buckets(
    numels: Sequence[int], capacity: Callable[[int], int], parts: int, align: int
) -> list[tuple[list[int], int, list[list[int]]]]:
    """Consecutive buckets of the params ``numels`` (in order) with the least padding: for each,
    its positions, its shard and the positions of each part; see [Note: whole-tensor bucketing].
    ``capacity(largest)``: the most elements a bucket whose largest param is ``largest`` may
    hold."""
    n = len(numels)
    most = capacity(max(numels, default=0))  # no bucket holds more
    # best[j]: (padding, buckets, sum of squared sizes) of the best cut of the first j params,
    # and where its last bucket starts.
    best: list[tuple[tuple[int, int, int], int]] = [((0, 0, 0), 0)]
    for end in range(1, n + 1):
        # Every bucket that may end here, keyed by a lower bound of the cut's key (its padding
        # at the bucket's lower-bound shard); priced in that order until no bound can win.
        bounds: list[tuple[tuple[int, int, int], int, tuple[int, ...]]] = []
        elements = largest = 0
        window: list[int] = []  # the sizes of numels[start:end], increasing
        for start in range(end - 1, max(-1, end - 1 - MAX_BUCKET_PARAMS), -1):
            elements += numels[start]
            largest = max(largest, numels[start])
            bisect.insort(window, numels[start])
            if start < end - 1 and elements > most:
                break
            if start < end - 1 and elements > capacity(largest):
                continue  # a larger param further back may still raise the capacity
            before = best[start][0]
            lower = pad_to(max(largest, -(-elements // parts)), align)
            key = (before[0] + parts * lower - elements, before[1] + 1,
                   before[2] + elements * elements)
            bounds.append((key, start, tuple(reversed(window))))
        bounds.sort()
        choice: tuple[tuple[int, int, int], int] | None = None
        for bound, start, sizes in bounds:
            if choice is not None and bound >= choice[0]:
                break  # no bucket left can beat the best so far
            shard = _pack_sorted(sizes, parts, align)[0]
            elements = sum(sizes)
            key = (best[start][0][0] + parts * shard - elements, bound[1], bound[2])
            if choice is None or key < choice[0]:
                choice = (key, start)
        assert choice is not None  # a bucket of the one param before ``end`` always fits
        best.append(choice)
    cuts: list[tuple[list[int], int, list[list[int]]]] = []
    end = n
    while end > 0:
        start = best[end][1]
        shard, bins = pack(numels[start:end], parts, align)
        cuts.append((list(range(start, end)), shard, [[start + k for k in b] for b in bins]))
        end = start
    return cuts[::-1]
