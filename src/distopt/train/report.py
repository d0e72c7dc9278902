"""The end of a training run: the summary (memory held per rank beside the theory, losses,
speed) printed and written as JSON, and the loss curve as a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..dtypes import DTYPES
from ..memory import bytes_per_param_breakdown
from ..plan.ownership import OwnershipPlan
from .config import OPTIMIZERS, TrainConfig


def write_summary(
    out: Path,
    config: TrainConfig,
    world: int,
    reports: list[dict[str, Any]],
    history: list[dict[str, Any]],
    *,
    num_files: tuple[int, int],
    shard_size: int | None = None,
    optimizer_state_bytes: float,
    held_state_bytes: float | None = None,
    ownership: OwnershipPlan | None = None,
    experts: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``optimizer_state_bytes``: the model's mean state per param (from the table of
    optimizer classes), in fp32; ``held_state_bytes``: the same in the dtypes the run holds
    it in (``--state-dtype``; None: fp32); ``ownership``: the plan of a run whose params are
    owned whole, printed beside what the ranks measured (see [Note: memory of whole-tensor
    ownership] in distopt/plan/ownership.py); ``experts``: with --moe, this rank's expert
    params and the size of the group their state is sharded over (the expert-DP group)."""

    def breakdown(remainders: bool, state_bytes: float, shard_grads: bool = False,
                  shard_params: bool = False):
        return bytes_per_param_breakdown(
            DTYPES[config.dtype], DTYPES[config.grad_dtype],
            optimizer_state_bytes=state_bytes, store_param_remainders=remainders,
            shard_grads=shard_grads, shard_params=shard_params,
        )

    # Optimizer state is sharded over the shard group only (replicated across groups); the
    # replicated figure is plain DDP's, which keeps fp32 masters and fp32 state.
    held = optimizer_state_bytes if held_state_bytes is None else held_state_bytes
    table = breakdown(config.store_param_remainders, held, config.shard_grads,
                      config.shard_params)
    distopt_bytes = table.total(shard_size or world)
    if experts is not None:
        # An expert's share is sharded over its expert-DP group only: the rank's params
        # weighted by where each kind is sharded.
        expert_params, expert_dp = experts
        local = reports[0]["num_params"]
        distopt_bytes = ((local - expert_params) * distopt_bytes
                         + expert_params * table.total(expert_dp)) / local
    theory = {
        "distopt": distopt_bytes,
        "replicated": breakdown(False, optimizer_state_bytes).total(world, distributed=False),
    }
    evals = [h for h in history if "heldout_loss" in h]
    first, last = evals[0]["heldout_loss"], evals[-1]["heldout_loss"]
    summary = {
        "config": config.as_dict(),
        "world_size": world,
        "optimizer": OPTIMIZERS[config.optimizer][0].__name__,
        "num_params": reports[0]["num_params"],
        "train_files": num_files[0],
        "heldout_files": num_files[1],
        "heldout_loss_start": first,
        "heldout_loss_end": last,
        "heldout_loss_ratio": last / first,
        "memory_per_rank": reports,
        "theory_bytes_per_param": theory,
    }
    if ownership is not None:
        summary["whole_tensor"] = {
            "balance": [
                {"cost": list(b.cost), "padding": list(b.padding), "imbalance": b.imbalance,
                 "best_imbalance": b.best_imbalance, "whole_padding": b.whole_padding}
                for b in ownership.balance()
            ],
            "padding_elements": ownership.padding,
            "table_bytes_per_param": ownership.table_bytes_per_param,
            "padding_bytes_per_param": ownership.padding_bytes_per_param,
            "expected_per_rank": [ownership.ranks[rank % ownership.dp_size].as_dict()
                                  for rank in range(world)],
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    mib = 2**20
    n = summary["num_params"]
    kind = "replicated (BasicOptimizer)" if config.no_shard else "distopt (sharded)"
    if shard_size and shard_size != world and not config.no_shard:
        kind = f"distopt (sharded over {shard_size} ranks, {world // shard_size} replicas)"
    lines = [
        "",
        f"distopt train: {config.model} GPT, {n:,} params, {world} ranks, "
        f"{summary['optimizer']}, {config.dtype} params / {config.grad_dtype} grads, {kind}",
        f"held-out loss {first:.3f} -> {last:.3f} ({100 * last / first:.1f}% of the start)",
        "",
        f"{'rank':<6}{'held MiB':>10}{'B/param':>10}   (params, grads, main params, "
        "main grads, optimizer state MiB)",
    ]
    for rank, r in enumerate(reports):
        parts = ", ".join(f"{r[k] / mib:.2f}" for k in
                          ("params", "grads", "main_params", "main_grads", "optimizer_state"))
        lines.append(f"{rank:<6}{r['total'] / mib:>10.2f}{r['bytes_per_param']:>10.2f}   ({parts})")
    if ownership is not None:
        lines += _ownership_lines(ownership, summary)
    lines += [
        f"theory: distopt {theory['distopt']:.2f} B/param = {theory['distopt'] * n / mib:.2f} MiB"
        f" per rank; replicated {theory['replicated']:.2f} B/param = "
        f"{theory['replicated'] * n / mib:.2f} MiB per rank",
        f"outputs: {out}/metrics.jsonl, summary.json, loss.png"
        + (", checkpoints/" if config.save else ""),
    ]
    print("\n".join(lines), flush=True)
    return summary


def _ownership_lines(plan: OwnershipPlan, summary: dict[str, Any]) -> list[str]:
    """The balance of the params owned whole, and each rank's bytes as table + padding + the
    state of what it owns beyond 1/d, beside what it measured."""
    lines = ["", "params owned whole: optimizer cost per rank (Newton-Schulz multiply-adds for "
             "Muon, elements for Adafactor) and padding"]
    for report in plan.balance():
        lines += report.format().splitlines()
    lines += ["", "B/param per rank = table + padding + state owned beyond 1/d "
              "(the layout's arithmetic), beside measured"]
    lines += [f"{'rank':<6}{'table':>9}{'padding':>10}{'owned':>9}{'expected':>10}{'measured':>10}"]
    for rank, measured in enumerate(summary["memory_per_rank"]):
        # With --shard-size, rank r is rank r % shard size of its shard group (the mesh's
        # last dimension), whose layout the plan is.
        shard_rank = rank % plan.dp_size
        lines.append(
            f"{rank:<6}{plan.table_bytes_per_param:>9.3f}{plan.padding_bytes_per_param:>10.3f}"
            f"{plan.ownership_bytes_per_param(shard_rank):>+9.3f}"
            f"{plan.ranks[shard_rank].bytes_per_param:>10.3f}{measured['bytes_per_param']:>10.3f}"
        )
    return lines


def write_loss_plot(path: Path, history: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    held = [(h["step"], h["heldout_loss"]) for h in history if "heldout_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1, alpha=0.8)
    if held:
        ax.plot(*zip(*held, strict=True), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("distopt train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["write_loss_plot", "write_summary"]


class MetricsLog:
    """JSONL metrics, one object per line, appended (a resumed run continues the file)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def progress_bar(config: TrainConfig, rank: int, initial: int):
    if rank != 0 or not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=initial, desc="distopt train", unit="step",
                dynamic_ncols=True)
