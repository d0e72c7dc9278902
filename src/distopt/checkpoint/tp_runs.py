"""Where a ZeRO piece of a tensor-parallel param lies in the param's global tensor: the runs a
checkpoint writes and reads it as.

[Note: TP checkpoints]
A checkpoint stores each param's main values and per-element state as 1-D tensors of the
param's global numel (see [Note: flat shards in DCP]), so that it reshards along TP as it does
along DP. A ZeRO piece of a DTensor param is the range [a, b) of the flattened local shard, and
the local shard is the box at global offset o of local shape l. With k the last dimension the
box cuts, the box is prod(l[:k]) blocks of prod(l[k:]) elements, each contiguous in the
flattened global tensor (the dims after k are whole); ``piece_runs`` intersects the piece with
those blocks. Shard(0) gives one run; Shard(1) of a matrix one run per row segment. Each run is
one DCP chunk at its global flat offset; a load asks for the runs of its own pieces and DCP
reads the overlapping saved chunks. Replicated params (plain or Replicate) are the identity and
are written only by the rank that counts them in grad statistics (TP coordinate 0), since every
TP rank holds the same values.
"""

from __future__ import annotations

from torch import nn

from ..parallel.dtensor import is_dtensor


def piece_runs(param: nn.Parameter, start: int, end: int) -> list[tuple[int, int, int]]:
    """Where elements ``[start, end)`` of ``param``'s flattened local shard lie in the flattened
    global tensor: ``(offset in the piece, global flat offset, length)`` per contiguous run.

    See [Note: TP checkpoints]. A plain param (and a ``Replicate`` one) is the identity: one run.

    Args:
        param: the model param, a DTensor on the tensor-parallel mesh or a plain tensor.
        start: the first element of the range, counted in the flattened local shard.
        end: one past the last element; a range with ``end <= start`` has no runs.
    """
    if end <= start:
        return []
    if not is_dtensor(param):
        return [(0, start, end - start)]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(param.shape)
    local, offset = compute_local_shape_and_global_offset(shape, param.device_mesh,
                                                          param.placements)
    if len(shape) == 0:
        return [(0, start, end - start)]
    # The last dimension that is cut is `cut`; the dims after it are whole, so the local box is
    # prod(local[:cut]) blocks of prod(local[cut:]) elements, each contiguous in the global tensor.
    cut = max((d for d in range(len(shape)) if local[d] != shape[d]), default=0)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    block = 1
    for n in local[cut:]:
        block *= n
    runs = []
    for j in range(start // block, (end - 1) // block + 1):
        lo, hi = max(start, j * block), min(end, (j + 1) * block)
        where, index = offset[cut] * strides[cut], j
        for d in range(cut - 1, -1, -1):  # unravel the block index over the leading dims
            index, i = divmod(index, local[d])
            where += (offset[d] + i) * strides[d]
        runs.append((lo - start, where + lo - j * block, hi - lo))
    return runs
