"""What a checkpoint's DCP index says was written, and by which rank: read from ``.metadata``
with DCP's own reader, independently of how distopt decided who writes what."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader


def written_bytes(ckpt_dir: str | Path) -> dict[int, dict[str, int]]:
    """Tensor bytes each rank's file holds, by the first part of the key: ``model`` and
    ``optimizer`` in torch's layout (DCP's dotted keys), ``main``, ``state`` and ``model`` in
    distopt's earlier one: ``{rank: {"model": bytes, ...}}``."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    per_rank: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for index, info in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if not hasattr(meta, "chunks"):
            continue  # an object (param groups, extra)
        chunk = next(c for c in meta.chunks if c.offsets == index.offset)
        rank = int(info.relative_path.split("_")[2])  # "__{rank}_0.distcp"
        per_rank[rank][index.fqn.split("/")[0].split(".")[0]] += (math.prod(chunk.sizes)
                                                   * meta.properties.dtype.itemsize)
    return {rank: dict(kinds) for rank, kinds in per_rank.items()}


def untiled_keys(ckpt_dir: str | Path) -> list[str]:
    """Tensor keys whose saved chunks do not cover the tensor exactly once (a gap, an overlap:
    a byte written twice or never). 1-D keys are checked chunk by chunk in order."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    bad = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            continue
        if len(meta.size) == 1:
            end = 0
            for chunk in sorted(meta.chunks, key=lambda c: c.offsets[0]):
                if chunk.offsets[0] != end:
                    bad.append(fqn)
                    break
                end += chunk.sizes[0]
            else:
                if end != meta.size[0]:
                    bad.append(fqn)
        elif sum(math.prod(c.sizes) for c in meta.chunks) != math.prod(meta.size):
            bad.append(fqn)
    return bad
