"""``distopt memory --optimizer muon|adafactor``: what owning each param whole costs a demo GPT,
by the layout arithmetic the DDP runs: the optimizer's work on each rank, the padding, and the
bytes each rank holds (``distopt.plan.ownership``)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..dtypes import DTYPES, STATE_DTYPES, dtype_name
from ..layout.elementwise import TARGET_BUCKETS, TARGET_BUCKETS_GLOO
from ..options import remainders_problem
from .memory_args import positive_count

BUCKET_TARGETS = {"nccl": TARGET_BUCKETS, "gloo": TARGET_BUCKETS_GLOO}
"""The buckets ``DistributedDataParallel`` cuts a model into by default, by backend."""

WHOLE_TENSOR_RECIPES = {
    "muon": "Muon for the hidden matrices, AdamW for embeddings, norms and biases",
    "adafactor": "Adafactor for every param",
}


def add_whole_tensor_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "whole-tensor optimizers", "what owning each param whole costs a --model: the "
        "optimizer's work on each rank, the padding, the bytes each rank holds")
    group.add_argument("--optimizer", choices=WHOLE_TENSOR_RECIPES, default=None,
                       help="the recipe of distopt train --optimizer (needs --model)")
    group.add_argument("--bucket-size", type=positive_count, default=None,
                       help="elements per bucket (default: distopt's default on --backend)")
    group.add_argument("--backend", choices=BUCKET_TARGETS, default=None,
                       help="whose default bucket size (default nccl; on gloo the DDP cuts a "
                            "model into fewer, larger buckets)")


def whole_tensor_table(args: argparse.Namespace) -> int:
    """The balance and the bytes per rank of a demo GPT under a whole-tensor optimizer, by the
    layout arithmetic the DDP runs (distopt.plan.ownership.predict_plan)."""
    if args.model is None:
        print("distopt memory: --optimizer needs --model (a demo GPT preset): the balance "
              "depends on the shapes of its matrices", file=sys.stderr)
        return 2
    if args.nodes is not None:
        print("distopt memory: --optimizer shows one data-parallel group; drop --nodes (or "
              "--optimizer), or give the shard group's size as --dp", file=sys.stderr)
        return 2
    from ..optim.recipes import hidden_matrices, muon_param_groups
    from ..plan.ownership import predict_plan
    from ..train.model import GPT, gpt_config

    try:
        config = gpt_config(args.model, seq_len=256)
    except ValueError as error:
        print(f"distopt memory: {error}", file=sys.stderr)
        return 2
    dp = args.dp or 8
    param_dtype = DTYPES[args.dtype]
    grad_dtype = DTYPES[args.grad_dtype] if args.grad_dtype else (
        torch.float32 if param_dtype != torch.float32 else param_dtype)
    problem = remainders_problem({param_dtype}) if args.store_param_remainders else None
    if problem:
        print(f"distopt memory: --store-param-remainders {problem}; add --dtype bf16",
              file=sys.stderr)
        return 2
    with torch.device("meta"):  # shapes only
        model = GPT(config).to(param_dtype)
    if args.optimizer == "muon":
        optimizer_cls, groups = torch.optim.Muon, muon_param_groups(model, lr=1.0)
        matrices = hidden_matrices(model)[0]
        what = (f"Muon for {len(matrices)} hidden matrices "
                f"({sum(p.numel() for p in matrices):,} params), AdamW for the rest")
        unit = "Newton-Schulz multiply-adds per iteration, max(m,n) min(m,n)^2 per m x n matrix"
    else:
        optimizer_cls, groups = torch.optim.Adafactor, None
        what, unit = WHOLE_TENSOR_RECIPES["adafactor"], "elements"
    backend = args.backend or "nccl"
    try:
        plan = predict_plan(model, optimizer_cls, groups, dp_size=dp, grad_dtype=grad_dtype,
                            bucket_size=args.bucket_size, target_buckets=BUCKET_TARGETS[backend],
                            store_param_remainders=args.store_param_remainders,
                            state_dtype=STATE_DTYPES[args.state_dtype],
                            shard_grads=args.shard_grads or args.shard_params,
                            shard_params=args.shard_params)
    except ValueError as error:
        print(f"distopt memory: --state-dtype {args.state_dtype}: {error}", file=sys.stderr)
        return 2
    layout = plan.buffers[0].layout
    whole = sum(bucket.whole_tensor for bucket in layout.buckets)
    size = args.bucket_size or f"distopt's default on {backend}"
    print(f"--model {args.model} ({plan.num_params:,} params): {what}; {args.dtype} params, "
          f"{dtype_name(grad_dtype)} grads, data-parallel size {dp}; {len(layout.buckets)} "
          f"buckets ({whole} of params owned whole), bucket size {size}\n")
    print(f"optimizer cost per rank ({unit}) and padding per rank (elements):")
    for report in plan.balance():
        print(report.format())
        print(f"busiest rank: {report.max_cost:.4g}, {report.imbalance:.4f}x the mean "
              f"(no assignment does better than {report.best_imbalance:.4f}x)")
    print("\nbytes per param each rank holds = the table, with the recipe's mean optimizer state "
          f"({plan.table.optimizer_state:.3f} B/param),\n+ the padding + the state of what the "
          "rank owns beyond an even share\n(tests/test_balance.py checks these against "
          "distopt.measure_state_bytes to the byte):")
    print(plan.format())
    busiest = max(plan.ranks, key=lambda r: r.total)
    replicated = plan.table.total(dp, distributed=False)
    print(f"\nbusiest rank {busiest.bytes_per_param:.3f} B/param = {busiest.total / 2**20:,.1f} "
          f"MiB; the padding adds {plan.padding_bytes_per_param / plan.table_bytes_per_param:.2%}"
          f" to the table; replicated (DDP + the same optimizers) {replicated:.3f} B/param")
    return 0
