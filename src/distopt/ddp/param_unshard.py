"""Sharded params: the hooks that gather params around the forward and backward that use them.

[Note: where a param is used]
A param is gathered for the forward and the backward of each module that uses it, and freed
after the last of them. Which modules use a param is not what registers it: a parent may read a
child's param in its own forward (a head tied to an embedding as ``F.linear(h,
self.emb.weight)``), and such a read of a freed param would see its placeholder. So the first
forward through the DDP records it: a ``TorchFunctionMode`` notes, for every param an op
receives, the innermost module running at that moment, and those modules become the param's
users from the second forward on. The first forward (and its backward) is run on the safe side
meanwhile: a param's users there are the module that registers it and that module's parents,
which is where any code that reads it runs, at the price of holding the whole of a flat model
gathered during that one step. A later forward that reads a param in a module the first
forward did not (another branch) finds the placeholder; the module that registers it always
counts as a user, so a branch that reads a layer's params through that layer is safe.

Each user gets a forward pre-hook (gather its buckets, and start the next bucket's gather), a
forward hook (free each bucket once its last user in this forward is done, and hook the user's
outputs so that its backward gathers again first); the grad sync frees a bucket once every
param of it has its grad. See [Note: sharded params] in ddp/param_storage.py.

[Note: every rank runs the same modules]
A user's hooks gather on every rank at once, so every rank must run the forward of the same
users, as FSDP2 requires of its units. A module run on some ranks only, chosen by the data,
breaks that: a mixture of experts with an ``nn.Module`` per expert that skips an expert no
token of this rank's batch was routed to (transformers' Mixtral before its experts became one
module with stacked weights) gathers that expert's bucket where it ran, while the ranks that
skipped it are in another collective. What follows is not distopt's to choose: a wait until
the process group's timeout (whose ``CollectiveError`` names this cause and the fix), an abort
inside gloo where the parted collectives differ in size, or, where they are the same size, one
bucket's shards gathered into another's. No rank can tell alone that its peers ran other
modules, so it is the caller's rule, not checked: run an idle expert on an empty batch (its
grads are zeros), or hold the experts as one module's stacked weights (transformers' Mixtral
since v5), which always runs and gives an idle expert's slice a zero grad. Branches that every
rank takes or skips alike (the same step, the same flag) need only ``find_unused_parameters``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .bucket import Bucket


class ParamUnsharder:
    """Gathers and frees a DDP's sharded params around the modules that use them."""

    def __init__(self, module: nn.Module, bucket_of: dict[nn.Parameter, Bucket],
                 launch_order: list[Bucket], *, reshard_after_forward: bool) -> None:
        self.module = module
        self.bucket_of = bucket_of
        self.reshard_after_forward = reshard_after_forward
        # First layers first: forward meets the buckets in the reverse of backward's order.
        self.forward_order = list(reversed(launch_order))
        self._position = {bucket: i for i, bucket in enumerate(self.forward_order)}
        self.hooks: list[Any] = []
        # Until the first forward has shown where each param is read: registrants and their
        # parents; see [Note: where a param is used].
        parents: dict[nn.Module, list[nn.Module]] = {module: [module]}
        for parent in module.modules():
            for child in parent.children():
                parents.setdefault(child, []).append(parent)
        users: dict[nn.Module, set[nn.Parameter]] = {}
        for submodule in module.modules():
            for param in self._registered(submodule):
                for user in (submodule, *parents[submodule]):
                    users.setdefault(user, set()).add(param)
        self._use(users)
        self.learned = False

    def _registered(self, module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters(recurse=False) if p in self.bucket_of]

    def _use(self, users: dict[nn.Module, set[nn.Parameter]]) -> None:
        """Hook ``users`` (module -> the params it reads) and count each bucket's users."""
        self.remove_hooks()
        self._buckets_of = {
            user: sorted({self.bucket_of[p] for p in params}, key=self._position.__getitem__)
            for user, params in users.items() if params
        }
        self._users = {bucket: 0 for bucket in self.forward_order}
        for buckets in self._buckets_of.values():
            for bucket in buckets:
                self._users[bucket] += 1
        self._left = dict(self._users)  # users still to run in this forward
        self.hooks = [hook for user in self._buckets_of for hook in (
            user.register_forward_pre_hook(self._before_forward),
            user.register_forward_hook(self._after_forward),
        )]

    # ------------------------------------------------------------------ a forward

    def forward(self, run: Any) -> Any:
        """Run the model's forward (``run()``), learning where params are read if not yet."""
        self._left = dict(self._users)
        if self.learned:
            return run()
        recorder = _UseRecorder(self.module, set(self.bucket_of))
        with recorder:
            output = run()
        users = recorder.users
        for submodule in self.module.modules():  # a registrant always counts
            for param in self._registered(submodule):
                users.setdefault(submodule, set()).add(param)
        self._use(users)
        self.learned = True
        return output

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        buckets = self._buckets_of[module]
        for bucket in buckets:
            bucket.use_params()
        self._prefetch(self._position[buckets[-1]] + 1)

    def _after_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        if torch._C._current_autograd_node() is not None:
            # A forward run inside backward (activation checkpointing's recomputation): the
            # backward that follows reads these params, and the grad sync frees them once
            # their grads are in.
            return
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


class _UseRecorder(TorchFunctionMode):
    """Records, for each param an op receives, the innermost module running; see
    [Note: where a param is used]."""

    def __init__(self, module: nn.Module, params: set[nn.Parameter]) -> None:
        super().__init__()
        self._ids = {id(p): p for p in params}
        self._stack: list[nn.Module] = []
        self.users: dict[nn.Module, set[nn.Parameter]] = {}
        self._hooks = [hook for m in module.modules() for hook in (
            m.register_forward_pre_hook(self._enter),
            m.register_forward_hook(self._leave),
        )]

    def _enter(self, module: nn.Module, _args: Any) -> None:
        self._stack.append(module)

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._stack.pop()  # returns nothing: a forward hook's value would replace the output

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # Ops only: setting ``.data`` (the gathers' own swap) or reading an attribute is not a
        # use of the values.
        if self._stack and getattr(func, "__name__", "") not in ("__set__", "__get__"):
            for value in tree_flatten((args, kwargs or {}))[0]:
                param = self._ids.get(id(value))
                if param is not None:
                    self.users.setdefault(self._stack[-1], set()).add(param)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> Any:
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)
