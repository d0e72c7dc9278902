"""The end of a training run: the summary (memory held per rank beside the theory, losses,
speed) printed and written as JSON, and the loss curve as a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..dtypes import DTYPES
from ..memory import bytes_per_param_breakdown
from .config import OPTIMIZERS, TrainConfig

_STATE_BYTES = {"sgd": 4, "adagrad": 4, "rmsprop": 4}  # fp32 state per param; Adam-likes: 8


def write_summary(
    out: Path,
    config: TrainConfig,
    world: int,
    reports: list[dict[str, Any]],
    history: list[dict[str, Any]],
    *,
    num_files: tuple[int, int],
    shard_size: int | None = None,
) -> dict[str, Any]:
    def breakdown(remainders: bool):
        return bytes_per_param_breakdown(
            DTYPES[config.dtype], DTYPES[config.grad_dtype],
            optimizer_state_bytes=_STATE_BYTES.get(config.optimizer, 8),
            store_param_remainders=remainders,
        )

    # Optimizer state is sharded over the shard group only (replicated across groups); the
    # replicated figure is plain DDP's, which keeps fp32 masters.
    theory = {
        "distopt": breakdown(config.store_param_remainders).total(shard_size or world),
        "replicated": breakdown(False).total(world, distributed=False),
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
    lines += [
        f"theory: distopt {theory['distopt']:.2f} B/param = {theory['distopt'] * n / mib:.2f} MiB"
        f" per rank; replicated {theory['replicated']:.2f} B/param = "
        f"{theory['replicated'] * n / mib:.2f} MiB per rank",
        f"outputs: {out}/metrics.jsonl, summary.json, loss.png, checkpoints/",
    ]
    print("\n".join(lines), flush=True)
    return summary


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
