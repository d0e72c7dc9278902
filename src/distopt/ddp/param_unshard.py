"""Sharded params: the hooks that gather params around the forward and backward that use them.

A param is gathered for the forward and the backward of its holder: the parent of the module
that registers it (the wrapped module itself for its own params). A module's parent is where
its params are used: it calls the module, and it is where code reads a child's param directly
(a head tied to an embedding by ``F.linear(h, self.emb.weight)``). Each holder gets a forward
pre-hook (gather its buckets, and start the next bucket's gather), a forward hook (free each
bucket once the last holder that uses it in this forward is done, and hook the holder's
outputs so that its backward gathers again first); the grad sync frees a bucket once every
param of it has its grad. See [Note: sharded params] in ddp/param_storage.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .bucket import Bucket


class ParamUnsharder:
    """Gathers and frees a DDP's sharded params around the modules that use them."""

    def __init__(self, module: nn.Module, bucket_of: dict[nn.Parameter, Bucket],
                 launch_order: list[Bucket], *, reshard_after_forward: bool) -> None:
        self.reshard_after_forward = reshard_after_forward
        # First layers first: forward meets the buckets in the reverse of backward's order.
        self.forward_order = list(reversed(launch_order))
        self._position = {bucket: i for i, bucket in enumerate(self.forward_order)}
        # Each holder's buckets: those of the params its children (and itself) register.
        parents: dict[nn.Module, list[nn.Module]] = {module: [module]}
        for parent in module.modules():
            for child in parent.children():
                parents.setdefault(child, []).append(parent)
        held: dict[nn.Module, set[Bucket]] = {}
        for submodule in module.modules():
            buckets = {bucket_of[p] for p in submodule.parameters(recurse=False)
                       if p in bucket_of}
            if buckets:
                for holder in parents[submodule]:
                    held.setdefault(holder, set()).update(buckets)
        self._buckets_of = {holder: sorted(buckets, key=self._position.__getitem__)
                            for holder, buckets in held.items()}
        # How many holders use each bucket: it is freed after the last of them in a forward.
        self._users = {bucket: 0 for bucket in launch_order}
        for buckets in self._buckets_of.values():
            for bucket in buckets:
                self._users[bucket] += 1
        self._left = dict(self._users)  # users still to run in this forward
        self.hooks = [hook for submodule in self._buckets_of for hook in (
            submodule.register_forward_pre_hook(self._before_forward),
            submodule.register_forward_hook(self._after_forward),
        )]

    def begin_forward(self) -> None:
        """A forward of the whole model starts: every user is due again."""
        self._left = dict(self._users)

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        buckets = self._buckets_of[module]
        for bucket in buckets:
            bucket.use_params()
        self._prefetch(self._position[buckets[-1]] + 1)

    def _after_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        grad = torch.is_grad_enabled()
        buckets = self._buckets_of[module]
        if grad:
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads: self._before_backward(buckets), mode="any")
        for bucket in buckets:
            self._left[bucket] -= 1
            if self._left[bucket] <= 0 and (self.reshard_after_forward or not grad):
                bucket.release_params()

    def _before_backward(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.use_params()
        # Backward meets the buckets in launch order: the one before the first of these.
        self._prefetch(self._position[buckets[0]] - 1)

    def _prefetch(self, position: int) -> None:
        if 0 <= position < len(self.forward_order):
            self.forward_order[position].gather_params()

    def release_all(self) -> None:
        """Every bucket back to its shard (the end of a backward, a step: gathered params
        would be stale after the optimizer updates the shards)."""
        for bucket in self.forward_order:
            bucket.release_params()

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
