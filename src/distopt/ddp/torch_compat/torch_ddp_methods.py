"""torch DDP's own methods on distopt's wrapper: its communication hooks and uneven-inputs
context (accepted or refused by name, [Note: torch DDP's spellings] in
ddp/torch_compat/torch_spellings.py), its ignore list, and its grad-sync switch (``no_sync()`` and
``require_backward_grad_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from . import torch_spellings


class TorchDDPMethods:
    """torch DDP's methods of ``DistributedDataParallel``, over its grad sync."""

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch DDP's communication hook: torch's default ``allreduce_hook`` is what distopt
        does already and is accepted; any other hook is refused, naming distopt's way to its
        end (hooks run on torch's own flattened buckets, which distopt does not have). See
        [Note: torch DDP's spellings] in ddp/torch_compat/torch_spellings.py.

        Args:
            state: the hook's state object, as torch takes it; unused, since no hook runs.
            hook: the communication hook: torch's ``allreduce_hook`` is accepted, its fp16 and
                bf16 compression hooks are refused naming ``grad_dtype=``, any other by name.
        """
        torch_spellings.check_comm_hook(hook)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """torch DDP's uneven-inputs context: refused (see ``torch_spellings.refuse_join``).

        Args:
            *args: torch's arguments (``divide_by_initial_world_size``, ``enable``,
                ``throw_on_early_termination``); any refuses alike: give every rank the same
                number of batches instead.
            **kwargs: the same, by keyword.
        """
        torch_spellings.refuse_join()

    def join_hook(self, **kwargs: Any) -> Any:
        """What ``torch.distributed.algorithms.Join([ddp])`` asks for: refused as ``join``.

        Args:
            **kwargs: the options ``Join`` passes on (``divide_by_initial_world_size``); any
                refuses alike.
        """
        torch_spellings.refuse_join()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
            module: nn.Module, params_and_buffers_to_ignore: Sequence[str]) -> None:
        """torch DDP's ignore list, set on ``module`` before wrapping it: those params and
        buffers stay local to each rank; see [Note: torch DDP's spellings]."""
        torch_spellings.set_ignore_list(module, params_and_buffers_to_ignore)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads in the buffer without reducing them (micro-batches). As with torch
        DDP, a forward inside may still broadcast module buffers (the first micro-batch's) and
        the forward after one run inside does not; see [Note: buffer broadcasting]."""
        sync = self._grad_sync
        previous = sync.sync_enabled
        sync.sync_enabled = False
        try:
            yield
        finally:
            sync.sync_enabled = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, which ``no_sync()`` clears and nanoGPT sets by hand
        (``model.require_backward_grad_sync = last_micro_step``): whether the next backward
        reduces its grads (False: they accumulate in the buffers, as under ``no_sync()``)."""
        return self._grad_sync.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._grad_sync.sync_enabled = bool(value)
