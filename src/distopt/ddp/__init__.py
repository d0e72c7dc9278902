"""The data-parallel runtime: ``DistributedDataParallel`` and what it runs during a step.

``wrapper.py`` is the public module; the rest are its parts: buckets and their buffers
(``buckets.py``), the transient grads of sharded grads (``grad_pool.py``), the param gathers'
forward pre-hooks (``param_gather.py``), the nan check (``nan_check.py``), the module buffers'
broadcast (``module_buffers.py``), ``p.grad``'s marker (``grad_marker.py``) and the registry of
which wrapper holds each param (``param_owners.py``).
"""

from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
