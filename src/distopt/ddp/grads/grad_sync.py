"""The grad sync of one step: grad hooks, the launch order, the end of backward, the sync.

[Note: bucket launch order]
Collectives on one process group must be issued in the same order on every rank. Buckets are
therefore launched strictly in one fixed order (the layout order, which follows backward): when
a bucket's last grad arrives, it is launched only if every bucket before it has been, and then
every following bucket that is ready goes with it. A bucket holding a parameter that got no
grad in this backward (unused on this rank, or used only on others) simply waits for
``finish_grad_sync``, which launches whatever is left. Nothing depends on which parameters each
rank happened to use, so nothing can hang or mismatch.

[Note: grads written, not zeroed]
``zero_grad_buffer`` does not clear the grad buffer: it only forgets which parameters have a
grad. The first grad a parameter gets after it is copied into the buffer, later ones (more
micro-batches) are added; a parameter that got none by the time its bucket is reduced has its
slot zeroed then. This spares a write of the whole buffer every step (for a model that fits in
cache it is as costly as the reduction's own pass over the buffer), and the reduced result is
the same as with a cleared buffer. Padding between parameters is never written by anything but
the reduction of zeros, so it stays zero.

[Note: grads after the reduction]
Once a bucket's reduction has started, a grad that arrives for one of its parameters in the
same backward cannot join it: with overlap the bucket is already on the wire. Such a grad comes
from a parameter whose grad is accumulated twice in one backward (reentrant activation
checkpointing across a bucket); on several ranks it raises in the grad hook, naming the param
and its model, rather than give a silently wrong step. A grad of a later backward is not late:
see [Note: several backwards per step]. On one process nothing is reduced and grads simply
accumulate. The grad sync counts rounds, one per backward: a bucket launched in the current
round takes no more grads.

[Note: several backwards per step]
torch DDP reduces on every backward outside ``no_sync`` and adds: gradient accumulation without
``no_sync``, two losses with a backward each, a GAN's discriminator reached by the generator's
backward after its own step. distopt does the same in every sharding mode, each backward's
reduction adding to what the earlier ones reduced: with all-reduced buckets the new grads add
to the average in the buffer, which is reduced again; with reduce-scattered full buffers the
bucket is *reopened*: this rank's reduced shard is put aside (a copy, 1/d of the bucket), the
next grads overwrite the buffer, and once their reduction is in the copy is added back; with
sharded grads each backward's reduction adds into the kept shard ([Note: sharded grads] in
ddp/buffers/grad_pool.py). The sum of averages equals torch's, rounded once per backward. Which
buckets a later backward reopens is the params it reaches, the same on every rank that runs
the same model (torch DDP's own rule). Its reductions start in launch order as buckets
fill, up to the first bucket an earlier backward reduced that this one has not (yet) reached;
the rest start in ``finish_grad_sync``, which skips the buckets whose reduction stands. Each
extra backward costs one more reduction of what it reaches, so ``no_sync()`` on all but the
last micro-batch stays the cheap way to accumulate (one reduction per step).

[Note: a step held whole]
Sharded grads reduce every backward, inside ``no_sync`` too ([Note: sharded grads]), and sharded
params are gathered for every forward and backward: the least memory, at one reduction and two
gathers of the model per micro-batch. A pipeline stage runs many micro-batches per step, and
its schedule interleaves their forwards and backwards; there ``hold_step`` (set by
``distopt.pipelining.PipelineStage``, ``ddp.hold_step``) trades memory for traffic as FSDP2's
stages do: a backward under ``no_sync`` launches nothing and frees nothing, so each bucket keeps
its pool buffer (the grads add in it, [Note: grads written, not zeroed]) and its gathered
params, until the backward outside ``no_sync`` (the step's last), which launches every bucket
as its grads are complete and frees each bucket's params as before. A step then costs one
all-gather (the first forward's) and one reduce-scatter per bucket, as with full buffers, and a
rank holds the stage's grads and params whole during the step, not between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ...comm import collectives as comm
from ...options import GradSyncOptions
from ...parallel.dtensor import local_grad
from ...parallel.experts import ExpertParams
from ...parallel.process_groups import ParallelGroups
from .. import agreements
from ..buffers.bucket import Bucket
from ..buffers.grad_pool import GradPool
from ..state import SYNC_TRANSITIONS, SyncState, advance
from .grad_marker import GradInBuffer
from .grad_markers import GradMarkers
from .grad_reads import GradReads
from .nan_check import raise_on_nonfinite_grad
from .unused_params import unused_refusal, used_on_some_rank

# Why p.grad cannot be read now; see [Note: p.grad under distopt] in ddp/grads/grad_marker.py.
DURING_BACKWARD = (
    "during a backward pass: distopt moves each grad into its buffers and reduces it there; "
    "read p.grad after backward() returns"
)
AFTER_NO_SYNC = (
    "after a backward inside no_sync(): torch's DDP leaves this rank's own unreduced grads "
    "there, and distopt holds them in its buffers (with sharded grads, reduced already), so "
    "neither is torch's p.grad; read it after the step's last backward, outside no_sync()"
)
AFTER_ZERO = "after the grads were zeroed, before any backward"


class GradSync:
    """The grads of one step over a DDP's buckets: from the hooks to the synced shards."""

    def __init__(
        self,
        buckets: list[Bucket],
        params: list[nn.Parameter],
        param_names: dict[nn.Parameter, str],
        options: GradSyncOptions,
        parallel: ParallelGroups,
        grad_pools: dict[torch.dtype, GradPool],
        stats: comm.CommStats,
        dtensor_params: frozenset[nn.Parameter],
        *,
        experts: ExpertParams | None = None,
        refused_reads: Mapping[nn.Parameter, str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``refused_reads``: params whose ``p.grad`` answers nothing, each with why;
        ``device``: where the grads are (a meta-device model's target). See [Note: p.grad
        under distopt] in ddp/grads/grad_marker.py."""
        self.buckets = buckets  # in launch order
        self.bucket_of = {p: b for b in buckets for p in b.params}
        self.params = params  # registration order
        self.param_names = param_names
        self.options = options
        self.policy = options.grad_policy
        self.parallel = parallel
        self.grad_pools = grad_pools
        self.stats = stats
        self.dtensor_params = dtensor_params
        self.experts = experts
        # Each rank's pieces of the reduced grads span the group they are reduce-scattered
        # over; all-reduced, every rank holds them whole.
        self.reads = GradReads(
            buckets, params, param_names,
            parallel.dp_group if options.grad_policy.reduce_scatter else None, stats,
            refused_reads or {}, device or params[0].device)
        self.markers = GradMarkers(params, param_names, self.reads)
        self.agreements = agreements.enabled()
        if not self.agreements:
            self.reads.refused_all = "was read in a DDP built without agreements (a benchmark's)"
        # How errors name the model: "the DDP of <its module's class>" (a GAN has two).
        self.model_name = "the distopt DDP"
        self.state = SyncState.IDLE
        self.sync_enabled = True  # False inside no_sync()
        self.round = 0  # see [Note: grads after the reduction]
        self._grad_divisor = 1.0  # what this step's reduced grads are divided by (divide())
        self._launches = True  # whether this backward launches buckets as they fill
        # Under no_sync: keep the step's grads whole in the pool and its params gathered, to
        # reduce once at the synced backward; see [Note: a step held whole].
        self.hold_step = False
        self._next_launch = 0  # the first bucket of the launch order not launched yet
        self._next_replica = 0  # the first bucket whose second stage is not started yet
        self._param_index = {p: i for i, p in enumerate(params)}
        self._used = bytearray(len(params))  # which params got a grad this step, on this rank
        self.unused_params: frozenset[nn.Parameter] = frozenset()
        # Over the replicas and TP groups too, so that every rank of the mesh raises, or none
        # does, and each learns which rank produced the nan.
        self._nan_check_groups = parallel.verdict_groups(replicas=True)

    def _advance(self, new: SyncState) -> None:
        self.state = advance(self.state, new, SYNC_TRANSITIONS, "the grad sync")

    def rebuild_markers(self) -> None:
        """New markers from the params as they are now (a meta-device model, materialized)."""
        self.markers = GradMarkers(self.params, self.param_names, self.reads)

    # ------------------------------------------------------------------ backward

    def before_accumulate(self, param: nn.Parameter) -> None:
        """Before autograd accumulates ``param``'s grad: the first of a backward starts it,
        and the marker goes, so the grad is written as into an empty ``.grad``."""
        if self.state is not SyncState.BACKWARD:
            self._start_backward()
        self.markers.drop(param)  # not a p.grad set to None by the user: see take_grad_writes

    def _start_backward(self, *, on_engine: bool = True) -> None:
        # Grads cleared outside distopt (a zero_grad of the wrapped module) start a new step;
        # an earlier backward's reductions finish first (their second stages keep the launch
        # order on every rank). The end of this backward is queued on the autograd engine
        # (``on_engine``), or comes when ``assigned_grads`` ends.
        if self.markers.all_cleared():
            self.zero_grad_buffer()
        for bucket in self.buckets:
            bucket.wait_reduction()
        self.round += 1  # a bucket launched in an earlier backward may take grads again
        if not self.policy.reduces_every_backward and any(b.launched for b in self.buckets):
            # Buckets this backward reopens launch again, in order, past those that stand.
            self._next_launch = self._next_replica = 0
        self._launches = self.sync_enabled or (self.policy.reduces_every_backward
                                               and not self.hold_step)
        self.reads.invalidate(DURING_BACKWARD)
        self._advance(SyncState.BACKWARD)
        if on_engine:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @contextlib.contextmanager
    def assigned_grads(self) -> Iterator[None]:
        """One backward whose grads autograd computes but does not accumulate: code inside
        assigns them to ``p.grad`` (``torch.autograd.grad`` and an assignment, as the weight
        half of torch's split backward does). The tensor hooks still take the markers off the
        params they reach, so the code finds ``p.grad`` None; when the block ends, every
        ``p.grad`` it assigned goes into its bucket in launch order, as the post-accumulate
        hook would have put it, and the backward ends. See [Note: pipeline stages] in
        distopt/pipelining.py."""
        if self.state is SyncState.BACKWARD:
            raise RuntimeError(
                "assigned_grads() was entered while a backward pass is running: enter it "
                "between backward passes"
            )
        self._start_backward(on_engine=False)
        try:
            yield
        except BaseException:
            self._advance(SyncState.ACCUMULATED)  # its grads are dropped with the error
            raise
        for bucket in self.buckets:
            for param in bucket.params:
                if param.grad is not None and not isinstance(param.grad, GradInBuffer):
                    self.accumulate(param)
        self._end_backward()

    def accumulate(self, param: nn.Parameter) -> None:
        """After autograd accumulated ``param``'s grad: move it into its bucket."""
        grad = param.grad
        if grad is None:
            return
        bucket = self.bucket_of[param]
        if self._is_late(bucket):
            self.markers.drop(param)  # so that the next backward, after zero_grad(), is clean
            self._raise_late_grad(param, bucket)
        if param in self.dtensor_params:
            grad = local_grad(param, grad)
        bucket.add_grad(param, grad)
        self.markers.mark(param)
        self._used[self._param_index[param]] = 1
        if self._launches and bucket.mark_ready(param):
            # Every param of the bucket has its grad: no backward node reads them any more.
            bucket.release_params()
            if self.options.overlap_grad_reduce:
                self._launch_ready_buckets()

    def _is_late(self, bucket: Bucket) -> bool:
        # See [Note: grads after the reduction]: only a grad for a bucket launched in this
        # same backward is late; an earlier backward's bucket reduces again and adds.
        if not bucket.launched:
            return False
        if self.parallel.dp_size == 1 and not self.policy.reduces_every_backward:
            return False
        return bucket.launched_round == self.round

    def _raise_late_grad(self, param: nn.Parameter, bucket: Bucket) -> None:
        if bucket.wrote(param):
            why = (
                "its grad was accumulated twice in one backward, the second time after its "
                "bucket was reduced: run each parameter's backward once per backward (no "
                "reentrant activation checkpointing across a bucket: use_reentrant=False)"
            )
        else:
            why = (
                "run each parameter's backward once per backward (no reentrant activation "
                "checkpointing across a bucket: use_reentrant=False)"
            )
        raise RuntimeError(
            f"parameter '{self.param_names[param]}' of {self.model_name} got a gradient after "
            f"its bucket's data-parallel reduction had started in the same backward (bucket "
            f"{bucket.order} was already {bucket.state.value}), so it would be left out of the "
            f"reduced gradient: {why}"
        )

    def _launch_ready_buckets(self) -> None:
        # Strictly in launch order; see [Note: bucket launch order]. A bucket an earlier
        # backward reduced may still be reopened by this one ([Note: several backwards per
        # step]): the launches wait there, and finish_grad_sync passes it if it stands.
        while (self._next_launch < len(self.buckets)
               and not self._stands(self.buckets[self._next_launch])
               and self.buckets[self._next_launch].ready):
            self._launch_next()
        # Second stages too, in the same order, as far as first stages have finished.
        while self._next_replica < self._next_launch and self.buckets[
            self._next_replica
        ].advance_reduction(block=False):
            self._next_replica += 1

    def _launch_next(self) -> None:
        # Sharded grads under no_sync skip the second stage; see [Note: sharded grads].
        self.buckets[self._next_launch].launch_reduction(self.round,
                                                         replicate=self.sync_enabled)
        self._next_launch += 1

    @property
    def holding(self) -> bool:
        """Whether this backward keeps the step whole ([Note: a step held whole])."""
        return self.hold_step and not self.sync_enabled

    def _end_backward(self) -> None:
        self._advance(SyncState.ACCUMULATED)
        if not self.sync_enabled:
            self.reads.why = AFTER_NO_SYNC
        if self.holding:  # the grads stay in their buffers, the params gathered
            return
        for bucket in self.buckets:  # sharded params: nothing gathered after a backward
            bucket.release_params()
        if self.policy.reduces_every_backward:
            # See [Note: sharded grads]: every bucket reduces, the next backward starts fresh.
            self._launch_ready_buckets()
            self._launch_rest()
            for bucket in self.buckets:
                bucket.expect_every_grad()
            self._next_launch = self._next_replica = 0
        if self.sync_enabled:
            # What p.grad reads, agreed at the end of the backward on every rank alike, or at
            # the first read or the step; see [Note: p.grad under distopt] in
            # ddp/grads/grad_marker.py.
            if self._completes_at_end():
                self._complete()
            else:
                self.reads.complete = self._complete

    def _completes_at_end(self) -> bool:
        """Whether this backward's end waits for its reductions: not with overlap off (nothing
        is launched before the sync's finish), on a pipeline stage (whose backward's end must
        not wait for its reductions) or for a backward inside another one (reentrant activation
        checkpointing: the outer one goes on)."""
        return (self.options.overlap_grad_reduce and not self.hold_step
                and torch._C._current_autograd_node() is None)

    def _complete(self) -> None:
        """Launch every bucket left, wait for every reduction, and agree on what ``p.grad``
        reads; on every rank alike."""
        if not self.policy.reduces_every_backward:  # sharded grads launched all at the end
            self._launch_rest()
        self._wait_reductions()
        self._agree_reads()
        self._next_launch = self._next_replica = 0  # the next backward launches from the first

    def _wait_reductions(self) -> None:
        for bucket in self.buckets:
            bucket.wait_reduction()
        # Micro-batches reduced under no_sync only: their second stage, once, now.
        for bucket in self.buckets:
            bucket.replicate_if_needed()
            bucket.wait_reduction()

    def _agree_reads(self) -> None:
        if not self.agreements:  # a benchmark's DDP without them (ddp/agreements.py)
            return
        # With find_unused_parameters a param some rank used gets its p.grad, as torch's
        # DDP gives it: ``p.grad is None`` reads the flags, so they are waited for here.
        track = self.options.find_unused_parameters
        if not track:
            # Waited for at the first read, or by the next backward or zero: off the step's
            # critical path, and a read on one rank still communicates nothing.
            self.reads.start_agreement()
            return
        anywhere = self.reads.agree(self._used)
        if anywhere is not None:
            for param, used in zip(self.params, anywhere, strict=True):
                if used and param not in self.reads.refused:
                    self.markers.mark(param)

    def _launch_rest(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.launched and (bucket.launched_round == self.round
                                    or self._stands(bucket)):
                self._next_launch += 1  # launched already in this round, or its result stands
            else:
                self._launch_next()

    def _stands(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s reduction from an earlier backward of the step stands: with
        full grads a bucket is reduced again only once reopened by a new grad; with sharded
        grads every backward reduces every bucket ([Note: sharded grads])."""
        return (bucket.launched and bucket.launched_round != self.round
                and not self.policy.reduces_every_backward)

    # ------------------------------------------------------------------ the sync

    def finish(self) -> None:
        """Launch every bucket not launched in this round, in order, and wait for all."""
        if self.state is SyncState.SYNCED:
            return
        if self.state is SyncState.BACKWARD:
            raise RuntimeError(
                "finish_grad_sync() was called while a backward pass is running: call it (or "
                "optimizer.step()) after backward() returns"
            )
        # With sharded grads each backward launched every bucket at its end: only those that
        # got no backward this step are left.
        if not (self.policy.reduces_every_backward and self.state is SyncState.ACCUMULATED):
            self._launch_rest()
        self._wait_reductions()
        if (self.state is SyncState.ACCUMULATED and not self.reads.valid
                and not self.reads.pending):
            self._agree_reads()  # the step's last backward was under no_sync, or held
        self._release_grad_pools()
        unused: frozenset[nn.Parameter] = frozenset()
        unused_here: list[nn.Parameter] = []
        if self.options.find_unused_parameters:
            unused = frozenset(p for p, u in zip(self.params, self._used_anywhere(), strict=True)
                               if not u)
        elif self.state is SyncState.ACCUMULATED and 0 in self._used:  # a C scan, every step
            unused_here = [p for p, u in zip(self.params, self._used, strict=True) if not u]
        self._used = bytearray(len(self.params))
        self.unused_params = unused
        self._next_launch = self._next_replica = 0
        for bucket in self.buckets:
            bucket.expect_every_grad()
        self._apply_divisor()
        self._advance(SyncState.SYNCED)
        if unused_here:
            self._raise_unused(unused_here)
        if self.options.check_for_nan_in_grad:
            raise_on_nonfinite_grad(self.buckets, self.params, self.param_names,
                                    self._nan_check_groups, self.stats)

    def _raise_unused(self, unused: list[nn.Parameter]) -> None:
        # See [Note: params without a grad] in ddp/grads/unused_params.py: after the reductions,
        # so that a rank that used every param is not left waiting in one.
        raise unused_refusal([self.param_names[p] for p in unused], self.model_name)

    def take_grad_writes(self) -> None:
        """At the step, after the sync: what the user's loop assigned to ``p.grad``. A param
        whose ``p.grad`` was set to None is left out of the step, as torch.optim skips it (the
        rule for a param no rank used: ``unused_params``), its piece zeroed so that no norm of
        the step counts it; a tensor assigned is its grad, each rank copying its own range.
        No communication: the user's loop runs on every rank alike."""
        dropped, assigned = self.markers.replaced()
        for param, _ in [*((p, None) for p in dropped), *assigned]:
            if param in self.reads.refused:
                raise RuntimeError(f"p.grad of parameter '{self.param_names[param]}' was "
                                   f"assigned, but it {self.reads.refused[param]}")
        for param in dropped:
            self.reads.assign(param, None)
        for param, grad in assigned:
            self.reads.assign(param, grad)
        if dropped:
            self.unused_params = self.unused_params | frozenset(dropped)

    def divide(self, divisor: float) -> None:
        """Divide this step's grads by ``divisor``: the part each rank holds reduced, once it
        is (now, if the sync has finished). Dividing is linear, so dividing the average equals
        averaging the divided grads, and reductions in flight need not wait."""
        self._grad_divisor *= divisor
        if self.state is SyncState.SYNCED:
            self._apply_divisor()
        else:  # p.grad reads it into what they answer until then
            self.reads.divisor = self._grad_divisor

    def _apply_divisor(self) -> None:
        if self._grad_divisor != 1.0:
            for bucket in self.buckets:
                bucket.owned_grad.div_(self._grad_divisor)
            self.reads.divided(self._grad_divisor)
        self._grad_divisor = 1.0

    def _used_anywhere(self) -> list[int]:
        """Per param, whether any rank that holds it computed a grad for it this step."""
        return used_on_some_rank(self._used, self.params, self.experts, self.parallel,
                                 self.stats)

    def zero_grad_buffer(self, *, set_to_none: bool = True) -> None:
        """Start a new step's grads ([Note: grads written, not zeroed]); not ``set_to_none``,
        each ``p.grad`` that was there reads zeros until the next backward."""
        # Reductions launched but never waited for (a backward that raised before the step)
        # still write into the buffer and own their receive buffers: finish them first.
        for bucket in self.buckets:
            bucket.forget_grads()
        self.markers.clear(set_to_none=set_to_none)
        self.reads.reset(AFTER_ZERO)
        self._next_launch = self._next_replica = 0
        self._used = bytearray(len(self.params))
        self.unused_params = frozenset()
        self._release_grad_pools()
        self.round += 1
        self._grad_divisor = 1.0
        self._advance(SyncState.IDLE)

    def _release_grad_pools(self) -> None:
        # Nothing transient between steps; see [Note: sharded grads].
        for pool in self.grad_pools.values():
            pool.release()

    def release(self) -> None:
        """The wrapper lets go: nothing in flight, no marker left."""
        for bucket in self.buckets:
            bucket.forget_grads()
            bucket.wait_gather()
        self.markers.clear()
        self.reads.reset("after its DDP was released")
        self._release_grad_pools()
        self._advance(SyncState.RELEASED)
