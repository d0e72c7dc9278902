"""What a read of ``p.grad`` answers under distopt: the norms of the reduced grad, agreed over
the ranks at the end of the grad sync, and its scaling and clamping in place, on the shards the
optimizer steps. Why and when: [Note: p.grad under distopt] in ddp/grads/grad_marker.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from .. import agreements
from ..buffers.bucket import Bucket

NORMS = "norm types 2 and inf"


class GradReads:
    """Per param, the sum of the squares and the largest magnitude of its reduced grad over
    every rank of ``group``, agreed by ``agree`` (the same numbers on every rank), and this
    rank's piece of it: a view of the reduced grads that the optimizer steps, which ``scale_``
    and ``clamp_`` change in place. ``refused``: params whose ``p.grad`` answers nothing, each
    with why."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        params: list[nn.Parameter],
        names: Mapping[nn.Parameter, str],
        group: dist.ProcessGroup | None,
        stats: comm.CommStats | None,
        refused: Mapping[nn.Parameter, str],
        device: torch.device,
    ) -> None:
        self.params = params
        self.names = names
        self.group = group
        self.stats = stats
        self.refused = dict(refused)
        self.refused_all = ""  # set where every read is refused (ddp/agreements.py)
        self.device = device
        self._index = {p: i for i, p in enumerate(params)}
        # A param lies in one bucket, so this rank holds at most one piece of it.
        self._piece: dict[int, torch.Tensor] = {}
        self._start: dict[int, int] = {}  # where each piece starts in its flattened param
        self._dtype: dict[int, torch.dtype] = {}  # of each param's reduced grad
        for bucket in buckets:
            owned, grad = bucket.owned_range, bucket.owned_grad
            for param, slot in zip(bucket.params, bucket.param_ranges, strict=True):
                self._dtype[self._index[param]] = grad.dtype
                part = slot.intersect(owned)
                if part is not None and param not in self.refused:
                    self._piece[self._index[param]] = grad[part.start - owned.start:
                                                           part.end - owned.start]
                    self._start[self._index[param]] = part.start - slot.start
        self._squares: torch.Tensor | None = None  # [params] fp64, summed over the ranks
        self._largest: torch.Tensor | None = None  # [params] fp64, the max over the ranks
        # An agreement started and not waited for: (indices, rows, output, handle).
        self._pending: tuple | None = None
        # Reads answer the pieces times unscale / divisor: torch.amp.GradScaler.unscale_'s
        # reciprocal scale, and a divisor (ddp.divide_grads) the sync applies at its finish.
        self.unscale = 1.0
        self.divisor = 1.0
        self.why = "before any backward"  # why nothing can be read now
        # Set while the reductions are left to finish at the first read (a pipeline stage).
        self.complete: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the statistics

    @property
    def valid(self) -> bool:
        return self._squares is not None

    @property
    def pending(self) -> bool:
        """Whether an agreement was started and not yet waited for."""
        return self._pending is not None

    def agree(self, used: bytearray | None = None) -> list[bool] | None:
        """After the grad sync, on every rank of the group: every param's statistics, in one
        small all-gather; with ``used`` (this rank's flags, by param), also which params some
        rank computed a grad for."""
        self._start_agreement(used)
        anywhere = self._finish_agreement()
        return None if anywhere is None else [bool(u) for u in anywhere.tolist()]

    def start_agreement(self) -> None:
        """After the grad sync, on every rank of the group: start the all-gather of every
        param's statistics and return; the first read, or ``settle()``, waits for it."""
        self._start_agreement(None)

    def settle(self) -> None:
        """Wait for an agreement in flight, if any (its result stands for the reads)."""
        if self._pending is not None:
            self._finish_agreement()

    def _start_agreement(self, used: bytearray | None) -> None:
        self.settle()
        n = len(self.params)
        self._squares = self._largest = None
        self.complete = None
        self._pending = self._launch(list(range(n)), used)
        self.complete = self._finish_agreement

    def _finish_agreement(self) -> torch.Tensor | None:
        indices, rows, every, handle = self._pending
        self._pending = None
        self.complete = None
        if handle is not None:
            with comm.failures_named("all_gather", "the grad statistics p.grad reads"):
                handle.wait()
        n = len(self.params)
        if self._squares is None:
            self._squares = torch.zeros(n, dtype=torch.float64, device=self.device)
            self._largest = torch.zeros(n, dtype=torch.float64, device=self.device)
        every = every.view(-1, rows, len(indices))
        where = torch.tensor(indices, dtype=torch.long, device=self.device)
        # In rank order on every rank, so every rank holds the same bits; amax keeps a nan.
        self._squares[where] = every[:, 0].sum(0)
        self._largest[where] = every[:, 1].amax(0)
        return every[:, 2].amax(0) if rows == 3 else None

    def _agree(self, indices: list[int]) -> None:
        """The statistics of ``indices`` agreed again now (after a write changed them)."""
        self.settle()
        self._pending = self._launch(indices, None)
        self._finish_agreement()

    def _launch(self, indices: list[int], used: bytearray | None) -> tuple:
        """This rank's statistics of ``indices`` (and ``used`` flags) and the all-gather that
        brings every rank's, started: (indices, rows, output, handle or None)."""
        rows = 2 if used is None else 3
        local = torch.zeros(rows, len(indices), dtype=torch.float64, device=self.device)
        slots, pieces = [], []
        for j, i in enumerate(indices):
            piece = self._piece.get(i)
            if piece is not None:
                slots.append(j)
                pieces.append(piece)
        if pieces:
            where = torch.tensor(slots, device=self.device)
            # Each piece's norms in fp32 whatever the grads' dtype, squared in fp64: what is
            # summed over the ranks carries one fp32 rounding per piece.
            local[0, where] = torch.stack(
                torch._foreach_norm(pieces, 2, dtype=torch.float32)).double().square()
            local[1, where] = _largest_magnitudes(pieces).double()
        if used is not None:
            local[2] = torch.tensor([float(used[i]) for i in indices], dtype=torch.float64,
                                    device=self.device)
        every, handle = comm.all_gather_small_async(local.view(-1), self.group, self.stats,
                                                    op=agreements.GRAD_STATISTICS)
        return indices, rows, every, handle

    def invalidate(self, why: str) -> None:
        """The grads change (a backward): nothing is read until they are agreed again."""
        self.settle()  # every rank waits for what every rank started
        self._squares = self._largest = None
        self.complete = None
        self.why = why

    def reset(self, why: str) -> None:
        """A new step, or after the optimizer's: no unscale or divisor pending either."""
        self.invalidate(why)
        self.unscale = self.divisor = 1.0

    def divided(self, divisor: float) -> None:
        """The pending divisor was applied to the pieces: the statistics follow."""
        if self._squares is not None:
            self._squares.div_(divisor * divisor)
            self._largest.div_(divisor)
        self.divisor = 1.0

    @property
    def multiplier(self) -> float:
        """What the reads multiply the pieces by."""
        return abs(self.unscale) / self.divisor

    # ------------------------------------------------------------------ reads and writes

    @property
    def live(self) -> bool:
        """Whether the pieces hold this step's reduced grads (or will at the first read)."""
        return self._squares is not None or self.complete is not None

    def _readable(self, param: nn.Parameter) -> int:
        if param in self.refused or self.refused_all:
            why = self.refused.get(param, self.refused_all)
            raise RuntimeError(f"p.grad of parameter '{self.names[param]}' {why}")
        # A held sync's completion starts the agreement, whose own completion waits for it.
        while self._squares is None and self.complete is not None:
            self.complete()
        if self._squares is None:
            raise RuntimeError(f"p.grad of parameter '{self.names[param]}' was read "
                               f"{self.why}")
        return self._index[param]

    def norms(self, params: Sequence[nn.Parameter], ord: Any,
              dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        """``torch.linalg.vector_norm(p.grad, ord)`` of each param, in ``dtypes``, from the
        agreed statistics: no communication."""
        indices = [self._readable(p) for p in params]
        where = torch.tensor(indices, dtype=torch.long, device=self.device)
        ord = float(ord)
        if ord == 2:
            values = self._squares[where].sqrt()
        elif ord == math.inf:
            values = self._largest[where].clone()
        else:
            raise RuntimeError(
                f"the norm of type {ord:g} of p.grad of parameter '{self.names[params[0]]}': "
                f"distopt keeps the {NORMS} of each reduced gradient (its shards lie on every "
                "rank), no other; use norm_type=2 or float('inf')"
            )
        values.mul_(self.multiplier)
        out: list[torch.Tensor | None] = [None] * len(indices)
        for dtype in dict.fromkeys(dtypes):
            cast = values.to(dtype).unbind()
            for k, d in enumerate(dtypes):
                if d == dtype:
                    out[k] = cast[k]
        return out  # type: ignore[return-value]

    def scale_(self, params: Sequence[nn.Parameter], factor: Any, *, divide: bool) -> None:
        """Multiply (or divide) each param's grad by one scalar, in place: this rank's pieces
        with torch's own op, the agreed statistics with it."""
        indices = [self._readable(p) for p in params]
        for i in indices:
            piece = self._piece.get(i)
            if piece is not None:
                (piece.div_ if divide else piece.mul_)(factor)
        by = torch.as_tensor(factor, dtype=torch.float64, device=self.device).reshape(())
        if divide:
            by = 1.0 / by
        # A param listed twice is scaled twice, as torch's loop scales it.
        times = torch.bincount(torch.tensor(indices, dtype=torch.long, device=self.device),
                               minlength=len(self.params)).double()
        self._squares.mul_((by * by).pow(times))
        self._largest.mul_(by.abs().pow(times))

    def clamp_(self, params: Sequence[nn.Parameter], low: float | None,
               high: float | None) -> None:
        """Clamp each param's grad to ``[low, high]`` in place. Which grads the bound changes
        is known from the agreed largest magnitudes, alike on every rank; their statistics
        are agreed again (one small all-gather), the others' stand."""
        indices = [self._readable(p) for p in params]
        multiplier = self.multiplier
        largest = self._largest[torch.tensor(indices, dtype=torch.long,
                                             device=self.device)] * multiplier
        acts = largest.isnan()
        if low is not None:
            acts |= -largest < low
        if high is not None:
            acts |= largest > high
        acting = list(dict.fromkeys(i for i, a in zip(indices, acts.tolist(), strict=True) if a))
        if not acting:
            return
        # The pieces hold the grads over the multiplier (a GradScaler's scale, a power of two;
        # a pending divisor): the bound scales alike.
        low = None if low is None else low / multiplier
        high = None if high is None else high / multiplier
        for i in acting:
            piece = self._piece.get(i)
            if piece is not None:
                piece.clamp_(min=low, max=high)
        self._agree(acting)

    # ------------------------------------------------------------------ element-wise writes

    def _values(self, i: int) -> torch.Tensor:
        """This rank's piece of param ``i``, empty where it holds none (so that an op that
        fails, fails on every rank alike, before the agreement's collective)."""
        piece = self._piece.get(i)
        if piece is None:
            piece = torch.empty(0, dtype=self._dtype.get(i, torch.float32), device=self.device)
        return piece

    def write_(self, param: nn.Parameter,
               apply: Callable[[torch.Tensor, int], Any]) -> None:
        """An element-wise write into ``param``'s grad, on every rank: ``apply(values, start)``
        changes in place this rank's piece of the grad as read (the piece times the multiplier),
        whose first element is element ``start`` of the flattened param; then the param's
        statistics are agreed again (one small all-gather)."""
        i = self._readable(param)
        piece, multiplier = self._values(i), self.multiplier
        # The pieces hold the grads over the multiplier (a GradScaler's power of two: exact).
        values = piece if multiplier == 1.0 else piece * multiplier
        apply(values, self._start.get(i, 0))
        if multiplier != 1.0:
            piece.copy_(values.div_(multiplier))
        self._agree([i])

    def assign(self, param: nn.Parameter, grad: torch.Tensor | None) -> None:
        """At the step: ``p.grad = grad`` (None: zeros, the grad of a param left out of it,
        so that no norm or inf check of the step counts it). No communication: each rank
        copies its own range of ``grad``."""
        i = self._index[param]
        piece = self._piece.get(i)
        if piece is None:
            return
        if grad is None:
            piece.zero_()
            return
        start = self._start[i]
        flat = grad.detach().reshape(-1)[start:start + piece.numel()]
        piece.copy_(flat.to(piece.dtype) / self.multiplier)

    # ------------------------------------------------------------------ reductions

    def reduce(self, params: Sequence[nn.Parameter], partial: Callable[[torch.Tensor], Any],
               fill: float, combine: str) -> list[torch.Tensor]:
        """A reduction of each param's grad that the statistics do not answer, on every rank:
        each rank applies ``partial`` to the grad as read (fp64) with ``fill`` (the reduction's
        neutral element) outside its piece, and one small all-gather over the group combines
        the results in rank order, by ``combine`` ("sum", "max" or "min"): exact where the
        partial results are (sums of disjoint elements, maxima), the same bits on every
        rank."""
        indices = [self._readable(p) for p in params]
        parts = []
        for param, i in zip(params, indices, strict=True):
            local = torch.full((param.numel(),), fill, dtype=torch.float64, device=self.device)
            piece = self._piece.get(i)
            if piece is not None:
                start = self._start[i]
                local[start:start + piece.numel()] = piece.double() * self.multiplier
            parts.append(torch.as_tensor(partial(local.view(param.shape)), dtype=torch.float64))
        flat = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)
        every = comm.all_gather_small(flat.to(self.device), self.group, self.stats)
        combined = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0),
                    "min": lambda t: t.amin(0)}[combine](every)
        return [c.view(p.shape) for c, p in zip(
            combined.split([p.numel() for p in parts]), parts, strict=True)]

def _largest_magnitudes(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Each piece's largest magnitude (a nan where it holds one), exact in any dtype. On a CPU
    from ``aminmax`` (one vectorized pass); there torch's norm of type inf takes tens of times
    longer, and it ran on every backward."""
    if pieces[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(pieces, math.inf, dtype=torch.float32))
    largest = []
    for piece in pieces:
        low, high = torch.aminmax(piece)
        largest.append(torch.maximum(high, low.neg()))  # maximum propagates a nan
    return torch.stack(largest).float()
