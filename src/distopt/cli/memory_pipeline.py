"""``distopt memory --model PRESET --pp N``: the bytes per rank of each pipeline stage.

The stages are the ones ``distopt train --pp N`` builds (``stage_param_counts`` in
train/stages.py): the demo GPT's blocks split evenly, the embeddings on the first stage, the
final norm and the head on the last. The head's weight is the embedding's, and the first and
the last stage each hold a copy of it ([Note: tied stage params] in optim/tied.py), so it is
counted on both. Each stage's params are sharded over the stage's own data-parallel group, of
``--dp`` ranks (the world is ``N x dp``), so a stage's bytes per rank are the table's at ``dp``
times the stage's params.
"""

from __future__ import annotations

import argparse

import torch

from ..memory import COMPONENTS, BytesPerParam


def add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=None, metavar="N",
                        help="with --model: its GPT split into N pipeline stages (distopt train "
                        "--pp N), each over --dp ranks; prints each stage's bytes per rank")


def pipeline_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--pp`` beside the other options, as the one line to print, or
    None. The preset's block count is checked in ``stage_counts``, which has the model."""
    if args.pp is None:
        return None
    if args.pp < 1:
        return f"--pp must be >= 1, got {args.pp}"
    if args.model is None:
        return ("--pp N splits a demo GPT preset's blocks into stages: add --model "
                "(e.g. --model small)")
    for flag, on in (("--moe", args.moe), ("--expert-params", args.expert_params is not None),
                     ("--nodes", args.nodes is not None),
                     ("--optimizer", args.optimizer is not None)):
        if on:
            return f"--pp does not compose with {flag} in distopt memory; drop one of them"
    return None


def stage_counts(model_name: str, pp: int) -> list[int] | str:
    """The trainable elements of each of ``pp`` stages of preset ``model_name``, or the one
    line saying why it cannot be split so."""
    from ..train.model import GPT, gpt_config
    from ..train.stages import stage_param_counts

    config = gpt_config(model_name, seq_len=256)
    if config.n_layer % pp:
        return (f"--pp {pp} does not divide the {config.n_layer} blocks of --model "
                f"{model_name}; pick a divisor of {config.n_layer}")
    with torch.device("meta"):  # shapes only: nothing is allocated
        return stage_param_counts(GPT(config), pp)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def print_stage_table(counts: list[int], ours: BytesPerParam, dp: int,
                      labels: dict[str, str], header: str) -> None:
    """Each stage's params and bytes per rank by component, and the busiest stage."""
    per_rank = ours.per_rank(dp)
    width = 16
    print(f"{header}, {len(counts)} pipeline stages x data-parallel size {dp} "
          f"({len(counts) * dp} ranks)\n")
    print(f"{'per rank':<18}" + "".join(f"{f'stage {i}':>{width}}" for i in range(len(counts))))
    print(f"{'params':<18}" + "".join(f"{n:>{width},}" for n in counts))
    for name in COMPONENTS:
        print(f"{labels[name]:<18}" + "".join(
            f"{_mib(per_rank[name] * n):>{width}}" for n in counts))
    totals = [ours.total(dp) * n for n in counts]
    print(f"{'total':<18}" + "".join(f"{_mib(t):>{width}}" for t in totals))
    # A sharded stage holds its step whole: see [Note: a step held whole] in ddp/grads/grad_sync.py.
    whole = ((ours.grads if ours.shard_grads or ours.shard_params else 0)
             + (ours.params if ours.shard_params else 0)) * (1 - 1 / dp)
    if whole:
        during = [t + whole * n for t, n in zip(totals, counts, strict=True)]
        print(f"{'during a step':<18}" + "".join(f"{_mib(t):>{width}}" for t in during))
    busiest = max(range(len(counts)), key=totals.__getitem__)
    print(f"\nbusiest stage: {busiest}, {_mib(totals[busiest])} per rank "
          f"({ours.total(dp):.3f} B/param x {counts[busiest]:,} params)")
    if whole:
        held = "grads and params" if ours.shard_params else "grads"
        print(f"during a step a stage holds its {held} whole, from the first micro-batch to the "
              "last backward (one reduction and one gather per step, as FSDP2's stages); "
              "their shards alone between steps")
    if len(counts) > 1:
        print("the tied embedding/head is counted on the first and on the last stage, which "
              "each hold a copy;\npadding and activations not included")
