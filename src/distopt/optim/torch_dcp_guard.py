"""torch's DCP state-dict functions refuse distopt's optimizer, on every rank, before any
collective.

[Note: torch's DCP state dicts]
``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``get_optimizer_state_dict``,
``set_state_dict``, ``set_optimizer_state_dict``), the way torchtitan saves with DCP, reads a
``torch.optim`` optimizer's state param by param, after stepping it once on zero grads if its
``state`` is empty. distopt's optimizer keeps its state as shards of flat buffers, and a rank
that owns no element of a small model has an empty ``state``: there torch's functions would
step (a collective) while the other ranks raise at ``state_dict()``, and the step's
all-gather would wait for them until the timeout. So the functions' first check,
``_verify_options``, which every rank runs before any collective, refuses a distopt optimizer,
naming what works: ``distopt.save_checkpoint`` / ``load_checkpoint`` (DCP underneath: each rank
writes its own part, and a checkpoint loads at any data-parallel size), or
``opt.consolidate_state_dict(to=0)`` and one rank's ``torch.save(opt.state_dict())``. A model
alone (``get_model_state_dict``) passes: its state dict is the module's own, refused only for
sharded params between uses ([Note: a copy of a wrapped module] in ddp/module_hooks.py tells
the same for copies). Installed when a distopt optimizer is built (importing the module takes
half a second, paid once per process).
"""

from __future__ import annotations

import functools
from typing import Any

REFUSAL = (
    "torch.distributed.checkpoint.state_dict's functions read a torch.optim optimizer's state "
    "param by param, and a distopt optimizer keeps its state as shards of flat buffers. Save "
    "with distopt.save_checkpoint(path, ddp, opt) and resume with distopt.load_checkpoint(path, "
    "ddp, opt) (torch.distributed.checkpoint underneath: every rank writes its own part, and a "
    "checkpoint loads at any data-parallel size; async_save=True saves in the background), or "
    "call opt.consolidate_state_dict(to=0) on every rank and torch.save(opt.state_dict()) on "
    "rank 0. get_model_state_dict(ddp.module) alone works as for any module"
)


def guard_torch_state_dict_functions(optimizer_class: type) -> None:
    """Have torch's DCP state-dict functions refuse an ``optimizer_class`` (idempotent); see
    [Note: torch's DCP state dicts]."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    original = torch_state_dict._verify_options
    if getattr(original, "_distopt_guard", False):
        return

    @functools.wraps(original)
    def _verify_options(model: Any, optims: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(optim, optimizer_class) for optim in optims):
            raise TypeError(REFUSAL)
        return original(model, optims, *args, **kwargs)

    _verify_options._distopt_guard = True  # type: ignore[attr-defined]
    torch_state_dict._verify_options = _verify_options
