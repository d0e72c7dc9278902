"""Which distopt.DistributedDataParallel holds each parameter, so that a module can be wrapped
again.

[Note: one wrapper per param]
A DistributedDataParallel takes its module's trainable params over: a grad hook on each, forward
pre-hooks on the modules that hold them, each param's storage (``.data``, a DTensor's local
shard) a view into its param buffer and ``main_grad`` a view into its grad buffer. Two wrappers
cannot share a param. The first hook to run moves the grad into its own buffer and clears
``.grad``, so the second wrapper never sees it, and the first reduces it outside the second's
step; the first wrapper's buckets, never zeroed again, then refuse the next micro-batch's grads
as late. A second trainer over a trained model (a second ``DistoptTrainer``, a second
``Trainer.fit`` under ``DistoptStrategy``, a user who builds the DDP anew) met exactly that.

So each param has one owner, recorded here. A new wrapper claims its params when it is built,
after the model check and before its first broadcast; a live wrapper that holds any of them is
released first (``DistributedDataParallel.release``: collectives in flight waited for, its hooks
removed, every param given storage of its own holding its current values, ``main_grad``
dropped), so the module is a plain module again when it is wrapped anew. The old wrapper then
refuses to lay out buffers, reduce, zero or gather (its optimizer with it), naming the wrapper
that took its params over; it still reads (a checkpoint of the finished run saves). The trainer
integrations release their wrapper when training ends, so that the module leaves them plain for
any other trainer, torch's DDP included.

The registry holds params weakly and owners by weak reference: it keeps nothing alive. A live
wrapper is kept alive by its own hooks anyway, which hold its bound method.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# param -> weakref to the wrapper that holds it. Keyed by identity: a tensor's == is elementwise.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(param: nn.Parameter) -> Any | None:
    """The live wrapper that holds ``param``, or None."""
    ref = _OWNERS.get(param)
    return None if ref is None else ref()


def other_owners(params: Iterable[nn.Parameter], wrapper: Any) -> list[tuple[Any, nn.Parameter]]:
    """Each live wrapper other than ``wrapper`` that holds one of ``params``, once, with the
    first of them it holds, in the order of ``params``."""
    found: dict[int, tuple[Any, nn.Parameter]] = {}
    for param in params:
        holder = owner_of(param)
        if holder is not None and holder is not wrapper and id(holder) not in found:
            found[id(holder)] = (holder, param)
    return list(found.values())


def claim(params: Iterable[nn.Parameter], wrapper: Any) -> None:
    """Record ``wrapper`` as the owner of ``params`` (their earlier owners released already)."""
    ref = weakref.ref(wrapper)
    for param in params:
        _OWNERS[param] = ref


def disown(params: Iterable[nn.Parameter], wrapper: Any) -> None:
    """Forget ``wrapper`` as the owner of those of ``params`` it holds."""
    for param in params:
        if owner_of(param) is wrapper:
            del _OWNERS[param]
