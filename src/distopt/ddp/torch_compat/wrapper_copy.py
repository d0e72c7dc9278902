"""A copy of the wrapper itself (``copy.deepcopy(ddp)``, a pickle of it): refused, naming a
copy of its module.

[Note: a copy of the wrapper]
torch scripts copy a model for evaluation or an EMA, and some copy the DDP wrapper rather than
its module. torch DDP's copy drops its process group and reducer and builds new ones over the
default group. distopt's wrapper cannot be copied that way: a copy would be a second
``DistributedDataParallel``, whose construction is collective (every rank compares the model
and takes the first rank's weights, [Note: one model on every rank] in cross_rank/model.py),
and whose buffers, views and hooks would have to be laid out again. Copied on one rank (an
evaluation under ``if rank == 0:``) it would leave that rank waiting for the others; copied
field by field it would be a wrapper whose params no longer view its buffers. What such a copy
is for is the module: ``copy.deepcopy(ddp.module)`` is a plain module holding the current
values, without distopt's hooks ([Note: a copy of a wrapped module] in ddp/params/module_hooks.py),
which every rank or one rank alone may make (with ``shard_params=True``, inside ``with
ddp.gathered_params():`` on every rank), and which can be wrapped again on every rank if it
is to train data-parallel. So a copy or pickle of the wrapper raises at once, on the rank that
makes it, before any collective, naming that.
"""

from __future__ import annotations

from typing import Any, NoReturn

_REFUSAL = (
    "{what} of a distopt.DistributedDataParallel is refused: a copy of the wrapper would be a "
    "second DistributedDataParallel, whose construction is collective over every rank and "
    "whose buffers and hooks cannot be copied. Copy the module instead: "
    "copy.deepcopy(ddp.module) is a plain module with the current values (with "
    "shard_params=True make it inside 'with ddp.gathered_params():' on every rank), and save "
    "with torch.save(ddp.module.state_dict()) or ddp.full_state_dict(); wrap a copy in a new "
    "distopt.DistributedDataParallel on every rank if it must train data-parallel"
)


class NotCopied:
    """The wrapper's refusal of ``copy.deepcopy`` and pickling; see
    [Note: a copy of the wrapper]."""

    def __deepcopy__(self, _memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_REFUSAL.format(what="copy.deepcopy()"))

    def __getstate__(self) -> NoReturn:
        raise TypeError(_REFUSAL.format(what="A pickle (torch.save, copy.copy)"))
