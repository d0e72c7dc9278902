"""``distopt convert``: a DeepSpeed or Megatron-Core checkpoint as a DCP checkpoint in torch's
layout, which distopt, FSDP2 and torch DDP resume at any d.

    distopt convert runs/ds-exp1 runs/ds-exp1-dcp
    distopt convert runs/ds-exp1/global_step1000 step1000-dcp --from deepspeed
    distopt convert runs/gpt/iter_0001000 iter1000-dcp --from megatron

See docs/checkpoints.md (Runs from DeepSpeed, Runs from Megatron-Core) for what it carries.
"""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import CheckpointError
from ..checkpoint.convert import FORMATS, convert


def main(argv: list[str]) -> int:
    """``distopt convert SRC DST [--from deepspeed|megatron]``."""
    parser = argparse.ArgumentParser(
        prog="distopt convert",
        description="Write a DeepSpeed ZeRO or Megatron-Core distributed-optimizer checkpoint "
        "as a DCP checkpoint in torch's layout ({'model': ..., 'optimizer': ...} as "
        "get_state_dict gives them), which torch's dcp.load and set_state_dict resume under "
        "distopt, FSDP2 or torch DDP at any number of ranks. Needs neither DeepSpeed nor "
        "Megatron-Core installed. Megatron-Core: a dist_checkpointing.save in its torch_dist "
        "format, its DistributedOptimizer's state saved in the fully_reshardable or "
        "dp_reshardable (Megatron-LM's default) sharding.")
    parser.add_argument("src", help="the checkpoint directory the other system wrote "
                        "(DeepSpeed's save_checkpoint directory or one tag in it; Megatron-LM's "
                        "save directory or one iter_* in it, or the directory "
                        "dist_checkpointing.save wrote)")
    parser.add_argument("dst", help="the DCP checkpoint directory to write (must not exist)")
    parser.add_argument("--from", dest="fmt", choices=FORMATS,
                        help="the source's format (default: detected)")
    args = parser.parse_args(argv)
    try:
        converted = convert(args.src, args.dst, args.fmt)
    except (CheckpointError, OSError) as exc:
        print(f"distopt convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} from {converted.source}: {len(converted.model)} model entries, "
          f"{converted.numel():,} elements, {len(converted.param_groups)} param "
          "group(s)")
    for what in converted.not_carried:
        print(f"  not carried: {what}")
    return 0
