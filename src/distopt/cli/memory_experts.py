"""``distopt memory --expert-params E --ep N``: a mixture of experts' bytes per rank, the dense
and the expert part side by side.

Under expert parallelism ([Note: expert parallelism] in parallel/experts.py) each of the dp ranks
holds every dense param and 1/ep of the experts; distopt shards the dense params' state over all
dp ranks and the experts' over the dp / ep ranks that hold the same experts (their
expert-data-parallel group). The last column is what a rank holds when the experts' state is
not sharded at all (each rank keeping its experts' state whole, as ZeRO-2 with expert
parallelism does in some stacks), for comparison.
"""

from __future__ import annotations

import argparse

from ..memory import COMPONENTS, BytesPerParam

GIB = 2**30


def add_expert_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "mixture of experts", "the dense and the expert part per rank under expert parallelism")
    group.add_argument("--expert-params", type=float, default=None, metavar="E",
                       help="parameters in the experts, of every expert (e.g. 6e9 of --params "
                       "7e9); prints the table by part")
    group.add_argument("--moe", type=int, default=None, metavar="N",
                       help="with --model: its GPT with a mixture of N experts in each block "
                       "(distopt train --moe N); the experts' params counted from it")
    group.add_argument("--ep", type=int, default=None,
                       help="expert-parallel size: ranks the experts are split over (divides "
                       "--dp; default 1)")


def expert_problem(args: argparse.Namespace, num_params: int, dp: int) -> str | None:
    """What is wrong with the expert options, or None."""
    if args.moe is not None and args.model is None:
        return "--moe N builds a demo GPT preset's mixture of experts: add --model (e.g. tiny)"
    if args.expert_params is None:
        return None if args.ep is None else "--ep needs --expert-params (e.g. 6e9)"
    ep = args.ep or 1
    if not 0 < args.expert_params < num_params:
        return (f"--expert-params {args.expert_params:.3g} must be above 0 and below the "
                f"model's {num_params:,} params")
    if ep < 1 or dp % ep:
        return f"--ep {ep} must divide --dp {dp} (the expert-data-parallel size is dp / ep)"
    if args.nodes is not None or args.optimizer is not None:
        return "--expert-params prints its own table; drop --nodes and --optimizer"
    return None


def print_expert_table(args: argparse.Namespace, ours: BytesPerParam, num_params: int,
                       dp: int, labels: dict[str, str], header: str) -> None:
    """GiB per rank by component: the dense params' part, the experts' part, the total, and
    the experts' part with their state unsharded."""
    ep = args.ep or 1
    expert_dp = dp // ep
    experts_here = args.expert_params / ep  # the experts one rank holds
    dense = num_params - args.expert_params
    dense_rank = ours.per_rank(dp)
    expert_rank = ours.per_rank(expert_dp)
    unsharded = ours.per_rank(1)
    print(f"{header}\n{args.expert_params:.3g} of the params in experts, split over ep = {ep}: "
          f"each rank holds {experts_here:.3g} expert params,\nsharded over its "
          f"expert-data-parallel group of {expert_dp}; the dense {dense:.3g} over all {dp}\n")
    rows = {name: [dense_rank[name] * dense, expert_rank[name] * experts_here,
                   unsharded[name] * experts_here] for name in COMPONENTS}
    rows["total"] = [sum(r[i] for r in rows.values()) for i in range(3)]
    unit, scale = ("GiB", GIB) if rows["total"][0] + rows["total"][1] >= GIB else ("MiB", 2**20)
    print(f"{'component':<18}{'dense ' + unit:>12}{'experts ' + unit:>13}{'total ' + unit:>12}"
          f"{'experts unsharded':>19}")
    for name, (d, e, u) in rows.items():
        print(f"{labels.get(name, name):<18}{d / scale:>12.2f}{e / scale:>13.2f}"
              f"{(d + e) / scale:>12.2f}{u / scale:>19.2f}")
    print(f"\nexpert state per rank at 1/{expert_dp} of its unsharded figure, dense at 1/{dp}; "
          "activations and the token all-to-all's buffers not included")
