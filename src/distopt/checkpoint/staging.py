"""The host buffer an async save copies what this rank writes into, before training goes on.

[Note: async staging]
``save_checkpoint(..., async_save=True)`` must return before the next step changes the params
and the state in place, yet write them as they were. So the call copies what this rank writes
(parts.py: its part of each piece, the model entries dealt to it, never a whole model) into
one host buffer and gives DCP views of it; a writer thread writes them while training goes on
(background.py).

The buffer is one flat byte tensor per optimizer, kept between saves: each staged tensor is a
slice of its storage (64-byte aligned, so any dtype's view is aligned), so the writer's
``torch.save`` writes exactly that slice, with no copy (a tensor sharing a larger storage would
make it write or clone the whole storage; see [Note: bounded writes] in writing.py). It is
allocated at the first async save and again only when a save needs more than it holds (the
optimizer's state appears at its first step), to exactly the bytes needed; so its size is what
this rank writes, about 1/N of the checkpoint over N ranks. With CUDA tensors it is pinned, the
copies are issued without blocking and the call waits for them once before it returns.
Small objects (the param groups, the caller's ``extra``) are copied as objects.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

ALIGN = 64  # bytes: every staged tensor starts at a multiple, aligned for any dtype


class Staging:
    """One optimizer's staging buffer, reused across its async saves."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # uint8, flat
        self.allocations = 0  # how many times the buffer was allocated
        self.staged_bytes = 0  # bytes of tensors the last save staged

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now (0 before the first async save)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (values as parts.dcp_state gives them) whose tensors live in the
        buffer; returns once every copy is complete."""
        from .dcp import flat_chunks, with_chunks

        sources: list[torch.Tensor] = []
        for value in state.values():
            if isinstance(value, torch.Tensor):
                chunks = flat_chunks(value)
                sources += [value] if chunks is None else [t for _, t in chunks]
        offsets, need = [], 0
        for tensor in sources:
            offsets.append(need)
            need += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        on_cuda = any(t.is_cuda for t in sources)
        if need > self.capacity:
            self.buffer = None  # free the old buffer before the new one is taken
            self.buffer = torch.empty(need, dtype=torch.uint8, pin_memory=on_cuda)
            self.allocations += 1
        staged: dict[int, torch.Tensor] = {}
        for tensor, offset in zip(sources, offsets, strict=True):
            assert self.buffer is not None
            storage = self.buffer.untyped_storage()
            nbytes = tensor.numel() * tensor.element_size()
            into = torch.empty(0, dtype=tensor.dtype).set_(
                storage[offset : offset + nbytes], 0, tensor.shape)
            into.copy_(tensor.detach(), non_blocking=on_cuda)
            staged[id(tensor)] = into
        if on_cuda:
            torch.cuda.current_stream().synchronize()
        self.staged_bytes = sum(t.numel() * t.element_size() for t in sources)

        out: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                chunks = flat_chunks(value)
                out[key] = (staged[id(value)] if chunks is None else
                            with_chunks(value, [(o, staged[id(t)]) for o, t in chunks]))
            else:
                out[key] = copy.deepcopy(value)
        return out


_STAGING: weakref.WeakKeyDictionary[Any, Staging] = weakref.WeakKeyDictionary()


def staging_of(opt: Any) -> Staging:
    """``opt``'s staging buffer (empty until its first async save); it lives as long as
    ``opt``."""
    if opt not in _STAGING:
        _STAGING[opt] = Staging()
    return _STAGING[opt]


def staging_bytes(opt: Any) -> int:
    """Bytes of host memory ``opt``'s async saves keep for staging on this rank: what this rank
    writes of a checkpoint (0 before the first async save). See [Note: async staging]."""
    staging = _STAGING.get(opt)
    return 0 if staging is None else staging.capacity
