"""The benchmark's outputs: a text table, a JSON file and a PNG bar chart."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from .muon import MUON_BASELINES, MUON_SYSTEMS
from .runner import PHASES
from .stage_report import add_stage_ratios, format_stage_table
from .stage_runs import PIPELINE_PHASES
from .systems import LABELS, PEERS, collectives_text


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Give each result its step time relative to DDP and to the fastest peer of its group
    (pipeline groups: relative to the FSDP2 stages, ``stage_report.add_stage_ratios``).

    Runs of one round are paired: the ratio is the median over rounds of the ratio of the two
    configurations' medians in that round, so drifts of the machine's speed between rounds
    cancel out.
    """
    for key, group in _groups(results).items():
        if key[3] > 1:
            add_stage_ratios(group, _paired_ratio)
            continue
        ok = [r for r in group if "error" not in r]
        by_name = {r["config"]["system"]: r for r in ok}
        peers = [r for r in ok if r["config"]["system"] in PEERS]
        # distopt's Muon is measured against the Muon baselines, not against AdamW peers.
        muon_peers = [r for r in ok if r["config"]["system"] in MUON_BASELINES]
        for r in ok:
            r["ratio_to_ddp"] = _paired_ratio(r, by_name.get("ddp"))
            mine = muon_peers if r["config"]["system"] in MUON_SYSTEMS else peers
            ratios = [_paired_ratio(r, p) for p in mine]
            r["ratio_to_fastest_peer"] = max(ratios) if ratios else None
            if mine:
                fastest = min(mine, key=lambda p: p["median_step_s"])
                r["fastest_peer"] = fastest["config"]["system"]


def _paired_ratio(r: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    if base is None:
        return None
    pairs = zip(r["round_median_step_s"], base["round_median_step_s"], strict=False)
    return statistics.median(a / b for a, b in pairs)


def _groups(results: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Results by (model, nproc, device, pp): the configurations compared with each other."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        c = r["config"]
        key = (c["model"], c["nproc"], c["device"], c.get("pp", 1))
        groups.setdefault(key, []).append(r)
    return groups


def format_table(results: list[dict[str, Any]]) -> str:
    lines = []
    header = (
        f"{'configuration':<32}{'step ms':>9}{'tok/s':>9}{'/DDP':>7}{'/best':>7}"
        f"{'B/param':>9}{'theory':>8}{'RSS MiB':>9}{'wire MB':>9}  collectives per step"
    )
    for (model, nproc, device, pp), group in _groups(results).items():
        if pp > 1:
            lines.append(format_stage_table(group))
            continue
        first = next((r for r in group if "error" not in r), group[0])
        params = first.get("num_params", 0)
        lines.append(
            f"\n{model} ({params / 1e6:.2f}M params), d = {nproc}, {device}, "
            f"batch {first['config']['batch_size']} x {first['config']['seq_len']} per rank"
        )
        lines.append(header)
        for r in group:
            name = LABELS[r["config"]["system"]]
            if "error" in r:
                lines.append(f"{name:<32}  failed: {r['error'].strip().splitlines()[-1]}")
                continue
            colls = collectives_text(r, digits=1)
            lines.append(
                f"{name:<32}{r['median_step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>9.0f}"
                f"{_ratio(r.get('ratio_to_ddp')):>7}{_ratio(r.get('ratio_to_fastest_peer')):>7}"
                f"{r['bytes_per_param']:>9.2f}{r['theory_bytes_per_param']:>8.2f}"
                f"{r['max_rss_bytes'] / 2**20:>9.0f}{r['wire_bytes_per_step'] / 1e6:>9.1f}  {colls}"
            )
    return "\n".join(lines)


def format_phases(results: list[dict[str, Any]]) -> str:
    lines = []
    # Pipeline stages time the schedule (every micro-batch's forward and backward) as one.
    for pipelined, phases in ((False, PHASES), (True, PIPELINE_PHASES)):
        rows = [r for r in results if "error" not in r
                and (r["config"].get("pp", 1) > 1) == pipelined]
        if not rows:
            continue
        lines.append(f"\n{'per-phase ms (median, mean over ranks)':<44}" + "".join(
            f"{p:>12}" for p in phases))
        for r in rows:
            c = r["config"]
            layout = f"pp={c['pp']} d={c['nproc'] // c['pp']}" if pipelined else f"d={c['nproc']}"
            name = f"{c['model']} {layout} {LABELS[c['system']]}"
            lines.append(f"{name:<44}" + "".join(
                f"{r['phases_s'][p] * 1e3:>12.1f}" for p in phases))
    return "\n".join(lines)


def format_muon(results: list[dict[str, Any]]) -> str:
    """The Muon configurations side by side: step time, bytes each rank sends per step, and
    the Newton-Schulz runs of each rank per step (empty without them)."""
    rows = [r for r in results if "error" not in r and r["config"]["system"] in MUON_SYSTEMS]
    if not rows:
        return ""
    lines = [f"\n{'Muon configurations':<44}{'step ms':>9}{'/best':>7}{'wire MB':>9}"
             f"{'B/param':>9}  Newton-Schulz runs per step on each rank"]
    for r in rows:
        c = r["config"]
        name = f"{c['model']} d={c['nproc']} {LABELS[c['system']]}"
        runs = ", ".join(f"{n:g}" for n in r["newton_schulz_per_step"])
        lines.append(
            f"{name:<44}{r['median_step_s'] * 1e3:>9.1f}"
            f"{_ratio(r.get('ratio_to_fastest_peer')):>7}{r['wire_bytes_per_step'] / 1e6:>9.2f}"
            f"{r['bytes_per_param']:>9.2f}  [{runs}] (sum {sum(r['newton_schulz_per_step']):g})"
        )
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_json(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """One panel per (model, d): median step time of each configuration, as a bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(_groups(results).items())
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    for ax, ((model, nproc, device, pp), group) in zip(axes[0], groups, strict=True):
        ok = [r for r in group if "error" not in r]
        names = [LABELS[r["config"]["system"]].replace(", ", "\n") for r in ok]
        values = [r["median_step_s"] * 1e3 for r in ok]
        colors = ["#9aa5b1" if r["config"]["system"] in PEERS + MUON_BASELINES else "#2b7bb9"
                  for r in ok]
        bars = ax.barh(range(len(ok)), values, color=colors)
        for bar, r in zip(bars, ok, strict=True):
            ratio = r.get("ratio_to_ddp") or r.get("ratio_to_fsdp2")
            text = f" {bar.get_width():.0f}" + (f" ({ratio:.2f}x)" if ratio else "")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text,
                    va="center", fontsize=7)
        ax.set_yticks(range(len(ok)), names, fontsize=7)
        ax.invert_yaxis()
        base = "FSDP2 stages" if pp > 1 else "DDP"
        ax.set_xlabel(f"median step time, ms (ratio to {base})")
        layout = f"(pp, dp) = ({pp}, {nproc // pp})" if pp > 1 else f"d = {nproc}"
        ax.set_title(f"{model}, {layout}, {device}", fontsize=9)
        ax.set_xlim(0, max(values, default=1) * 1.35)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
