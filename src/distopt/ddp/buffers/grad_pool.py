"""The transient grad storage of sharded grads: a few bucket-sized buffers, reused.

[Note: sharded grads]
With ``DistributedDataParallel(shard_grads=True)`` no rank holds grads for the whole model
between steps. Each buffer keeps ``grad_shards`` [numel / d]: bucket by bucket, this rank's
shard of the reduced grads, which ``bucket.grad_shard`` and ``bucket.owned_grad`` view, so the
optimizer reads them as it reads the shards of the full buffer. A bucket's full grads live in a
buffer of the ``GradPool`` of their dtype only while it needs them:

* at its first grad of a backward the bucket takes a buffer; its params' ``main_grad`` become
  views into it, written and added to as in the full buffer ([Note: grads written, not zeroed]);
* at its launch ([Note: bucket launch order]) the params that got no grad and the padding are
  zeroed (a reused buffer holds another bucket's values there) and the buffer is
  reduce-scattered: the step's first reduction straight into the kept shard, later ones in
  place, to be added to it;
* when that reduction is waited for, the addition is done and the buffer goes back to the pool
  (``main_grad`` is None again).

Waits are lazy: the pool double-buffers (one bucket filling while the one before it is on the
wire; one buffer on a single rank or without overlap, where nothing is in flight during
backward), and beyond that a bucket that needs a buffer when none is free waits for the oldest
reduction in flight, which frees one; only when no reduction is in flight does the pool grow.
So k, the most buffers live at once (``GradPool.peak_buffers``), is what the order of grads in
backward asks for: 2 where each bucket's grads arrive after those of the bucket launched before
it; more when buckets fill out of their launch order: a bucket whose first grad comes early in
backward but whose launch waits for buckets before it (a param registered early but used late
in the forward) holds its buffer meanwhile, and a param that gets no grad in this backward (a
branch not taken) holds back every bucket after it until backward ends, each with its buffer:
at worst the full buffer, transiently. The peak during backward is the kept shards plus k
buffers of the largest bucket. A model whose backward itself communicates (the token
all-to-all of experts, [Note: expert parallelism] in parallel/experts.py) must not wait for
a reduction in a grad hook: a peer whose launches are held back (by an expert that got no
token there) launches that reduction only when its backward ends, and may first wait in the
all-to-all for this rank; its pool waits only for reductions already done and grows instead.
``finish_grad_sync`` and ``zero_grad_buffer`` drop the buffers, so nothing transient is held
between steps; on CUDA the caching allocator hands the same blocks back in the next step,
without new device allocations.

Every backward reduces, since there is no full buffer to accumulate micro-batches in. The first
grad hook of a backward queues a callback on the autograd engine that, when backward ends,
launches every bucket not launched yet, in launch order (one whose params got no grad reduces
zeros), and makes the next backward expect every grad again; that backward's first grad waits
for whatever is still in flight (it overlapped with the forward), so that second stages keep
one order on every rank and a kept shard takes one addition at a time. So each micro-batch costs one
reduce-scatter of the model, inside ``no_sync()`` too, and the result is the sum of the
micro-batches' averages: equal to the full buffer's average of their sum, but not bit for bit
(one rounding per micro-batch, in another order). With one backward per step the arithmetic is
the same: the same grads reduced by the same collective, so the bits are the same too. A
hierarchical mesh's second stage (the average over replicas) runs on the kept shard in a
backward outside ``no_sync``, and in ``finish_grad_sync`` only if a reduction under ``no_sync``
was added after it: averaging is linear (and leaves an average unchanged), so once per step is
enough in the usual pattern, the last micro-batch synced. A second backward without
``no_sync`` or ``zero_grad`` is not an error here: it reduces and adds, as a further
micro-batch would. A grad for a bucket already launched in the same backward still raises
([Note: grads after the reduction] in ddp/grads/grad_sync.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

import torch

from ...layout.model_layout import PlannedBuffer


class _Holder(Protocol):
    """A bucket that holds a pool buffer while its reduction is in flight."""

    @property
    def holds_buffer(self) -> bool: ...

    def finish_first_stage(self) -> None: ...

    @property
    def reduction_completed(self) -> bool: ...


class GradPool:
    """Buffers of ``numel`` elements (the largest bucket of one grad dtype), lent to buckets
    from their first grad until their reduction is waited for; see [Note: sharded grads]."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, *,
                 in_flight: int, blocking: bool = True) -> None:
        """``in_flight``: buffers the pool grows to before it waits for a reduction (2 to
        overlap one with the next bucket's grads, 1 when nothing overlaps); without
        ``blocking`` it takes only the buffers of reductions already done, and grows instead
        of waiting (a backward that communicates itself; see above)."""
        self.blocking = blocking
        self.numel = numel
        self.min_buffers = in_flight  # grown to before it waits
        self.dtype = dtype
        self.device = device
        self._free: list[torch.Tensor] = []
        self._in_flight: deque[_Holder] = deque()  # buckets launched with a buffer, in order
        self.live_buffers = 0
        self.peak_buffers = 0  # the most buffers live at once since built (or reset_peak)

    @property
    def buffer_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def acquire(self) -> torch.Tensor:
        """A buffer [numel] of stale values: a free one, else a new one up to ``in_flight``,
        else the one the oldest reduction in flight frees when waited for, else a new one."""
        while not self._free and self.live_buffers >= self.min_buffers and self._in_flight:
            holder = self._in_flight[0]
            if not self.blocking and holder.holds_buffer and not holder.reduction_completed:
                break
            self._in_flight.popleft()
            if holder.holds_buffer:  # else it was waited for already and gave its buffer back
                holder.finish_first_stage()
        if not self._free:
            self._free.append(torch.empty(self.numel, dtype=self.dtype, device=self.device))
            self.live_buffers += 1
            self.peak_buffers = max(self.peak_buffers, self.live_buffers)
        return self._free.pop()

    def launched(self, holder: _Holder) -> None:
        """``holder``'s reduction is in flight: waiting for it frees its buffer."""
        self._in_flight.append(holder)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)

    def release(self) -> None:
        """Drop the free buffers (the end of a step's sync); buckets hold none by then."""
        self.live_buffers -= len(self._free)
        self._free.clear()
        self._in_flight.clear()

    def reset_peak(self) -> None:
        self.peak_buffers = self.live_buffers


def grad_pools_for(buffers: Iterable[PlannedBuffer], device: torch.device, *,
                   overlaps: bool, blocking: bool = True) -> dict[torch.dtype, GradPool]:
    """One pool per grad dtype of ``buffers``, its buffers the size of the largest bucket of
    that dtype; double-buffered when reductions ``overlaps`` backward, else one buffer;
    ``blocking``: whether it may wait for a reduction in flight (see GradPool)."""
    largest: dict[torch.dtype, int] = {}
    for buf in buffers:
        size = max(b.buffer_range.size for b in buf.layout.buckets)
        largest[buf.grad_dtype] = max(largest.get(buf.grad_dtype, 0), size)
    return {dtype: GradPool(numel, dtype, device, in_flight=2 if overlaps else 1,
                            blocking=blocking)
            for dtype, numel in largest.items()}
