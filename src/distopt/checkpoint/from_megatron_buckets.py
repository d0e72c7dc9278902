"""Megatron-Core's ``dp_reshardable`` sharding: its flat bucket tensors mapped back to the
params they hold, without Megatron-Core ([Note: Megatron-Core's dp_reshardable buckets]).

[Note: Megatron-Core's dp_reshardable buckets]
In the ``dp_reshardable`` sharding (Megatron-LM's default) the ``DistributedOptimizer`` saves
its state as its grad buffers' buckets: for bucket ``b`` of buffer ``g``, one 1-D tensor per
state, ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<(param dtype, grad
dtype)>.bucket_idx_<b>.<k>`` (``k``: ``param``, the fp32 master, ``exp_avg``, ``exp_avg_sq``),
whose index is the place in the bucket. The tensors name no params; Megatron-Core 0.19's
layout (``DistributedOptimizer._compute_per_buffer_param_layout``) places them, and it is
rebuilt here from the model's entries: the trained params of one buffer in reverse
``model.parameters()`` order (backprop order), each starting at a multiple of 64 elements;
a bucket closes at the param whose end reaches the bucket size (or, for a shared embedding,
at the padded start of the next), and the next bucket starts at place 0 of its own tensor.
Each saved bucket tensor is the bucket without the padding that ends it (its size is the
bucket's ``numel_unpadded``), so the tensors' sizes are the buckets' sizes, and the layout
needs no bucket size option. The optimizer's param groups and grad scaler are saved beside
as the objects ``optimizer.distributed.dp_group_idx_<i>.optimizer`` and ``.grad_scaler``.

The model's entries are taken in the order the checkpoint's metadata lists them, which is
``model.parameters()`` order where one rank writes them. The layout is checked three ways:
the params fill the buckets exactly, each param's ends are ends of the saved chunks (each
rank saves each param's piece as its own chunk), and, when a master is read, it equals the
saved model param cast to that param's dtype (bit for bit: Megatron-Core's params are their
masters' casts). A model whose entries include buffers or frozen params, entries saved out
of order, several buffers (params of several dtypes, experts) or several model-parallel
domains are refused by name: save those with ``fully_reshardable``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from .files import CheckpointError

PREFIX = "optimizer.distributed."
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(\w+)$")
_ALIGN = 64  # Megatron-Core's pad_param_start
_FIX = "save it with the 'fully_reshardable' sharding, which names each param's state"


def _pad(index: int) -> int:
    return -(-index // _ALIGN) * _ALIGN


def object_names(tensors: dict[str, Any], where: Any) -> list[str]:
    """The prefixes ``optimizer.distributed.dp_group_idx_<i>.`` of the buckets: one."""
    groups = sorted({m.group(1) for k in tensors if (m := _BUCKET.match(k))})
    if len(groups) != 1:
        raise CheckpointError(f"{where}: the dp_reshardable buckets span {len(groups)} "
                              "model-parallel domains (dp_group_idx); distopt convert reads "
                              f"one; {_FIX}")
    return [f"{PREFIX}dp_group_idx_{groups[0]}.{k}" for k in ("optimizer", "grad_scaler")]


def _buckets(tensors: dict[str, Any], where: Any) -> list[tuple[int, dict[str, str]]]:
    """Each bucket's size and its state tensors' keys, in bucket order."""
    buckets: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    for key in tensors:
        match = _BUCKET.match(key)
        if match:
            _, gbuf, dtype, bucket, name = match.groups()
            buckets.setdefault((gbuf, dtype), {}).setdefault(int(bucket), {})[name] = key
    if len(buckets) != 1:
        raise CheckpointError(f"{where}: the dp_reshardable state is in {len(buckets)} grad "
                              f"buffers ({', '.join(f'gbuf_idx_{g}, {d}' for g, d in buckets)})"
                              f"; distopt convert reads one (params of one dtype); {_FIX}")
    by_index = next(iter(buckets.values()))
    if sorted(by_index) != list(range(len(by_index))):
        raise CheckpointError(f"{where} is partial: it holds buckets {sorted(by_index)}")
    out = []
    for index in range(len(by_index)):
        keys = by_index[index]
        if "param" not in keys:
            raise CheckpointError(f"{where} is partial: bucket {index}'s fp32 masters (its "
                                  "'.param' tensor) are missing")
        sizes = {tuple(tensors[k].size) for k in keys.values()}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            raise CheckpointError(f"{where}: bucket {index}'s state tensors have shapes "
                                  f"{sorted(sizes)}, not one 1-D shape")
        out.append((next(iter(sizes))[0], keys))
    return out


def _chunk_ends(meta: Any) -> set[int]:
    ends = set()
    for chunk in meta.chunks:
        ends.update((chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
    return ends


def places(tensors: dict[str, Any], params: list[str],
           where: Any) -> dict[str, tuple[int, dict[str, str]]]:
    """Each of ``params`` (the model's tensor entries, in ``model.parameters()`` order): its
    start in its bucket, and its bucket's state tensors' keys."""
    buckets = _buckets(tensors, where)
    out: dict[str, tuple[int, dict[str, str]]] = {}
    index, position = 0, 0
    for param in reversed(params):
        numel = 1
        for n in tensors[param].size:
            numel *= n
        if index == len(buckets):
            raise CheckpointError(
                f"{where}: the model's entries do not fit the optimizer's {len(buckets)} "
                f"bucket(s): '{param}' and the entries before it are left over (buffers or "
                f"frozen params among the model's entries?); {_FIX}")
        size, keys = buckets[index]
        start = _pad(position)
        end = start + numel
        ends = _chunk_ends(tensors[keys["param"]])
        if end > size or start not in ends or end not in ends:
            raise CheckpointError(
                f"{where}: '{param}' ({numel} elements) does not fall where Megatron-Core's "
                f"layout places it in bucket {index} (elements {start}:{end} of {size}): the "
                "model's entries are not its trained params in model.parameters() order; "
                f"{_FIX}")
        out[param] = (start, keys)
        if _pad(end) >= size:
            if size not in (end, _pad(end)):
                raise CheckpointError(f"{where}: bucket {index} ends at element {size}, "
                                      f"inside the padding after '{param}'; {_FIX}")
            index, position = index + 1, 0
        else:
            position = end
    if index != len(buckets):
        raise CheckpointError(f"{where}: the model's params fill {index} of the optimizer's "
                              f"{len(buckets)} bucket(s); {_FIX}")
    return {param: out[param] for param in params}


def checked_master(read_master: Callable[[], torch.Tensor],
                   read_model: Callable[[], torch.Tensor], param: str,
                   where: Any) -> Callable[[], torch.Tensor]:
    """A reader of ``param``'s master that checks it against the saved model param."""

    def read() -> torch.Tensor:
        master, model = read_master(), read_model()
        if not torch.equal(master.to(model.dtype), model.reshape(-1)):
            raise CheckpointError(
                f"{where}: the bucket place derived for '{param}' does not hold its values "
                "(its master is not the saved param): the model's entries are not its trained "
                f"params in model.parameters() order; {_FIX}")
        return master

    return read
