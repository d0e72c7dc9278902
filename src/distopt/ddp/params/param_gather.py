"""Each module waits for the param gathers of its own buckets, and no others.

[Note: param gather]
After the optimizer updated its shard, each bucket's ``param_data`` is all-gathered from the
shards. With ``overlap_param_gather`` the gathers are started asynchronously (the first layers'
buckets first) and each module waits, in a forward pre-hook that runs before its other
pre-hooks, only for the buckets of its own parameters. Anything still in flight when the
wrapped forward returns is waited for, so a parameter read outside a module's own forward (a
tied head) is never stale afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from .module_hooks import ModuleHook

if TYPE_CHECKING:
    from ..buffers.bucket import Bucket


def register_param_wait_hooks(
    module: nn.Module, bucket_of: dict[nn.Parameter, Bucket],
    gathers_in_flight: Callable[[], bool],
) -> list[Any]:
    """A forward pre-hook on every submodule of ``module`` with params of its own, waiting
    (while ``gathers_in_flight()``) for the buckets that hold them, first layers first."""
    hooks = []
    for submodule in module.modules():
        buckets = sorted(
            {bucket_of[p] for p in submodule.parameters(recurse=False) if p in bucket_of},
            key=lambda b: b.order,
        )
        if buckets:
            # Before the module's own pre-hooks, which may read its params (torch's
            # spectral_norm computes the weight from weight_orig in one).
            hooks.append(submodule.register_forward_pre_hook(
                ModuleHook(_wait_hook(buckets, gathers_in_flight)), prepend=True))
    return hooks


def _wait_hook(buckets: list[Bucket], gathers_in_flight: Callable[[], bool]):
    def wait_for_params(_module: nn.Module, _args: Any) -> None:
        if gathers_in_flight():
            for bucket in buckets:
                bucket.wait_gather()

    return wait_for_params
