"""torch DDP's own constructor arguments and ignore list, as distopt's DDP reads them.

[Note: torch DDP's spellings]
A script written for ``torch.nn.parallel.DistributedDataParallel`` passes its arguments by
torch's names; distopt's DDP takes each with torch's meaning, or refuses it, on every rank
before any collective, naming what works:

* ``device_ids`` / ``output_device``: torch's rule for a module on one device: None for a CPU
  module, ``[device]`` (an index or ``torch.device``, the module's) for a CUDA one; ``dim``
  only 0 (it splits inputs over several devices per process, which neither DDP does anymore);
* ``bucket_cap_mb``: the bucket size in MiB of grads, as torch's (distopt counts elements:
  ``bucket_size`` = MiB * 2**20 / the grad dtype's size); both at once are refused;
* ``init_sync``: True (torch's default) broadcasts the first rank's params and buffers at
  construction; False leaves each rank's own, as torch's does;
* ``static_graph``, ``gradient_as_bucket_view``: accepted, with nothing to change: distopt's
  hooks do not depend on the graph being static, and its grads always live in the buckets
  (``p.grad`` is a marker, [Note: p.grad under distopt] in ddp/grads/grad_marker.py);
* the ignore list (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``,
  torch's or distopt's, which set the same module attribute): those params and buffers are
  left out of the buffers, the reductions and the broadcasts, each rank keeping its own, as
  torch DDP leaves them; their grads are plain local ``p.grad``. distopt's one optimizer steps
  them too, each rank its own copy with its own grad, as torch's optimizer does under torch DDP
  ([Note: ignored params stepped locally] in optim/local_params.py);
* torch's experimental ``mixed_precision``, ``delay_all_reduce_named_params``,
  ``param_to_hook_all_reduce`` and ``skip_all_reduce_unused_params``: refused by name, with
  distopt's way to the same end;
* ``register_comm_hook``: torch's default ``allreduce_hook`` is accepted (it is what distopt
  does); its fp16 and bf16 compression hooks are refused naming ``grad_dtype=`` (grads held and
  reduced in that dtype, with ``reduce_scatter_with_fp32_accumulation=True`` summed in fp32),
  and any other hook (PowerSGD, a user's) by name, since hooks run on torch's own buckets;
* ``join()`` and ``torch.distributed.algorithms.Join([ddp])`` for uneven inputs: refused; a
  rank that ran out of data would have to shadow every reduction and gather of the others, so
  give every rank the same number of batches (``DistributedSampler(..., drop_last=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"
"""The module attribute torch DDP's ignore list is kept in (torch's own name)."""

_REFUSED = {
    "mixed_precision": "set the dtypes with distopt's own options: the module's own dtype "
                       "(model.to(torch.bfloat16)), grad_dtype= and the optimizer's "
                       "store_param_remainders= / state_dtype=",
    "delay_all_reduce_named_params": "distopt overlaps every bucket's reduction with backward; "
                                     "drop it",
    "param_to_hook_all_reduce": "distopt overlaps every bucket's reduction with backward; drop "
                                "it",
    "skip_all_reduce_unused_params": "pass find_unused_parameters=True, which leaves params no "
                                     "rank used out of the step",
}


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names in ``module``'s torch DDP ignore list (empty without one)."""
    return frozenset(getattr(module, IGNORE_ATTRIBUTE, ()) or ())


def set_ignore_list(module: nn.Module, names: Sequence[str]) -> None:
    """torch's ``_set_params_and_buffers_to_ignore_for_model``: the same attribute."""
    setattr(module, IGNORE_ATTRIBUTE, list(names))


def check_refused(extra: dict[str, Any]) -> None:
    """Refuse torch DDP arguments distopt does not take, naming its way; any other unknown
    argument is a TypeError, as Python's own."""
    for name in extra:
        if name in _REFUSED:
            raise ValueError(f"torch DDP's {name}= is not supported by distopt's DDP: "
                             f"{_REFUSED[name]}")
    if extra:
        raise TypeError(f"DistributedDataParallel() got unexpected keyword argument(s) "
                        f"{', '.join(sorted(extra))}")


def check_devices(device_ids: Any, output_device: Any, dim: int,
                  device: torch.device) -> None:
    """torch's rule for a module on one device (``device``)."""
    if dim != 0:
        raise ValueError(f"dim={dim}: distopt's DDP runs one device per process and splits no "
                         "inputs; drop dim")
    if device_ids is None:
        if output_device is not None and _as_device(output_device) != device:
            raise ValueError(f"output_device={output_device!r} is not the module's device "
                             f"{device}; drop output_device")
        return
    if device.type == "cpu" or device.type == "meta":
        raise ValueError(
            f"device_ids={device_ids!r} with a module on the CPU: as torch DDP, pass "
            "device_ids=None for a CPU module"
        )
    ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else None
    if ids is None or len(ids) != 1 or _as_device(ids[0], device.type) != device:
        raise ValueError(
            f"device_ids={device_ids!r}: one process drives one device, the module's "
            f"({device}); pass device_ids=[{device.index}] (or None)"
        )
    if output_device is not None and _as_device(output_device, device.type) != device:
        raise ValueError(f"output_device={output_device!r} is not device_ids[0] ({device}); "
                         "drop output_device")


def _as_device(value: Any, kind: str = "cuda") -> torch.device:
    if isinstance(value, int):
        return torch.device(kind, value)
    return torch.device(value)


def bucket_size_of(bucket_size: int | None, bucket_cap_mb: float | None,
                   grad_dtype: torch.dtype | None, param_dtypes: set[torch.dtype]) -> int | None:
    """``bucket_size`` (elements), from torch's ``bucket_cap_mb`` (MiB of grads) if given."""
    if bucket_cap_mb is None:
        return bucket_size
    if bucket_size is not None:
        raise ValueError("bucket_size= and bucket_cap_mb= both size the buckets: pass one "
                         "(bucket_size in elements, or torch's bucket_cap_mb in MiB)")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or (
            bucket_cap_mb <= 0):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                         f"{bucket_cap_mb!r}")
    itemsize = (grad_dtype.itemsize if grad_dtype is not None
                else max(d.itemsize for d in param_dtypes))
    return max(1, int(bucket_cap_mb * 2**20 / itemsize))


def positional_device_ids(process_group: Any) -> None:
    """torch's second positional argument is ``device_ids``, distopt's ``process_group``: a
    list or int there is a torch script's device list."""
    if isinstance(process_group, (list, tuple, int)) and not isinstance(process_group, bool):
        raise TypeError(
            f"distopt.DistributedDataParallel's second positional argument is process_group, "
            f"got {process_group!r}: pass torch's device_ids by keyword "
            "(DistributedDataParallel(module, device_ids=[...]))"
        )


def check_comm_hook(hook: Any) -> None:
    """Accept torch's default all-reduce hook, refuse any other by name; see
    [Note: torch DDP's spellings]."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook is default_hooks.allreduce_hook:
        return
    if hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        dtype = "float16" if hook is default_hooks.fp16_compress_hook else "bfloat16"
        raise ValueError(
            f"register_comm_hook({hook.__name__}): distopt reduces its own buckets, so torch's "
            f"hook would not run; to communicate grads in {dtype} build the DDP with "
            f"grad_dtype=torch.{dtype} (and reduce_scatter_with_fp32_accumulation=True to sum "
            "them in fp32)"
        )
    name = getattr(hook, "__qualname__", type(hook).__name__)
    raise ValueError(
        f"register_comm_hook({name}): torch DDP's hooks run on its own flattened buckets, which "
        "distopt's DDP does not have (it reduce-scatters its own); distopt takes only torch's "
        "default allreduce_hook. For bf16 or fp16 communication pass grad_dtype=torch.bfloat16 "
        "(or torch.float16) to the DDP instead"
    )


def refuse_join() -> None:
    raise RuntimeError(
        "join() (uneven inputs) is not supported by distopt's DDP: a rank that ran out of data "
        "would have to shadow every reduction and gather of the others. Give every rank the "
        "same number of batches, e.g. DistributedSampler(dataset, drop_last=True) and a "
        "DataLoader with drop_last=True"
    )
