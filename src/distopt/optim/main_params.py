"""The fp32 main params of the part of one flat buffer that a rank owns.

One ``nn.Parameter`` per ``ShardPiece`` (a param's overlap with the rank's shard of a bucket): a
view into the model's param buffer (fp32 params), into ``shard_fp32`` [owned numel] (other dtypes),
or, with ``store_param_remainders``, a placeholder that holds the fp32 masters only inside
``bucket_masters`` (see [Note: param remainders] in optim/remainders.py). Their grads are views of
the reduced grads (fp32), of ``grad_fp32`` [owned numel], or transient copies of one bucket. They
are the main params' ``.grad`` only while a step runs (between steps ``.grad`` is None, so that
nothing reads grads that are not reduced yet, such as ``torch.amp.GradScaler.unscale_`` iterating
the optimizer's params); see [Note: p.grad under distopt] in ddp/grads/grad_marker.py. The step
(optim/step.py) reads them through these methods alone.

[Note: writes into the params]
With bf16 or fp16 params the fp32 main params are a second copy, made when the optimizer is
built, and the step writes the params from them. A write into the params after that (torch's
``ddp.module.load_state_dict(sd)``, ``set_model_state_dict``, ``with torch.no_grad():
p.copy_(v)``) would be undone by the next step, which casts the old masters plus the update
back. So the step first takes such writes up. Every in-place write bumps a version counter:
a write through a param its own (a param aliases its buffer through ``.data``, which keeps the
param's counter), a write into the buffer (a gather, a loaded shard) the buffer's, which its
views share. With sharded params a write into params gathered by ``gathered_params()`` is
copied back into the rank's shard when the block ends (``Bucket.keep_param_writes``).
``note_params_written`` records both counters where distopt last wrote the params (the end
of a step, once the gathers are launched; a load); at the next step a changed counter means
someone else wrote: each element whose param differs from its master
rounded to the param's dtype takes the param's value as its master. Elements not written keep
their fp32 masters exactly. With ``store_param_remainders`` the param is the high half of the
master and nothing else holds the old value, so the written buffer's remainders are zeroed: the
masters become the params' values, exact for what was written and rounded once to bf16 for the
rest, as a load from a bf16 checkpoint would. fp32 params are their own masters. Cost: one
read of each param's and each bucket's version counter per step, and a compare of the rank's
shard only in a step after a write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..ddp.buffers.buffer import ParamAndGradBuffer
from ..layout.elementwise import ShardPiece
from ..parallel.dtensor import local_tensor
from .remainders import join_fp32, split_fp32

MasterAllocator = Callable[[int, int, torch.dtype], torch.Tensor]
"""``allocate(bucket, numel, dtype)``: a zeroed tensor for one bucket's masters."""


class ShardMainParams:
    """The fp32 main params of the part of one buffer that this rank owns, as pieces."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        *,
        sharded: bool,
        store_remainders: bool = False,
        whole_params: frozenset[nn.Parameter] = frozenset(),
        allocate: MasterAllocator | None = None,
    ) -> None:
        """``whole_params``: the params a whole-tensor optimizer steps; their pieces are whole
        (the layout makes sure of it) and their main params take the param's own shape. See
        [Note: optimizer kinds]. ``allocate(bucket, numel, dtype)``: where each bucket's
        masters (or remainders) live, one tensor per bucket, zeros at first (the offload tier,
        [Note: the offload tier] in optim/offload.py); None: one flat tensor in memory."""
        self.buffer = buffer
        layout = buffer.layout
        pieces = layout.shard_pieces(buffer.dp_rank) if sharded else layout.whole_pieces()
        # Per bucket, the owned regions of the model buffers and their offset in the fp32 copies.
        self.param_regions = [b.param_shard if sharded else b.param_data for b in buffer.buckets]
        # owned_grad: the whole bucket unsharded (all-reduced, or one rank), also with sharded
        # grads, which keep no grad_data.
        self.grad_regions = [b.grad_shard if sharded else b.owned_grad for b in buffer.buckets]
        offsets, total = [], 0
        for region in self.param_regions:
            offsets.append(total)
            total += region.numel()

        fp32 = torch.float32
        device = buffer.params[0].device
        # Separate fp32 copies only where the model's dtype is not fp32 (docs/design.md, Memory).
        self.shard_fp32 = None
        self.remainders = None  # with store_remainders; see [Note: param remainders]
        self.store_remainders = store_remainders
        if allocate is not None:
            dtype = (torch.int16 if store_remainders
                     else fp32 if buffer.param_dtype != fp32 else None)
            segments = ([allocate(b, r.numel(), dtype) for b, r in enumerate(self.param_regions)]
                        if dtype is not None else None)
            self.remainders = segments if store_remainders else None
            self.shard_fp32 = segments if not store_remainders else None
        elif store_remainders:
            self.remainders = torch.zeros(total, dtype=torch.int16, device=device)
        elif buffer.param_dtype != fp32:
            self.shard_fp32 = torch.empty(total, dtype=fp32, device=device)
        # With remainders, bf16/fp16 grads get fp32 copies one bucket at a time during the
        # step, like the masters; see [Note: param remainders].
        self.transient_grads = store_remainders and buffer.grad_dtype != fp32
        self.grad_fp32 = None
        if buffer.grad_dtype != fp32 and not self.transient_grads:
            self.grad_fp32 = torch.empty(total, dtype=fp32, device=device)
        self._main_segments = self._segments(self.shard_fp32, offsets, self.param_regions)
        self._grad_segments = self._segments(self.grad_fp32, offsets, self.grad_regions)
        self._remainder_segments = (
            self._segments(self.remainders, offsets, self.param_regions)
            if self.remainders is not None else []
        )
        self.copy_params_in()
        self.note_params_written()

        self.pieces: list[ShardPiece] = pieces
        self.main_params: list[nn.Parameter] = []
        # Each main param's persistent fp32 grad (None with transient grads), its .grad only
        # inside the step (expose_grads .. hide_grads).
        self.main_grads: list[torch.Tensor | None] = []
        # What a main param holds between steps with remainders: one scalar, seen as its shape.
        self._placeholder = (
            torch.zeros(1, dtype=fp32, device=device) if store_remainders else None
        )
        for piece in pieces:
            grad = self._grad_segments[piece.bucket]
            lo, hi = piece.local_range.start, piece.local_range.end
            shape = self._main_shape(piece, whole_params)
            if not store_remainders:
                main = self._main_segments[piece.bucket][lo:hi].view(shape)  # aliases fp32 copy
            else:
                main = self._placeholder.expand(shape)
            param = nn.Parameter(main, requires_grad=True)
            self.main_grads.append(None if self.transient_grads else grad[lo:hi].view(shape))
            self.main_params.append(param)
        # The (main param, piece) pairs of each bucket, for steps one bucket at a time.
        self._bucket_mains: list[list[tuple[nn.Parameter, ShardPiece]]] = [
            [] for _ in self.param_regions
        ]
        for main, piece in zip(self.main_params, pieces, strict=True):
            self._bucket_mains[piece.bucket].append((main, piece))

    @staticmethod
    def _segments(
        flat: torch.Tensor | list[torch.Tensor] | None, offsets: list[int],
        regions: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if flat is None:
            return regions
        if isinstance(flat, list):  # one tensor per bucket already (offloaded)
            return flat
        return [flat[o : o + r.numel()] for o, r in zip(offsets, regions, strict=True)]

    def master_storage(self) -> list[torch.Tensor]:
        """The tensors that keep the masters between steps: the fp32 copies or the int16
        remainders (one flat tensor, or one per bucket when offloaded); none for fp32 params."""
        kept = self.remainders if self.store_remainders else self.shard_fp32
        if kept is None:
            return []
        return kept if isinstance(kept, list) else [kept]

    def _main_shape(
        self, piece: ShardPiece, whole_params: frozenset[nn.Parameter]
    ) -> tuple[int, ...]:
        local = local_tensor(self.model_param(piece))
        if self.model_param(piece) not in whole_params:
            return (piece.param_range.size,)
        if piece.param_range.size != local.numel():
            raise AssertionError(
                "a whole-tensor param is split across ranks; the buffers were not laid out "
                "for its optimizer (see [Note: layout planned once] in layout/model_layout.py)"
            )
        return tuple(local.shape)

    def model_param(self, piece: ShardPiece) -> nn.Parameter:
        return self.buffer.params[piece.param_index]

    def note_params_written(self) -> None:
        """The params now hold what distopt wrote; see [Note: writes into the params]."""
        self._versions = self._write_counts()

    def _write_counts(self) -> list[int]:
        # A param aliases its buffer through ``.data``, which keeps the param's own version
        # counter: a write through the param bumps that one, a write into the buffer (a
        # gather, a shard loaded) the buffer's.
        return [*(region._version for region in self.param_regions),
                *(param._version for param in self.buffer.params)]

    def adopt_param_writes(self) -> None:
        """Make the masters follow what was written into the params since
        ``note_params_written``; see [Note: writes into the params]."""
        if self.shard_fp32 is None and not self.store_remainders:
            return  # fp32 params are their own masters
        if self._write_counts() == self._versions:
            return
        with torch.no_grad():
            for bucket, region in enumerate(self.param_regions):
                if self.store_remainders:
                    self._remainder_segments[bucket].zero_()
                    continue
                main = self._main_segments[bucket]
                written = region != main.to(region.dtype)
                main.copy_(torch.where(written, region.to(main.dtype), main))
        self.note_params_written()

    def copy_params_in(self) -> None:
        """Model params -> fp32 main params (at construction)."""
        if self.shard_fp32 is not None:
            torch._foreach_copy_(self._main_segments, self.param_regions)

    def copy_bucket_params_out(self, bucket: int) -> None:
        """One bucket's updated fp32 main params -> its region of the model's param buffer."""
        if self.shard_fp32 is not None:
            self.param_regions[bucket].copy_(self._main_segments[bucket])

    def copy_grads_in(self) -> None:
        """Reduced grads -> fp32 main grads, one copy per bucket."""
        if self.grad_fp32 is not None:
            torch._foreach_copy_(self._grad_segments, self.grad_regions)

    def expose_grads(self) -> None:
        """Give every main param its persistent fp32 grad as ``.grad`` (for the step)."""
        for main, grad in zip(self.main_params, self.main_grads, strict=True):
            main.grad = grad

    def hide_grads(self) -> None:
        """Drop the main params' ``.grad`` (after the step)."""
        for main in self.main_params:
            main.grad = None

    def copy_params_out(self) -> None:
        """Updated fp32 main params -> this rank's region of the model's param buffer (with
        remainders the step has written it already)."""
        if self.shard_fp32 is not None:
            torch._foreach_copy_(self.param_regions, self._main_segments)

    # ------------------------------------------------------------------ remainders

    @property
    def num_buckets(self) -> int:
        return len(self.param_regions)

    def bucket_main_params(self, bucket: int) -> list[nn.Parameter]:
        """The main params of one bucket's shard, for steps one bucket at a time."""
        return [main for main, _ in self._bucket_mains[bucket]]

    @contextlib.contextmanager
    def bucket_masters(self, bucket: int) -> Iterator[list[nn.Parameter]]:
        """With remainders: the bucket's main params hold its fp32 masters (one transient
        bucket shard) inside the block, and are split back after it."""
        mains = self._bucket_mains[bucket]
        master = join_fp32(self.param_regions[bucket], self._remainder_segments[bucket])
        for main, piece in mains:
            lo, hi = piece.local_range.start, piece.local_range.end
            main.data = master[lo:hi].view(main.shape)
        try:
            yield self.bucket_main_params(bucket)
        finally:
            split_fp32(master, self.param_regions[bucket], self._remainder_segments[bucket])
            for main, _ in mains:
                main.data = self._placeholder.expand(main.shape)

    @contextlib.contextmanager
    def bucket_grads(self, bucket: int) -> Iterator[tuple[list[nn.Parameter], bool]]:
        """The bucket's main params with their fp32 main grads as ``.grad`` inside the block,
        and whether those grads are new copies of the reduced grads. With transient grads they
        are (one transient bucket shard, dropped after the block); otherwise they are the
        persistent main grads."""
        mains = self._bucket_mains[bucket]
        fresh = self.transient_grads
        grad = self.grad_regions[bucket].float() if fresh else self._grad_segments[bucket]
        for main, piece in mains:
            main.grad = grad[piece.local_range.start : piece.local_range.end].view(main.shape)
        try:
            yield self.bucket_main_params(bucket), fresh
        finally:
            for main, _ in mains:
                main.grad = None

    def main_value(self, main: nn.Parameter, piece: ShardPiece) -> torch.Tensor:
        """The fp32 master values of a piece: the main param, or rebuilt from remainders."""
        if not self.store_remainders:
            return main.detach()
        lo, hi = piece.local_range.start, piece.local_range.end
        return join_fp32(self.param_regions[piece.bucket][lo:hi],
                         self._remainder_segments[piece.bucket][lo:hi]).view(main.shape)
