"""The step states of the data-parallel runtime, and the transitions each may take.

[Note: step states]
What may happen next in a step is decided by one state per object, not by flags: the DDP's
``SyncState`` and each bucket's ``BucketState``. Every change goes through ``advance``, which
checks it against the object's table of transitions, so a sequence the runtime does not
support is an error that names the object and both states instead of a silent mix-up:

    DDP     IDLE --first grad of a backward--> BACKWARD --its end--> ACCUMULATED
            ACCUMULATED --another backward (micro-batch)--> BACKWARD
            IDLE | ACCUMULATED --finish_grad_sync--> SYNCED
            SYNCED --a backward the sharding allows after the sync--> BACKWARD
            any --zero_grad_buffer--> IDLE;   any --release()--> RELEASED (final)

    bucket  EMPTY --first grad--> FILLING --every grad of this backward--> READY
            EMPTY | FILLING | READY --launch--> REDUCING --waited for--> REDUCED
            REDUCED --a grad, or a reduction, the sharding adds to the reduced part--> FILLING |
            REDUCING
            any --forget_grads (a new step)--> EMPTY

A bucket's params have a life of their own, apart from its grads: with sharded params a
``ParamState`` (SHARDED -> GATHERING -> GATHERED -> SHARDED, around each use; [Note: sharded
params] in ddp/buffers/param_storage.py); otherwise they are always whole, and the gather after the
optimizer's update is one handle (in flight or not).
Which sequences a sharding allows (a backward after the sync, a grad after the reduction) is
the sharding's to say ([Note: sharding strategy] in sharding.py); the tables say which
transitions exist at all.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class SyncState(enum.Enum):
    """Where the DDP is in a step's grad sync."""

    IDLE = "idle"  # no grad since the last zero_grad_buffer
    BACKWARD = "backward"  # a backward pass is running
    ACCUMULATED = "accumulated"  # grads held after a backward; reductions may be in flight
    SYNCED = "synced"  # finish_grad_sync done: the reduced grads are ready for the step
    RELEASED = "released"  # the wrapper let go of its module (final)


class BucketState(enum.Enum):
    """Where a bucket's grads are in a step."""

    EMPTY = "empty"  # no grad since the step began
    FILLING = "filling"  # some grads of this backward written, others still to come
    READY = "ready"  # every grad of this backward written: it may launch
    REDUCING = "reducing"  # its reduction is launched and not yet waited for
    REDUCED = "reduced"  # waited for: this rank's part holds the average


class ParamState(enum.Enum):
    """Where a bucket's params are, with sharded params ([Note: sharded params] in
    ddp/buffers/param_storage.py); always GATHERED otherwise."""

    SHARDED = "sharded"  # this rank's shard only; the params are placeholders
    GATHERING = "gathering"  # an all-gather into a pool buffer is in flight
    GATHERED = "gathered"  # the params are views into the gathered buffer


S = TypeVar("S", SyncState, BucketState, ParamState)

SYNC_TRANSITIONS: dict[SyncState, frozenset[SyncState]] = {
    SyncState.IDLE: frozenset({SyncState.BACKWARD, SyncState.SYNCED}),
    SyncState.BACKWARD: frozenset({SyncState.ACCUMULATED}),
    SyncState.ACCUMULATED: frozenset({SyncState.BACKWARD, SyncState.SYNCED}),
    SyncState.SYNCED: frozenset({SyncState.BACKWARD}),
    SyncState.RELEASED: frozenset(),
}
# zero_grad_buffer and release() are allowed from every state but RELEASED.
for _state in SyncState:
    if _state is not SyncState.RELEASED:
        SYNC_TRANSITIONS[_state] = SYNC_TRANSITIONS[_state] | {SyncState.IDLE, SyncState.RELEASED}

BUCKET_TRANSITIONS: dict[BucketState, frozenset[BucketState]] = {
    BucketState.EMPTY: frozenset({BucketState.FILLING, BucketState.READY, BucketState.REDUCING}),
    BucketState.FILLING: frozenset({BucketState.READY, BucketState.REDUCING}),
    BucketState.READY: frozenset({BucketState.REDUCING}),
    BucketState.REDUCING: frozenset({BucketState.REDUCED}),
    BucketState.REDUCED: frozenset({BucketState.FILLING, BucketState.READY,
                                    BucketState.REDUCING}),
}
for _state in BucketState:
    BUCKET_TRANSITIONS[_state] = BUCKET_TRANSITIONS[_state] | {BucketState.EMPTY}


PARAM_TRANSITIONS: dict[ParamState, frozenset[ParamState]] = {
    ParamState.SHARDED: frozenset({ParamState.GATHERING}),
    ParamState.GATHERING: frozenset({ParamState.GATHERED}),
    ParamState.GATHERED: frozenset({ParamState.SHARDED}),
}


def advance(current: S, new: S, table: dict[S, frozenset[S]], who: str) -> S:
    """``new``, if ``table`` lets ``who`` go there from ``current``; else a RuntimeError that
    names both (a sequence of calls the runtime does not support)."""
    if new is not current and new not in table[current]:
        raise RuntimeError(
            f"{who} cannot go from {current.value} to {new.value}: distopt's runtime does not "
            "support this order of backward, finish_grad_sync, step and zero_grad calls; see "
            "[Note: step states] in ddp/state.py"
        )
    return new
