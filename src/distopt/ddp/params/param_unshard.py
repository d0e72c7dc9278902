"""Sharded params: the hooks that gather params around the forward and backward that use them.

[Note: where a param is used]
Params are gathered by gather unit ([Note: gather units] in ddp/params/gather_units.py): a unit's
forward pre-hook gathers its buckets (waiting for them) and starts gathering the next unit's,
so one unit's all-gather overlaps the compute of the one before it; its forward hook frees its
buckets (``reshard_after_forward=True``, the default; what the root module itself reads
stays gathered, as backward needs it at once) and hooks the unit's outputs, so that its
backward gathers them again first and starts gathering the unit the forward ran before it, as
soon as the unit whose backward ran just before is freed (its last grads may still be
accumulating: waiting for them keeps backward at two units, the one running and the one
prefetched). The grad sync frees a bucket once every param of it has its grad. The units'
order is the first forward's order of their pre-hooks (registration order until then).

A unit's params may also be read outside its forward: a parent may read a child's param (a
head tied to an embedding as ``F.linear(h, self.emb.weight)``). The first forward through the
DDP finds these reads: a ``TorchFunctionMode`` looks at every param an op receives, and a param
whose unit is not running then is gathered on the spot (every rank runs the same code, so
every rank gathers it too) and kept until its grads are in; the innermost module running
becomes a *reader* of that param's buckets. From the second forward on readers have hooks of
their own, as units do (without the prefetch): a bucket is gathered before any of its users
runs and freed once none of them is running. A later forward that reads a param outside its
unit where the first forward did not (another branch) reads the placeholder, which raises,
naming the param ([Note: reads between uses] in ddp/buffers/param_placeholder.py): a branch that
calls the unit's module itself is always safe.

A module's own pre-hooks read its params too: torch's ``spectral_norm``, ``weight_norm`` and
``prune`` compute ``module.weight`` from ``weight_orig`` (or ``weight_g`` and ``weight_v``) in a
forward pre-hook registered before wrapping. The gathering pre-hooks are therefore prepended
(``prepend=True``), so that they run before any pre-hook the module had or gets later, and
its forward hooks appended, so that the module's own forward hooks still see the params
gathered.

The transient memory is then: the units running (nested ones inside their parents), the next
unit prefetched, the loose buckets in use, and buckets whose grads are not all in yet; with
``reshard_after_forward=False`` every unit the forward ran, until its grads are in.
``ParamPool.peak_bytes`` measures it; ``distopt.transient_bound`` states it ([Note: transient
bound] in memory.py).

[Note: every rank runs the same modules]
A user's hooks gather on every rank at once, so every rank must run the forward of the same
users, as FSDP2 requires of its units. A module run on some ranks only, chosen by the data,
breaks that: a mixture of experts with an ``nn.Module`` per expert that skips an expert no token
of this rank's batch was routed to (transformers' Mixtral before its experts became one module
with stacked weights) gathers that expert's bucket where it ran, while the ranks that skipped it
are in another collective. What follows is not distopt's to choose: a wait until the process
group's timeout (whose ``CollectiveError`` names this cause and the fix), an abort inside gloo
where the parted collectives differ in size, or, where they are the same size, one bucket's
shards gathered into another's. No rank can tell alone that its peers ran other modules, so it
is the caller's rule, not checked (the check at the start of each forward and backward,
[Note: every rank runs every forward] in ddp/params/forward_check.py, sees whole forwards only): run
an idle expert on an empty batch (its grads are zeros), or hold the experts as one module's
stacked weights (transformers' Mixtral since v5), which always runs and gives an idle expert's
slice a zero grad. Branches that every rank takes or skips alike (the same step, the same flag)
need only ``find_unused_parameters``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..buffers.bucket import Bucket
from .forward_check import ForwardCheck
from .gather_units import GatherUnit
from .module_hooks import ModuleHook


class ParamUnsharder:
    """Gathers and frees a DDP's sharded params around the units (and readers) that use
    them; see [Note: where a param is used]."""

    def __init__(self, module: nn.Module, units: list[GatherUnit],
                 bucket_of: dict[nn.Parameter, Bucket], launch_order: list[Bucket], *,
                 reshard_after_forward: bool, holding: Callable[[], bool] = lambda: False,
                 check: ForwardCheck | None = None) -> None:
        self.module = module
        # Every rank starts the same forwards and backwards (None: not checked, a released
        # wrapper's): [Note: every rank runs every forward] in ddp/params/forward_check.py.
        self.check = check
        self.holding = holding  # a step held whole: nothing freed ([Note: a step held whole])
        self.bucket_of = bucket_of
        self.reshard_after_forward = reshard_after_forward
        # First layers first: forward meets the buckets in the reverse of backward's order.
        self.forward_order = list(reversed(launch_order))
        position = {bucket: i for i, bucket in enumerate(self.forward_order)}
        self._position = position
        self.units = units
        self._unit_buckets = [
            sorted({bucket_of[p] for p in unit.params}, key=position.__getitem__)
            for unit in units]
        self._unit_index = {unit.module: i for i, unit in enumerate(units)}
        self._unit_of_bucket = {b: i for i, buckets in enumerate(self._unit_buckets)
                                for b in buckets}
        self._order = list(range(len(units)))  # forward order of the units, learned
        self._readers: dict[nn.Module, list[Bucket]] = {}
        self._running: dict[Bucket, int] = {}  # users of each bucket in their forward now
        self._pinned: set[Bucket] = set()  # read outside their unit: kept until grads are in
        self.hooks: list[Any] = []
        self._deferred: tuple[int, int] | None = None  # (unit to prefetch, unit it waits for)
        for bucket in self.forward_order:
            bucket.params_store.pool.on_free = self._prefetch_deferred
        self._in_backward = False  # a backward through the units is running
        self._hook()
        self.learned = False

    def _hook(self) -> None:
        self.remove_hooks()
        users: dict[nn.Module, set[Bucket]] = {}
        for unit, buckets in zip(self.units, self._unit_buckets, strict=True):
            users.setdefault(unit.module, set()).update(buckets)
        # A module that registers a param always reads it, also when called outside its
        # unit's forward (a block's layers called one by one).
        for submodule in self.module.modules():
            own = [self.bucket_of[p] for p in submodule.parameters(recurse=False)
                   if p in self.bucket_of]
            if own:
                users.setdefault(submodule, set()).update(own)
        for reader, buckets in self._readers.items():
            users.setdefault(reader, set()).update(buckets)
        self._users = {user: sorted(buckets, key=self._position.__getitem__)
                       for user, buckets in users.items() if buckets}
        self._next = {u: self._order[k + 1] if k + 1 < len(self._order) else None
                      for k, u in enumerate(self._order)}
        self._previous = {u: self._order[k - 1] if k > 0 else None
                          for k, u in enumerate(self._order)}
        self.hooks = [hook for user in self._users for hook in (
            # First of the module's pre-hooks: see "A module's own pre-hooks" in the Note.
            user.register_forward_pre_hook(ModuleHook(self._before_forward), prepend=True),
            user.register_forward_hook(ModuleHook(self._after_forward)),
        )]

    # ------------------------------------------------------------------ a forward

    def forward(self, run: Any) -> Any:
        """Run the model's forward (``run()``), learning the units' order and the reads of
        params outside their units if not yet."""
        self._running = {}
        self._deferred = None
        self._in_backward = False  # a backward that raised never ran its callback
        if self.learned:
            self._pinned.clear()  # only the first forward pins; see read_outside_unit
            return run()
        recorder = _UseRecorder(self)
        with recorder:
            output = run()
        if not torch.is_grad_enabled():  # no backward will free what was read outside
            for bucket in list(self._pinned):
                self._pinned.discard(bucket)
                bucket.release_params()
        seen = [u for u in recorder.unit_order if u in self._unit_index]
        ran = [self._unit_index[m] for m in dict.fromkeys(seen)]
        self._order = ran + [u for u in self._order if u not in ran]
        self._readers = recorder.readers
        self._hook()
        self.learned = True
        return output

    def check_forward(self, training: bool) -> None:
        """Before the wrapper's forward, its first collective: every rank starts it."""
        if self.check is not None:
            self.check.forward(training)

    def read_outside_unit(self, reader: nn.Module, param: nn.Parameter) -> None:
        """The first forward read ``param`` in ``reader``, outside its unit's forward:
        gather it now and keep it until its grads are in."""
        bucket = self.bucket_of[param]
        bucket.use_params()
        if torch.is_grad_enabled():
            self._pinned.add(bucket)

    def in_use(self, param: nn.Parameter) -> bool:
        """Whether a user running now (or a read before, pinned) gathered ``param``'s bucket."""
        bucket = self.bucket_of[param]
        return self._running.get(bucket, 0) > 0 or bucket in self._pinned

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        buckets = self._users[module]
        for bucket in buckets:
            bucket.use_params()
            self._running[bucket] = self._running.get(bucket, 0) + 1
        unit = self._unit_index.get(module)
        if unit is not None:
            self._prefetch(self._next.get(unit))
        else:  # a loose bucket's user: the bucket after its last
            self._prefetch_bucket(self._position[buckets[-1]] + 1)

    def _after_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        buckets = self._users[module]
        for bucket in buckets:
            self._running[bucket] = self._running.get(bucket, 1) - 1
        if torch._C._current_autograd_node() is not None:
            # A forward run inside backward (activation checkpointing's recomputation): the
            # backward that follows reads these params, and the grad sync frees them once
            # their grads are in.
            return
        grad = torch.is_grad_enabled()
        if grad:
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda _grads: self._before_backward(module), mode="any")
        if grad and (module is self.module or not self.reshard_after_forward
                     or self.holding()):
            return  # backward needs them next (the root's) or keeps them
        for bucket in buckets:
            if self._running[bucket] <= 0 and bucket not in self._pinned:
                # With grad enabled autograd saved views of them, which the backward's gather
                # fills again: [Note: views that outlive a gather] in ddp/buffers/gathered_views.py.
                bucket.release_params(autograd_reads=grad)

    def _before_backward(self, module: nn.Module) -> None:
        if not self._in_backward:  # the first unit of this backward
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            if self.check is not None:
                self.check.backward()
        for bucket in self._users[module]:
            bucket.use_params()
        unit = self._unit_index.get(module)
        if unit is not None:
            # The unit whose backward ran just before may still be gathered, its last grads
            # being accumulated: the unit before this one is prefetched once it is freed, so
            # that backward holds two units, not three.
            after = self._next.get(unit)
            if after is not None and self._gathered(after):
                self._deferred = (self._previous.get(unit), after)
            else:
                self._prefetch(self._previous.get(unit))
        else:  # backward meets the buckets in launch order: the one before its first
            self._prefetch_bucket(self._position[self._users[module][0]] - 1)

    def _after_backward(self) -> None:
        # Buckets whose params are all frozen get no grad, so no grad frees them: freed here,
        # the grad sync freeing the rest ([Note: params frozen after wrapping] in
        # ddp/torch_compat/trainable.py).
        self._in_backward = False
        if self.holding():
            return
        for bucket in self.forward_order:
            if bucket.param_data is not None and not any(p.requires_grad for p in bucket.params):
                bucket.release_params()

    def _gathered(self, unit: int) -> bool:
        return any(b.param_data is not None for b in self._unit_buckets[unit])

    def _prefetch_deferred(self) -> None:
        if self._deferred is not None and not self._gathered(self._deferred[1]):
            unit, self._deferred = self._deferred[0], None
            self._prefetch(unit)

    def _prefetch(self, unit: int | None) -> None:
        if unit is not None:
            for bucket in self._unit_buckets[unit]:
                bucket.gather_params()

    def _prefetch_bucket(self, position: int) -> None:
        # A loose bucket only: units prefetch units, in the order the forward runs them (the
        # bucket after a tied head's is the first block's, which the forward just left).
        if 0 <= position < len(self.forward_order):
            bucket = self.forward_order[position]
            if bucket not in self._unit_of_bucket:
                bucket.gather_params()

    def release_all(self) -> None:
        """Every bucket back to its shard (the end of a backward, a step: gathered params
        would be stale after the optimizer updates the shards)."""
        self._pinned.clear()
        self._deferred = None
        for bucket in self.forward_order:
            bucket.release_params()

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


class _UseRecorder(TorchFunctionMode):
    """The first forward: the order in which units run, and every read of a param outside
    its unit's forward, gathered on the spot; see [Note: where a param is used]."""

    def __init__(self, unsharder: ParamUnsharder) -> None:
        super().__init__()
        self._unsharder = unsharder
        self._ids = {id(p): p for p in unsharder.bucket_of}
        self._stack: list[nn.Module] = []
        self.unit_order: list[nn.Module] = []
        self.readers: dict[nn.Module, set[Bucket]] = {}
        self._hooks = [hook for m in unsharder.module.modules() for hook in (
            m.register_forward_pre_hook(ModuleHook(self._enter), prepend=True),
            m.register_forward_hook(ModuleHook(self._leave)),
        )]

    def _enter(self, module: nn.Module, _args: Any) -> None:
        self._stack.append(module)
        self.unit_order.append(module)

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._stack.pop()  # returns nothing: a forward hook's value would replace the output

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # Ops only: setting ``.data`` (the gathers' own swap) or reading an attribute is not a
        # use of the values.
        if self._stack and getattr(func, "__name__", "") not in ("__set__", "__get__"):
            for value in tree_flatten((args, kwargs or {}))[0]:
                param = self._ids.get(id(value))
                if param is None:
                    continue
                if self._unsharder.in_use(param):
                    continue
                reader = self._stack[-1]
                self._unsharder.read_outside_unit(reader, param)
                self.readers.setdefault(reader, set()).add(self._unsharder.bucket_of[param])
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> Any:
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)
