"""``distopt export``: a checkpoint as one plain PyTorch file.

    distopt export runs/exp1/checkpoints final.pt
    distopt export runs/exp1/checkpoints/ckpt-000002 step2.pt --master-weights

See docs/checkpoints.md (Export to plain PyTorch) for what the file holds.
"""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import CheckpointError, export_checkpoint
from ..checkpoint.files import resolve


def main(argv: list[str]) -> int:
    """``distopt export CKPT OUT.pt``."""
    parser = argparse.ArgumentParser(
        prog="distopt export",
        description="Write a distopt checkpoint as one plain PyTorch file: the model's "
        "state_dict and a torch.optim state dict, one per optimizer class when the param "
        "groups use several (load it with torch.load(weights_only=True)).",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory "
                        "(its latest checkpoint is exported)")
    parser.add_argument("out", help="the .pt file to write")
    parser.add_argument("--master-weights", action="store_true",
                        help="write trainable params as their fp32 main params")
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC32 checks")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, master_weights=args.master_weights,
                                verify=not args.no_verify)
    except (CheckpointError, OSError) as exc:
        print(f"distopt export: error: {exc}", file=sys.stderr)
        return 2
    source = resolve(args.checkpoint)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {source}")
    return 0
