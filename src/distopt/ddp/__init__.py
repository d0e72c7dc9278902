"""The data-parallel runtime: ``DistributedDataParallel`` and what it runs during a step.

``wrapper.py`` is the public module and ``construction.py`` its constructor's stages; the rest
are rooms by what flows through them, lowest first:

- ``state.py`` (the step states), ``agreements.py`` (the collectives that carry no grad or
  param bytes) and ``param_owners.py`` (which wrapper holds each param): imported by all;
- ``buffers/``: where params and grads live, the contiguous buffers and their buckets;
- ``grads/``: a grad from autograd's hook to its reduction, and what ``p.grad`` answers;
- ``params/``: sharded params gathered around their use, and the module made whole again;
- ``torch_compat/``: torch DDP's own spellings taught to the wrapper;
- the wrapper's assembly at the top: ``construction.py``, ``buffer_layout.py`` (the buffers,
  the grad sync and the gathers built over a layout), ``module_buffers.py``,
  ``module_params.py``, ``stage_methods.py``, ``tied.py``, ``whole_tensor_params.py`` and
  ``wrapper.py``.

A room imports the rooms listed before it, never one after it (tests/test_import_graph.py).
"""

from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
