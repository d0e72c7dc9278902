"""``distopt memory``: what training a model of a given size costs per rank, replicated vs distopt.

    distopt memory --params 7e9 --dp 8 --dtype bf16 --grad-dtype fp32
    distopt memory --model small --dp 4
    distopt memory --params 7e9 --nodes 4 --gpus-per-node 8 --shard-size 8
    distopt memory --model small --dp 4 --optimizer muon --backend gloo
    distopt memory --params 7e9 --dp 8 --dtype bf16 --grad-dtype bf16 --store-param-remainders \
        --state-dtype bf16
    distopt memory --model medium --dp 8 --dtype bf16 --grad-dtype bf16 \
        --store-param-remainders --shard-grads
    distopt memory --params 47e9 --expert-params 45e9 --dp 16 --ep 8
    distopt memory --model small --moe 8 --dp 8 --ep 4
    distopt memory --model small --pp 2 --dp 2

The figures are the bytes-per-parameter table of docs/design.md (``bytes_per_param_breakdown``), by
component; activations and padding are not included. With ``--nodes`` it prints a plan for a
cluster instead: memory per rank and the bytes each rank sends per step inside a node and
across nodes, sharded within groups of ``--shard-size`` ranks beside the flat layout
(``distopt.plan.cluster``; see [Note: cluster traffic model] there). With ``--optimizer muon``
(or ``adafactor``) it shows what owning each matrix whole costs a model: the optimizer's work
on each rank, the padding, and the bytes each rank holds (cli/memory_whole_tensor.py). With
``--pp N`` it prints each pipeline stage's params and bytes per rank (cli/memory_pipeline.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..dtypes import DTYPES, STATE_DTYPES, dtype_name
from ..layout.elementwise import default_bucket_size
from ..memory import (
    COMPONENTS,
    BytesPerParam,
    bytes_per_param_breakdown,
    checkpoint_bytes_per_param,
)
from ..options import fp32_accumulation_problem
from ..plan.cluster import ClusterPlan, cluster_plan
from .memory_args import positive_count
from .memory_experts import add_expert_options, expert_problem, print_expert_table
from .memory_pipeline import (
    add_pipeline_options,
    pipeline_problem,
    print_stage_table,
    stage_counts,
)
from .memory_whole_tensor import add_whole_tensor_options, whole_tensor_table

GIB = 2**30
LABELS = {
    "params": "model params",
    "grads": "grad buffer",
    "main_params": "fp32 main params",
    "main_grads": "fp32 main grads",
    "optimizer_state": "optimizer state",
}
"""The table's name for each component of ``distopt.memory.BytesPerParam``."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distopt memory", description="Bytes per parameter and GiB per rank of training state."
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=positive_count, help="parameter count, e.g. 7e9")
    size.add_argument("--model", help="a demo GPT preset (tiny, small, medium)")
    parser.add_argument("--layers", type=positive_count, default=None,
                        help="with --model: its blocks instead of the preset's")
    parser.add_argument("--width", type=positive_count, default=None,
                        help="with --model: its width (n_embd) instead of the preset's")
    parser.add_argument("--heads", type=positive_count, default=None,
                        help="with --model: its attention heads instead of the preset's")
    parser.add_argument("--dp", type=positive_count, default=None,
                        help="data-parallel size (default 8; with --nodes: every rank)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="param dtype")
    parser.add_argument("--grad-dtype", choices=DTYPES, default=None,
                        help="grad dtype (default: fp32 for bf16/fp16 params)")
    parser.add_argument("--store-param-remainders", action="store_true",
                        help="distopt keeps bf16 params + 2-byte remainders as fp32 masters")
    parser.add_argument("--optimizer-state-bytes", type=int, default=8,
                        help="fp32 optimizer state per param: 8 for Adam, 4 for SGD momentum")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                        help="dtype distopt holds the optimizer state in between steps "
                        "(DistributedOptimizer(state_dtype=...)); fp16 and fp8 with one "
                        "1-byte scale per 32 elements")
    parser.add_argument("--shard-grads", action="store_true",
                        help="keep only each rank's reduced shard of the grads between steps "
                        "(DistributedDataParallel(shard_grads=True))")
    parser.add_argument("--shard-params", action="store_true",
                        help="keep only each rank's shard of the params too, gathered around "
                        "use (DistributedDataParallel(shard_params=True)); implies --shard-grads")
    parser.add_argument("--gathered-buckets", type=int, default=2, metavar="K",
                        help="with --shard-params: the gathered buckets a rank holds at once "
                        "(the peak's transient; 2: the bucket in use and the next, prefetched)")
    parser.add_argument("--offload", action="store_true",
                        help="the optimizer keeps its main params and state on the offload "
                             "tier (DistributedOptimizer(offload_dir=...)): RAM per rank "
                             "and bytes on the tier per rank")
    cluster = parser.add_argument_group(
        "cluster plan", "memory and bytes sent per rank, sharded within groups of ranks beside "
        "flat over every rank")
    cluster.add_argument("--nodes", type=positive_count, default=None,
                         help="nodes of the cluster (prints the cluster plan)")
    cluster.add_argument("--gpus-per-node", type=positive_count, default=None,
                         help="ranks per node (default 8)")
    cluster.add_argument("--shard-size", type=positive_count, default=None,
                         help="ranks each bucket is sharded over (default: the GPUs of a node)")
    cluster.add_argument("--reduce-scatter-fp32-accumulation", action="store_true",
                         help="bf16/fp16 grads summed in fp32 (the replicate stage gathers)")
    add_whole_tensor_options(parser)
    add_expert_options(parser)
    add_pipeline_options(parser)
    return parser


def _cluster_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster options, as the one line to print, or None."""
    if args.nodes is None:
        given = [flag for flag, value in (("--gpus-per-node", args.gpus_per_node),
                                          ("--shard-size", args.shard_size)) if value is not None]
        if given or args.reduce_scatter_fp32_accumulation:
            flags = " and ".join(given) or "--reduce-scatter-fp32-accumulation"
            return f"{flags}: options of the cluster plan; add --nodes N (e.g. --nodes 2)"
        return None
    world = args.nodes * (args.gpus_per_node or 8)
    if args.dp is not None and args.dp != world:
        return (f"--dp {args.dp} is not the cluster's {world} ranks; drop --dp (with --nodes "
                "every rank is data-parallel)")
    if args.shard_size is not None and world % args.shard_size:
        return (f"--shard-size {args.shard_size} does not divide the {world} ranks; pick a "
                f"divisor, such as the GPUs of one node ({args.gpus_per_node or 8})")
    problem = fp32_accumulation_problem({DTYPES[args.grad_dtype or "fp32"]})
    if args.reduce_scatter_fp32_accumulation and problem:
        return f"--reduce-scatter-fp32-accumulation {problem}; add --grad-dtype bf16"
    return None


def _size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more."""
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _print_cluster_plan(plan: ClusterPlan, num_params: int, labels: dict[str, str],
                        replicate_label: str) -> None:
    flat, sharded = plan.flat, plan.sharded
    where = ("each shard group inside one node" if sharded.shard_group_nodes == 1 else
             f"shard groups spanning up to {sharded.shard_group_nodes} nodes")
    print(f"{plan.nodes} nodes x {plan.gpus_per_node} GPUs = {plan.world_size} ranks; shard "
          f"size {sharded.shard_size}: {sharded.replicas} replicas, {where}\n")
    heads = (f"flat, d = {flat.shard_size}",
             f"shard {sharded.shard_size} x {sharded.replicas} replicas")
    print(f"{'':<30}{heads[0]:>26}{heads[1]:>26}")

    def table(title: str, rows: list[tuple[str, float, float]]) -> None:
        print(f"{title:<30}" + f"{'B/param':>12}{'per rank':>14}" * 2)
        for name, a, b in rows:
            print(f"  {name:<28}" + "".join(
                f"{value:>12.3f}{_size(value * num_params):>14}" for value in (a, b)))

    table("memory held per rank", [
        *[(labels[name], flat.memory[name], sharded.memory[name]) for name in COMPONENTS],
        ("total", flat.memory_total, sharded.memory_total)])
    print()
    traffic = [
        ("reduce-scatter (grads)", "reduce_scatter"),
        (replicate_label, "replicate_all_reduce"),
        ("all-gather (params)", "all_gather"),
        ("total", "total"),
        ("inside a node, mean", "inside_node"),
        ("across nodes, mean", "across_nodes"),
        ("across nodes, busiest rank", "across_nodes_busiest"),
    ]
    table("sent per rank and step", [
        (name, getattr(flat.traffic, field), getattr(sharded.traffic, field))
        for name, field in traffic])
    print("\nacross nodes: each collective modelled as a ring through its group's ranks in "
          "rank order,\nranks numbered node by node; busiest rank: the most one rank sends "
          "across nodes,\nwhich bounds a ring's time. Padding and activations not included.")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _cluster_problem(args) or pipeline_problem(args)
    if problem is not None:
        print(f"distopt memory: {problem}", file=sys.stderr)
        return 2
    if args.optimizer is not None:
        return whole_tensor_table(args)
    if args.backend is not None and not (args.shard_params and args.model):
        print("distopt memory: --backend picks the buckets of a --model under an --optimizer "
              "(e.g. --optimizer muon) or with --shard-params; the table has no buckets",
              file=sys.stderr)
        return 2
    shape = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.width),
                               ("n_head", args.heads)) if v is not None}
    if shape and args.model is None:
        print("distopt memory: --layers, --width and --heads change a --model preset; add "
              "--model small (say)", file=sys.stderr)
        return 2
    if args.model is not None:
        from ..train.model import GPT, gpt_config  # the preset's exact parameter count

        try:
            config = gpt_config(args.model, seq_len=256, n_experts=args.moe or 0, **shape)
        except ValueError as error:
            print(f"distopt memory: {error}", file=sys.stderr)
            return 2
        with torch.device("meta"):
            model = GPT(config)
        num_params = model.num_params()
        if args.moe:
            args.expert_params = sum(p.numel() for e in model.expert_lists()
                                     for p in e.parameters())
        label = f"--model {args.model}" + (f" --moe {args.moe}" if args.moe else "")
    else:
        model = None
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
            state_dtype=STATE_DTYPES[args.state_dtype], shard_grads=args.shard_grads,
            shard_params=args.shard_params,
        )
    except ValueError as error:
        print(f"distopt memory: --store-param-remainders: {error}", file=sys.stderr)
        return 2
    labels = _labels(args)
    if args.nodes is not None:
        return _cluster(args, num_params, label, grad_dtype, ours, labels)
    dp = args.dp or 8
    if args.pp is not None:
        return _pipeline(args, label, grad_dtype, ours, labels, dp)
    problem = expert_problem(args, num_params, dp)
    if problem is not None:
        print(f"distopt memory: {problem}", file=sys.stderr)
        return 2
    if args.expert_params is not None:
        print_expert_table(args, ours, num_params, dp, labels,
                           f"{label}, {args.dtype} params, {dtype_name(grad_dtype)} grads, "
                           f"data-parallel size {dp}")
        return 0
    replicated, distributed = theory.per_rank(dp, distributed=False), ours.per_rank(dp)
    rows = [(labels[name], replicated[name], distributed[name]) for name in COMPONENTS]
    rep_total = theory.total(dp, distributed=False)
    dist_total = ours.total(dp)
    print(f"{label}, {args.dtype} params, {dtype_name(grad_dtype)} grads, "
          f"data-parallel size {dp}\n")
    print(f"{'component':<18}{'replicated':>14}{'distopt':>14}{'distopt GiB/rank':>18}")
    print(f"{'':<18}{'B/param':>14}{'B/param':>14}")
    for name, rep, dist in [*rows, ("total", rep_total, dist_total)]:
        print(f"{name:<18}{rep:>14.3f}{dist:>14.3f}{dist * num_params / GIB:>18.2f}")
    print(f"\nGiB per rank: replicated {rep_total * num_params / GIB:.2f}, "
          f"distopt {dist_total * num_params / GIB:.2f} "
          f"({rep_total / dist_total:.2f}x less); activations not included")
    if args.offload:
        tier = distributed["main_params"] + distributed["optimizer_state"]
        dist_total -= tier
        print(f"with --offload the main params and optimizer state rest on the tier's file:\n"
              f"{tier * num_params / GIB:.2f} GiB per rank on the tier ({tier:.3f} B/param, "
              f"written and read once a step), {dist_total * num_params / GIB:.2f} GiB per "
              f"rank in RAM\n({dist_total:.3f} B/param); the step holds one bucket's shard of "
              "them at a time")
    _print_staging(args, num_params, dp)
    if args.store_param_remainders and not (args.shard_params and model is not None):
        print("with --store-param-remainders the step rebuilds fp32 masters (and fp32 copies of "
              "bf16/fp16 grads) one bucket's shard at a time; that transient is not included")
    if args.shard_params and model is not None:
        _print_sharded_peak(args, model, dp, param_dtype, grad_dtype,
                            dist_total * num_params)
    elif args.shard_params:
        bucket = args.bucket_size or default_bucket_size(dp, num_params)
        transient = args.gathered_buckets * bucket * theory.params
        print(f"with --shard-params every component is sharded; forward and backward gather "
              f"each bucket's params around the modules\nthat use them: at most "
              f"{args.gathered_buckets} buckets of {bucket:,} elements gathered at once "
              f"(--gathered-buckets), {transient / GIB:.2f} GiB\nper rank on top, and the "
              f"grads of a few buckets in flight (not included); peak "
              f"{(dist_total * num_params + transient) / GIB:.2f} GiB per rank")
    if args.shard_grads or (args.shard_params and model is None):
        print("with --shard-grads each bucket's grads live in a transient buffer from their first "
              "grad of a backward until\nthe bucket's reduce-scatter is done, a few buckets at a "
              "time (not included); no grad buffer is kept whole")
    if args.state_dtype != "fp32" and not (args.shard_params and model is not None):
        print(f"with --state-dtype {args.state_dtype} the step expands one bucket's shard of "
              "the state to fp32 at a time; that transient is not included (the replicated "
              "column keeps torch's fp32 state)")
    return 0


def _print_sharded_peak(args: argparse.Namespace, model: torch.nn.Module, dp: int,
                        param_dtype: torch.dtype, grad_dtype: torch.dtype,
                        state_bytes: float) -> None:
    """The peak per rank under --shard-params: the state and the transient bound of the
    model's real layout ([Note: transient bound] in memory.py)."""
    from ..memory import transient_bound_of_model

    model = model.to(param_dtype)
    bound = transient_bound_of_model(
        model, dp, grad_dtype=grad_dtype, bucket_size=args.bucket_size,
        gloo=args.backend == "gloo", store_param_remainders=args.store_param_remainders,
        state_dtype=STATE_DTYPES[args.state_dtype],
        offload=args.offload)
    process = _resident_bytes()  # this process: Python with torch and distopt imported
    peak = state_bytes + bound.total + process
    print(f"with --shard-params every component is sharded; each block (gather unit) is "
          f"gathered around its forward and backward,\nthe next one prefetched. Transient "
          f"bound per rank (distopt.transient_bound): gathered params "
          f"{bound.gathered_params / GIB:.2f} GiB,\ngrads in flight "
          f"{bound.grads_in_flight / GIB:.2f} GiB, step {bound.step / GIB:.2f} GiB: "
          f"{bound.total / GIB:.2f} GiB. Peak per rank: state {state_bytes / GIB:.2f} + bound "
          f"{bound.total / GIB:.2f}\n+ a process with torch imported {process / GIB:.2f} (this "
          f"one, measured) = {peak / GIB:.2f} GiB; activations not included")


def _resident_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _pipeline(args: argparse.Namespace, label: str, grad_dtype: torch.dtype,
              breakdown: BytesPerParam, labels: dict[str, str], dp: int) -> int:
    counts = stage_counts(args.model, args.pp)
    if isinstance(counts, str):
        print(f"distopt memory: {counts}", file=sys.stderr)
        return 2
    print_stage_table(counts, breakdown, dp, labels,
                      f"{label}, {args.dtype} params, {dtype_name(grad_dtype)} grads")
    return 0


def _print_staging(args: argparse.Namespace, num_params: int, ranks: int) -> None:
    """The host memory async saves keep per rank: what the rank writes of a checkpoint."""
    whole = checkpoint_bytes_per_param(
        DTYPES[args.dtype], optimizer_state_bytes=args.optimizer_state_bytes,
        state_dtype=STATE_DTYPES[args.state_dtype])
    print(f"async checkpoint staging: {whole / ranks:.3f} B/param, "
          f"{_size(whole / ranks * num_params)} of host memory per rank, kept between saves\n"
          f"(save_checkpoint(async_save=True) copies the part each rank writes: 1/{ranks} of a "
          f"checkpoint's\n{whole:g} B/param of params, fp32 main params and optimizer state)")


def _labels(args: argparse.Namespace) -> dict[str, str]:
    labels = dict(LABELS)
    if args.store_param_remainders:
        labels["main_params"] = "remainders"
    if args.shard_grads or args.shard_params:
        labels["grads"] = "grads"
    if args.state_dtype != "fp32":
        short = len(args.state_dtype) <= 4  # the label fits the 18-character column
        labels["optimizer_state"] = f"opt. {'state ' if short else ''}({args.state_dtype})"
    return labels


def _cluster(args: argparse.Namespace, num_params: int, label: str, grad_dtype: torch.dtype,
             breakdown: BytesPerParam, labels: dict[str, str]) -> int:
    gpus = args.gpus_per_node or 8
    plan = cluster_plan(args.nodes, gpus, args.shard_size or gpus, breakdown,
                        fp32_accumulation=args.reduce_scatter_fp32_accumulation)
    count = f" ({num_params:,} params)" if args.model is not None else ""
    accumulation = ", fp32-accumulated reduction" if args.reduce_scatter_fp32_accumulation else ""
    print(f"{label}{count}, {args.dtype} params, {dtype_name(grad_dtype)} grads{accumulation}")
    # With fp32 accumulation the replicate stage gathers every replica's chunk and sums it in
    # fp32 (see [Note: cluster traffic model]).
    replicate = ("replicate gather (grads)" if args.reduce_scatter_fp32_accumulation
                 else "replicate all-reduce (grads)")
    _print_cluster_plan(plan, num_params, labels, replicate)
    flat, sharded = plan.flat, plan.sharded
    print(f"\nshard {sharded.shard_size} against flat, per rank: "
          f"{_size(sharded.memory_total * num_params)} held instead of "
          f"{_size(flat.memory_total * num_params)};\nthe busiest rank sends "
          f"{_size(sharded.traffic.across_nodes_busiest * num_params)} across nodes per step "
          f"instead of {_size(flat.traffic.across_nodes_busiest * num_params)}")
    _print_staging(args, num_params, plan.world_size)
    return 0
