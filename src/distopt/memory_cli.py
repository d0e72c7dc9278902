"""``distopt memory``: what training a model of a given size costs per rank, replicated vs distopt.

    distopt memory --params 7e9 --dp 8 --dtype bf16 --grad-dtype fp32
    distopt memory --model small --dp 4

The figures are the bytes-per-parameter table of docs/design.md (``bytes_per_param_breakdown``), by
component; activations and padding are not included.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .dtypes import DTYPES, dtype_name
from .memory import COMPONENTS, bytes_per_param_breakdown

GIB = 2**30
LABELS = {
    "params": "model params",
    "grads": "grad buffer",
    "main_params": "fp32 main params",
    "main_grads": "fp32 main grads",
    "optimizer_state": "optimizer state",
}
"""The table's name for each component of ``distopt.memory.BytesPerParam``."""


def _positive_count(text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number (e.g. 7e9)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distopt memory", description="Bytes per parameter and GiB per rank of training state."
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_positive_count, help="parameter count, e.g. 7e9")
    size.add_argument("--model", help="a demo GPT preset (tiny, small, medium)")
    parser.add_argument("--dp", type=_positive_count, default=8, help="data-parallel size")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="param dtype")
    parser.add_argument("--grad-dtype", choices=DTYPES, default=None,
                        help="grad dtype (default: fp32 for bf16/fp16 params)")
    parser.add_argument("--store-param-remainders", action="store_true",
                        help="distopt keeps bf16 params + 2-byte remainders as fp32 masters")
    parser.add_argument("--optimizer-state-bytes", type=int, default=8,
                        help="fp32 optimizer state per param: 8 for Adam, 4 for SGD momentum")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.model is not None:
        from .train.model import GPT, gpt_config  # the preset's exact parameter count

        try:
            config = gpt_config(args.model, seq_len=256)
        except ValueError as error:
            print(f"distopt memory: {error}", file=sys.stderr)
            return 2
        with torch.device("meta"):
            num_params = GPT(config).num_params()
        label = f"--model {args.model}"
    else:
        num_params, label = args.params, f"{args.params:.3g} params"
    param_dtype = DTYPES[args.dtype]
    grad_dtype = DTYPES[args.grad_dtype] if args.grad_dtype else (
        torch.float32 if param_dtype != torch.float32 else param_dtype)

    theory = bytes_per_param_breakdown(
        param_dtype, grad_dtype, optimizer_state_bytes=args.optimizer_state_bytes
    )
    try:
        # The replicated column is plain DDP + torch optimizer, which has no remainders.
        ours = bytes_per_param_breakdown(
            param_dtype, grad_dtype, optimizer_state_bytes=args.optimizer_state_bytes,
            store_param_remainders=args.store_param_remainders,
        )
    except ValueError as error:
        print(f"distopt memory: --store-param-remainders: {error}", file=sys.stderr)
        return 2
    replicated, distributed = theory.per_rank(args.dp, distributed=False), ours.per_rank(args.dp)
    labels = dict(LABELS)
    if args.store_param_remainders:
        labels["main_params"] = "remainders"
    rows = [(labels[name], replicated[name], distributed[name]) for name in COMPONENTS]
    rep_total = theory.total(args.dp, distributed=False)
    dist_total = ours.total(args.dp)
    print(f"{label}, {args.dtype} params, {dtype_name(grad_dtype)} grads, "
          f"data-parallel size {args.dp}\n")
    print(f"{'component':<18}{'replicated':>14}{'distopt':>14}{'distopt GiB/rank':>18}")
    print(f"{'':<18}{'B/param':>14}{'B/param':>14}")
    for name, rep, dist in [*rows, ("total", rep_total, dist_total)]:
        print(f"{name:<18}{rep:>14.3f}{dist:>14.3f}{dist * num_params / GIB:>18.2f}")
    print(f"\nGiB per rank: replicated {rep_total * num_params / GIB:.2f}, "
          f"distopt {dist_total * num_params / GIB:.2f} "
          f"({rep_total / dist_total:.2f}x less); activations not included")
    if args.store_param_remainders:
        print("with --store-param-remainders the step rebuilds fp32 masters (and fp32 copies of "
              "bf16/fp16 grads) one bucket's shard at a time; that transient is not included")
    return 0
