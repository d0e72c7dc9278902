"""Where a bucket's params live: the whole bucket all step long, or this rank's shard of it.

[Note: sharded params]
With ``DistributedDataParallel(shard_params=True)`` (``sharding="optim_grads_params"``) no rank
holds the whole model between uses. Each buffer keeps ``param_shards`` [numel / d]: bucket by
bucket, this rank's shard of the params in their own dtype, which ``bucket.param_shard`` views,
so the optimizer reads and writes it as it writes the shard of the full param buffer (the
step gathers nothing). A bucket's full params exist only while a module uses them:

* before the forward of a module that registers a param of the bucket, the bucket borrows a
  buffer of the ``ParamPool`` of its dtype and all-gathers every rank's shard into it; its
  params' ``.data`` become views into it (``ParamState.GATHERED``);
* after the forward of the last module that registers one of its params, the params become
  placeholders again and the buffer goes back to the pool (``reshard_after_forward=True``,
  the default), or they stay until backward has used them (``False``: less communication,
  more memory);
* before the backward of such a module (a hook on its outputs' grads) the bucket is gathered
  again if it was freed; once every param of the bucket has its grad, the buffer goes back;
  the grads themselves reduce-scatter as with sharded grads ([Note: sharded grads] in
  ddp/buffers/grad_pool.py), which ``shard_params`` implies.

Between uses a param is a placeholder: one NaN element seen through the param's shape and
dtype (no memory), whose value reads raise, naming the param ([Note: reads between uses] in
ddp/buffers/param_placeholder.py). ``ddp.full_state_dict()`` and ``with
ddp.gathered_params():`` give the full values where a user needs them (saving, evaluation).
Autograd keeps using the params themselves: ``.data`` changes in place of the tensor, as
FSDP1 does, so a saved param is read as whatever it holds when its backward runs, which the
pre-backward gather makes the full values.

The transient memory is k gathered buckets: those a running module holds, the next one
prefetched (forward order in forward, launch order in backward), and, with
``reshard_after_forward=False``, every bucket the forward gathered until its grads are in.
``ParamPool.peak_buffers`` and ``peak_bytes`` are k and its bytes as measured. A bucket shared
by modules far apart in the forward (a tied embedding and head) stays gathered from the first
to the last of them. Each bucket gathers into a buffer of its own whose storage is resized to
nothing when freed and back when gathered (as FSDP does), so that tensors autograd saved from
its params in forward (``weight.t()`` views) read the gathered values again in backward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import collectives as comm
from ...comm import gate
from ...layout.elementwise import Range
from ...parallel.dtensor import alias_local, is_dtensor, local_tensor
from ..state import PARAM_TRANSITIONS, ParamState, advance
from .gathered_views import backward_keeps_graph, viewed_elsewhere
from .param_placeholder import locate_pieces, name_of, show_between_uses, show_in_use
from .rebound_params import take_up

# What a sharded-params collective that timed out names beside a stuck rank; see
# [Note: every rank runs the same modules] in ddp/params/param_unshard.py.
SAME_MODULES = (
    "the ranks ran the forwards of different modules: with shard_params=True a module's "
    "forward and backward gather its params with every rank, so every rank must run the same "
    "modules (a mixture of experts with an nn.Module per expert: call an expert no token was "
    "routed to on an empty batch rather than skip it, or hold the experts in one module's "
    "stacked weights, as transformers' Mixtral does)"
)


class ParamPool:
    """The gathered buckets of one param dtype: how many are alive, and the most at once.

    Each bucket gathers into a buffer of its own whose storage is resized to nothing when it is
    freed and back when it is gathered again: the storage stays the same object, so tensors
    autograd saved from its params in forward (``weight.t()`` views) read the right values in
    backward. On CUDA the caching allocator hands the same blocks back at every gather; on the
    CPU each gather allocates the bucket's bytes and each free returns them.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.live_buffers = 0
        self.live_bytes = 0
        self.peak_buffers = 0  # the most gathered buckets at once since built (or reset_peak)
        self.peak_bytes = 0
        # Storages a free left to views kept of them rather than resizing them ([Note: views
        # that outlive a gather] in ddp/buffers/gathered_views.py): none in a training step.
        self.left_to_views = 0
        # Called after each free: the unsharder's deferred prefetch ([Note: where a param is
        # used] in ddp/params/param_unshard.py).
        self.on_free: Callable[[], None] | None = None

    def gathered(self, nbytes: int) -> None:
        self.live_buffers += 1
        self.live_bytes += nbytes
        self.peak_buffers = max(self.peak_buffers, self.live_buffers)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def freed(self, nbytes: int) -> None:
        self.live_buffers -= 1
        self.live_bytes -= nbytes
        if self.on_free is not None:
            self.on_free()

    def reset_peak(self) -> None:
        self.peak_buffers, self.peak_bytes = self.live_buffers, self.live_bytes


class FullParams:
    """Every param of the bucket in the model's param buffer, all step long."""

    sharded = False
    state = ParamState.GATHERED

    def __init__(self, param_data: torch.Tensor, param_shard: torch.Tensor) -> None:
        self.param_data: torch.Tensor | None = param_data  # [bucket numel]
        self.param_shard = param_shard  # [bucket numel / d], a view of param_data

    def start_gather(self, group: Any, stats: Any, who: str) -> None:
        """Always whole: nothing to gather around a use."""

    def wait(self, who: str) -> None:
        """Always whole."""

    def release(self, who: str, *, placeholders: bool = True,
                autograd_reads: bool = False) -> None:
        """Always whole: nothing to free."""


class ShardedParams:
    """This rank's shard of the bucket's params, and a pool buffer while they are gathered."""

    sharded = True

    def __init__(self, param_shard: torch.Tensor, pool: ParamPool, bucket_numel: int,
                 params: list[nn.Parameter], param_ranges: list[Range],
                 placeholder: torch.Tensor, shard_start: int = 0) -> None:
        """``shard_start``: where this rank's shard begins in the bucket."""
        self.param_shard = param_shard  # [bucket numel / d], kept between uses
        self.pool = pool
        # [bucket numel]: its storage holds memory only while gathered (see ParamPool).
        self._full = self._empty_full(bucket_numel, param_shard)
        self._nbytes = bucket_numel * param_shard.element_size()
        self._slots = [(p, r, local_tensor(p).shape) for p, r in zip(params, param_ranges,
                                                                     strict=True)]
        self._placeholder = placeholder
        self._handle: Any = None
        self._gathered_version = -1  # the buffer's version once gathered
        self.state = ParamState.SHARDED
        store = weakref.ref(self)  # the registry must not keep a dropped model's shards
        for param, slot in zip(params, param_ranges, strict=True):
            if not is_dtensor(param):
                locate_pieces(param, functools.partial(_piece_in, store, slot, shard_start))

    def _piece_of(self, slot: Range, shard_start: int) -> tuple[torch.Tensor, int]:
        """This rank's piece of the param at ``slot`` (bucket coordinates): a 1-D view of
        the shard, and its offset in the flattened param ([Note: writes between uses] in
        ddp/buffers/param_placeholder.py)."""
        size = self.param_shard.numel()
        start = min(max(slot.start, shard_start), shard_start + size)
        end = max(min(slot.end, shard_start + size), start)
        return (self.param_shard[start - shard_start : end - shard_start],
                start - slot.start if end > start else 0)

    @staticmethod
    def _empty_full(numel: int, like: torch.Tensor) -> torch.Tensor:
        # [numel] on a storage of no bytes: given them at each gather.
        full = torch.empty(numel, dtype=like.dtype, device=like.device)
        full.untyped_storage().resize_(0)
        return full

    @property
    def param_data(self) -> torch.Tensor | None:
        """[bucket numel] while gathered (or gathering), else None."""
        return None if self.state is ParamState.SHARDED else self._full

    def _advance(self, new: ParamState, who: str) -> None:
        self.state = advance(self.state, new, PARAM_TRANSITIONS, who)

    def show_placeholders(self) -> None:
        """Every param of the bucket as its placeholder (nothing gathered), whose value reads
        raise ([Note: reads between uses] in ddp/buffers/param_placeholder.py)."""
        with torch.no_grad():
            for param, _, shape in self._slots:
                alias_local(param, self._placeholder.expand(shape))
                show_between_uses(param)

    def start_gather(self, group: dist.ProcessGroup | None, stats: comm.CommStats | None,
                     who: str) -> None:
        """Give the buffer its memory back and start gathering every rank's shard into it
        (nothing to do when gathered or gathering already)."""
        if self.state is not ParamState.SHARDED:
            return
        gate.settle()  # a forward check in flight, before this rank changes anything
        self._full.untyped_storage().resize_(self._nbytes)
        self.pool.gathered(self._nbytes)
        with comm.failures_named("all_gather", who, SAME_MODULES):
            handle = comm.all_gather(self._full, self.param_shard, group, async_op=True,
                                     stats=stats)
        self._handle = None if handle is comm.DONE else handle
        self._advance(ParamState.GATHERING, who)

    def wait(self, who: str) -> None:
        """Finish the gather, if one is in flight, and show the params as views into it."""
        if self.state is not ParamState.GATHERING:
            return
        handle, self._handle = self._handle, None
        if handle is not None:
            with comm.failures_named("all_gather", who, SAME_MODULES):
                handle.wait()
        with torch.no_grad():
            for param, slot, shape in self._slots:
                alias_local(param, self._full[slot.start : slot.end].view(shape))
                show_in_use(param)
        self._gathered_version = self._write_count()
        self._advance(ParamState.GATHERED, who)

    def _write_count(self) -> int:
        # Writes through a param bump its own counter (it aliases the buffer through .data).
        return self._full._version + sum(param._version for param, _, _ in self._slots)

    def keep_writes(self, rank: int) -> None:
        """Copy this rank's part of the gathered buffer back into the shard where anything
        wrote into the buffer since it was gathered (``p.copy_`` inside ``gathered_params()``),
        or a param was rebound to other storage (``vector_to_parameters``; its values go into
        the buffer first, [Note: params rebound] in ddp/buffers/rebound_params.py)."""
        if self.state is not ParamState.GATHERED:
            return
        for param, slot, shape in self._slots:  # [Note: params rebound]
            view = self._full[slot.start : slot.end].view(shape)
            if not is_dtensor(param) and param.data_ptr() != view.data_ptr():
                take_up(param, view, name_of(param))  # a write into the buffer: kept below
        if self._write_count() == self._gathered_version:
            return
        size = self.param_shard.numel()
        with torch.no_grad():
            self.param_shard.copy_(self._full[rank * size : (rank + 1) * size])
        self._gathered_version = self._write_count()

    def release(self, who: str, *, placeholders: bool = True,
                autograd_reads: bool = False) -> None:
        """Back to the shard alone: placeholders (unless the params were given storage of
        their own), the buffer's memory freed, or left to views kept of it unless autograd
        will read them again (``autograd_reads``: the end of a forward with grad enabled);
        see [Note: views that outlive a gather] in ddp/buffers/gathered_views.py."""
        if self.state is ParamState.SHARDED:
            return
        self.wait(who)  # a gather in flight still writes into the buffer
        if placeholders:
            self.show_placeholders()
        if (not autograd_reads and not backward_keeps_graph()
                and viewed_elsewhere(self._full)):
            self._full = self._empty_full(self._full.numel(), self._full)
            self.pool.left_to_views += 1
        else:
            self._full.untyped_storage().resize_(0)
        self.pool.freed(self._nbytes)
        self._advance(ParamState.SHARDED, who)


def _piece_in(store: weakref.ref, slot: Range, shard_start: int) -> tuple[torch.Tensor, int]:
    return store()._piece_of(slot, shard_start)


def placeholders_for(dtypes: set[torch.dtype], device: torch.device
                     ) -> dict[torch.dtype, torch.Tensor]:
    """One NaN element per dtype, which every released param of that dtype views."""
    return {dtype: torch.full((), float("nan"), dtype=dtype, device=device) for dtype in dtypes}


def param_pools_for(buffers: Any) -> dict[torch.dtype, ParamPool]:
    """One pool per param dtype of ``buffers`` (the layout's planned buffers)."""
    return {dtype: ParamPool(dtype) for dtype in {buf.param_dtype for buf in buffers}}
