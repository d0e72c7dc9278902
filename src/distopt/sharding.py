"""How much of the training state each data-parallel rank holds a shard of: one value.

[Note: sharding strategy]
``DistributedDataParallel(sharding=...)`` says it in one word, as Megatron-FSDP's
``data_parallel_sharding_strategy`` does:

* ``"none"``: nothing sharded; grads are all-reduced and every rank steps every param
  (``BasicOptimizer``; also spelled ``use_distributed_optimizer=False``);
* ``"optim"`` (the default): fp32 main params and optimizer state sharded (ZeRO-1); each bucket
  is reduce-scattered out of the full grad buffer, which lives all step long;
* ``"optim_grads"``: grads sharded too (ZeRO-2; also spelled ``shard_grads=True``): between
  steps a rank keeps only its reduced shard of each bucket, and every backward reduces
  ([Note: sharded grads] in ddp/buffers/grad_pool.py);
* ``"optim_grads_params"``: params sharded too (ZeRO-3; also spelled ``shard_params=True``):
  between uses a rank holds only its shard of each bucket's params, gathered into a pool buffer
  around the forward and the backward of the modules that use them ([Note: sharded params] in
  ddp/buffers/param_storage.py).

The runtime reads it in one place per behaviour: each bucket's grad storage
(ddp/buffers/grad_storage.py: where its grads live, around its reduction) and the ``GradPolicy``
below (when the grad sync launches, and which grads may still come after a reduction).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Sharding(enum.Enum):
    """How much each data-parallel rank holds a shard of; see [Note: sharding strategy]."""

    NONE = "none"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"


@dataclass(frozen=True, slots=True)
class GradPolicy:
    """What a sharding means for the grad sync."""

    reduce_scatter: bool
    """Each rank keeps its shard of a bucket's reduced grads (False: all of them, all-reduced)."""
    full_grads: bool
    """The grad buffer holds every grad all step long (False: a pool buffer per reduction)."""
    reduces_every_backward: bool
    """Every backward reduces its grads, inside ``no_sync()`` too, and adds them to the kept
    shard: a backward may follow a reduction (but no grad may reach a bucket its own backward
    launched)."""
    full_params: bool = True
    """Every rank holds every param all step long (False: its shard, gathered around use)."""


POLICIES: dict[Sharding, GradPolicy] = {
    Sharding.NONE: GradPolicy(reduce_scatter=False, full_grads=True,
                              reduces_every_backward=False),
    Sharding.OPTIM: GradPolicy(reduce_scatter=True, full_grads=True,
                               reduces_every_backward=False),
    Sharding.OPTIM_GRADS: GradPolicy(reduce_scatter=True, full_grads=False,
                                     reduces_every_backward=True),
    Sharding.OPTIM_GRADS_PARAMS: GradPolicy(reduce_scatter=True, full_grads=False,
                                            reduces_every_backward=True, full_params=False),
}


def resolve_sharding(sharding: str | Sharding | None, *, use_distributed_optimizer: bool,
                     shard_grads: bool, shard_params: bool = False) -> Sharding:
    """The one value from ``sharding`` and its older spellings, which must agree with it."""
    if shard_params and not use_distributed_optimizer:
        raise ValueError(
            "shard_params=True keeps only this rank's shard of the params, but "
            "use_distributed_optimizer=False all-reduces the grads for an optimizer that steps "
            "every param (BasicOptimizer); pass use_distributed_optimizer=True "
            "(DistributedOptimizer) or drop shard_params"
        )
    implied = (Sharding.NONE if not use_distributed_optimizer
               else Sharding.OPTIM_GRADS_PARAMS if shard_params
               else Sharding.OPTIM_GRADS if shard_grads else Sharding.OPTIM)
    if sharding is None:
        if shard_grads and not use_distributed_optimizer:
            raise ValueError(
                "shard_grads=True keeps only this rank's shard of the reduced grads, but "
                "use_distributed_optimizer=False all-reduces them for an optimizer that needs "
                "every grad (BasicOptimizer); pass use_distributed_optimizer=True "
                "(DistributedOptimizer) or drop shard_grads"
            )
        return implied
    try:
        chosen = Sharding(sharding)
    except ValueError:
        raise ValueError(
            f"sharding={sharding!r} is not one of "
            f"{', '.join(repr(s.value) for s in Sharding)}: \"optim\" shards optimizer state "
            "(the default), \"optim_grads\" grads too, \"optim_grads_params\" params too, "
            "\"none\" nothing (all-reduced grads)"
        ) from None
    spelled_out = not use_distributed_optimizer or shard_grads or shard_params
    sharded_grads = {Sharding.OPTIM_GRADS, Sharding.OPTIM_GRADS_PARAMS}
    if shard_grads and not shard_params and chosen in sharded_grads:
        return chosen  # shard_grads=True is implied by sharded params
    if spelled_out and implied is not chosen:
        older = ("use_distributed_optimizer=False" if not use_distributed_optimizer
                 else "shard_params=True" if shard_params else "shard_grads=True")
        raise ValueError(
            f"sharding={chosen.value!r} disagrees with {older} (which means "
            f"sharding={implied.value!r}): pass one of the two"
        )
    return chosen
