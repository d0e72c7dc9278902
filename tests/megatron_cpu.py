"""Megatron-Core's ``dist_checkpointing.save`` of its ``DistributedOptimizer`` on a CPU-only
torch, over gloo: the shims of [Note: peers on CPU] (distopt/bench/peers.py), which let its
DDP and optimizer be built and step, and the one more its save needs.

Saving the optimizer in the ``fully_reshardable`` sharding gathers every rank's flat state
with ``send_tensor.cuda()`` before the all-gather (``get_parameter_state_dp_zero``), and its
``torch_dist`` writer calls ``torch.cuda.synchronize()`` before staging the tensors: under
``megatron_saving_on_cpu`` ``Tensor.cuda()`` returns the tensor itself and ``synchronize`` does
nothing (no kernel is in flight on a CPU), besides the build
shims (``device="cuda"`` factories on the CPU, ``torch.cuda.current_device()`` answering
``"cpu"``). Megatron's arithmetic and the files it writes are its own; only where tensors live
changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from distopt.bench.peers import megatron_built_on_cpu


class _CudaCopiesOnCpu(TorchFunctionMode):
    """``t.cuda()`` is ``t``: a CPU tensor stays where it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def megatron_saving_on_cpu() -> Iterator[None]:
    """The shims Megatron-Core's optimizer ``sharded_state_dict`` and ``dist_checkpointing.save``
    need on a CPU, for the duration of the block."""
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # nothing runs asynchronously here
    try:
        with megatron_built_on_cpu(), _CudaCopiesOnCpu():
            yield
    finally:
        torch.cuda.synchronize = saved
