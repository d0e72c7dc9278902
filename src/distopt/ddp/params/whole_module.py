"""The module whole again: its full params for a block, a full state dict, and ``release()``.

What ``DistributedDataParallel`` gives back of the module it wraps: the params' full values
where a user needs them with sharded params ([Note: sharded params] in
ddp/buffers/param_storage.py), and the module itself, a plain module once more ([Note: one wrapper
per param] in ddp/param_owners.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...parallel.dtensor import alias_local, local_tensor
from .. import param_owners
from ..state import ParamState

_entries_read = 0  # > 0 inside module_entries(): the refusal of placeholders is off


def module_entries(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)`` as it stands, sharded params as their
    placeholders: for distopt's own readers of names, shapes, dtypes and buffers (checkpoints
    write the values of sharded params from the shards), where a user's ``state_dict()`` is
    refused. The params are the objects themselves, whose metadata reads pass ([Note: reads
    between uses] in ddp/buffers/param_placeholder.py)."""
    global _entries_read
    _entries_read += 1
    try:
        return module.state_dict(keep_vars=True)
    finally:
        _entries_read -= 1


class WholeModule:
    """The part of ``DistributedDataParallel`` that gives its module back whole."""

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Inside the block every param holds its full values (with sharded params they are
        gathered for it, a transient of the whole model, and freed after it; without, it
        waits for any gather in flight). Collective over the data-parallel group."""
        self._check_live()
        if self._unsharder is None:
            self.finish_param_sync()
            yield
            return
        try:
            for bucket in self._unsharder.forward_order:
                bucket.use_params()
            yield
            # Writes into the gathered params are kept; see [Note: writes into the params].
            for bucket in self._unsharder.forward_order:
                bucket.keep_param_writes()
        finally:
            self._unsharder.release_all()

    def _load_into_shards(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                          *_args: Any) -> None:
        """``module.load_state_dict`` under sharded params (a pre-hook of the wrapped module):
        every rank holds the whole state dict, so each writes the parts of the trainable
        params that fall in its shards, with no communication, and takes those entries out
        of the load (their params are placeholders between uses); the rest (buffers, frozen
        params) load as usual. Keys taken out are forgotten as missing by
        ``_forget_loaded_keys``."""
        self._loaded_keys: set[str] = set()
        with torch.no_grad():
            for name, param in module.named_parameters(remove_duplicate=False):
                key = prefix + name
                buffer = self._buffer_of.get(param)
                if buffer is None or key not in state_dict:
                    continue
                value = state_dict.pop(key)
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    buffer.write_shard(param, value.to(param.dtype))
                    self._loaded_keys.add(key)
                else:
                    state_dict[key] = value  # the module's own load names the mismatch
        self._unsharder.release_all()

    def _forget_loaded_keys(self, _module: nn.Module, incompatible: Any) -> None:
        for key in getattr(self, "_loaded_keys", ()):
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)

    def _refuse_placeholders(self, module: nn.Module, _prefix: str, _keep_vars: bool, *,
                             reader: str = "state_dict()") -> None:
        """``state_dict()`` (or ``copy.deepcopy``, [Note: a copy of a wrapped module] in
        ddp/params/module_hooks.py) of a module whose sharded params are placeholders (a state-dict
        pre-hook of each module that registers one): refused, naming the ways that give the
        full values, rather than a state dict of NaN placeholders that a ``torch.save``
        would write as the user's weights. Inside a forward or ``gathered_params()`` the
        params are whole and the state dict is the module's own."""
        if _entries_read:
            return
        bucket_of = self._grad_sync.bucket_of
        for name, param in module.named_parameters(recurse=False):
            bucket = bucket_of.get(param)
            if bucket is not None and bucket.params_store.state is not ParamState.GATHERED:
                where = next(n for n, m in self.module.named_modules() if m is module)
                full_name = f"{where}.{name}" if where else name
                raise RuntimeError(
                    f"{reader} of a module wrapped with shard_params=True read parameter "
                    f"'{full_name}' between forwards, where each rank holds only its shard: "
                    f"it would hold a placeholder, not its values. Call "
                    f"ddp.full_state_dict() on every rank (every param whole), or call "
                    f"{reader} inside 'with ddp.gathered_params():' on every rank, or save "
                    f"with distopt.save_checkpoint (sharded, nothing gathered)"
                )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()`` with every param whole, under the module's own names,
        on every rank: copies, for saving or evaluating elsewhere. Collective with sharded
        params ([Note: sharded params] in ddp/buffers/param_storage.py)."""
        with self.gathered_params():
            return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for key, value in self.module.state_dict().items()}

    def _params_own_storage(self) -> None:
        # Every param gets storage of its own holding its full values (out of the buffers),
        # gathered bucket by bucket.
        for bucket in self.buckets:
            bucket.use_params()
            with torch.no_grad():
                for param in bucket.params:
                    alias_local(param, local_tensor(param).detach().clone())
            bucket.release_params(placeholders=False)


    def release(self) -> nn.Module:
        """Give the module back as a plain module holding its current values; return it.

        Waits for the collectives in flight, removes every hook this wrapper put on the module
        (each param's grad hooks, the forward pre-hooks that wait for gathers), gives each param
        storage of its own (a copy of its current values, out of the param buffer) and drops
        its ``main_grad``; grads not yet reduced are dropped too. The module then trains like
        any other (under torch's DDP, a plain optimizer or a new distopt wrapper). This wrapper
        and its optimizer refuse to train afterwards, but still read: a checkpoint saved after
        the release holds the run as it ended. It communicates only to finish what is in
        flight, so ranks with reductions or gathers in flight release together; otherwise each
        rank may release on its own. Calling it again does nothing.

        Wrapping the module in a new ``DistributedDataParallel`` releases this one first; ``with
        DistributedDataParallel(module) as ddp:`` releases it when the block ends. See
        [Note: one wrapper per param] in ddp/param_owners.py.
        """
        self._release("ddp.release() was called")
        return self.module

    def __enter__(self) -> WholeModule:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is None:
            self.release()
            return
        with contextlib.suppress(Exception):  # the error that ended the block is the one to see
            self.release()

    @property
    def released(self) -> bool:
        """Whether this wrapper let go of its module (``release``, or a newer wrapper)."""
        return self._released is not None

    def _release(self, reason: str) -> None:
        if self._released is not None:
            return
        # Nothing may still write into the buffers once the params stop being their views.
        self._grad_sync.release()
        self._rebound = None  # the params get storage of their own below
        if self._unsharder is not None:
            self._params_own_storage()
            self._unsharder.remove_hooks()
            self._unsharder.check = None  # its forwards communicate nothing any more
        self._gathers_in_flight = False
        for handle in (*self._grad_hooks, *self._param_wait_hooks,
                       *getattr(self, "_module_state_hooks", ())):
            handle.remove()
        self._grad_hooks, self._param_wait_hooks = [], []
        with torch.no_grad():
            for param in self.params:  # the params are views into param_data
                alias_local(param, local_tensor(param).detach().clone())
                if "main_grad" in param.__dict__:
                    del param.main_grad
        param_owners.disown(self.params, self)
        self._released = reason

    def _check_live(self) -> None:
        if self._released is not None:
            raise RuntimeError(
                f"this distopt.DistributedDataParallel no longer holds its module ({self._released}"
                "): it and its optimizer cannot train it any more; train with the wrapper that "
                "holds the module now, or wrap the module in a new DistributedDataParallel and "
                "build a new optimizer over it"
            )
