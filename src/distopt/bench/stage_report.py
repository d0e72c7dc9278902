"""The report of ``distopt bench --pp``: each configuration's stages against FSDP2's stages.

Step time, the busiest stage's bytes of training state per rank and the peak RSS of any rank
are each given as a ratio to the FSDP2 stages of the same launch (``fsdp2``, or
``fsdp2-reshard`` where only that ran); step times are paired by round as in the unpipelined
report. The memory columns are the busiest stage's (the stage whose ranks hold the most state
bytes); every stage's own figure is in the column after them and in ``bench.json``
(``stages``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .systems import LABELS, collectives_text

BASELINES = ("fsdp2", "fsdp2-reshard")
"""The configurations the pipeline ratios are taken to, the first that ran."""

PairedRatio = Callable[[dict[str, Any], dict[str, Any] | None], float | None]


def add_stage_ratios(group: list[dict[str, Any]], paired_ratio: PairedRatio) -> None:
    """Give each result of one pipeline group its ratios to the FSDP2 stages: step time
    (``ratio_to_fsdp2``), state bytes per rank and peak RSS."""
    ok = [r for r in group if "error" not in r]
    by_name = {r["config"]["system"]: r for r in ok}
    base = next((by_name[name] for name in BASELINES if name in by_name), None)
    for r in ok:
        r["ratio_to_ddp"] = r["ratio_to_fastest_peer"] = None
        r["baseline"] = None if base is None else base["config"]["system"]
        r["ratio_to_fsdp2"] = paired_ratio(r, base)
        r["state_ratio_to_fsdp2"] = (None if base is None else
                                     r["state_bytes_per_rank"] / base["state_bytes_per_rank"])
        r["rss_ratio_to_fsdp2"] = (None if base is None else
                                   r["max_rss_bytes"] / base["max_rss_bytes"])


def format_stage_table(group: list[dict[str, Any]]) -> str:
    """One pipeline group as a table: a line per configuration."""
    first = next((r for r in group if "error" not in r), group[0])
    c = first["config"]
    pp, dp = c["pp"], c["nproc"] // c["pp"]
    lines = [
        f"\n{c['model']} in {pp} pipeline stages, (pp, dp) = ({pp}, {dp}), {c['device']}, "
        f"{c['schedule']} with {c['microbatches']} micro-batches, batch {c['batch_size']} x "
        f"{c['seq_len']} per pipeline",
    ]
    if "stages" in first:
        params = ", ".join(f"{s['num_params'] / 1e6:.2f}M" for s in first["stages"])
        lines.append(f"params by stage (the tied embedding on both ends): {params}; memory "
                     f"columns: the busiest stage's ranks")
    lines.append(
        f"{'configuration':<32}{'step ms':>9}{'tok/s':>9}{'/FSDP2':>8}{'B/param':>9}"
        f"{'theory':>8}{'state MiB':>10}{'/FSDP2':>8}{'RSS MiB':>9}{'/FSDP2':>8}"
        f"{'wire MB':>9}  {'MiB by stage':<14}collectives per step"
    )
    for r in group:
        name = LABELS[r["config"]["system"]]
        if "error" in r:
            lines.append(f"{name:<32}  failed: {r['error'].strip().splitlines()[-1]}")
            continue
        by_stage = "/".join(f"{s['state_bytes'] / 2**20:.1f}" for s in r["stages"])
        colls = collectives_text(r, digits=2)
        lines.append(
            f"{name:<32}{r['median_step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>9.0f}"
            f"{_ratio(r.get('ratio_to_fsdp2')):>8}{r['bytes_per_param']:>9.2f}"
            f"{r['theory_bytes_per_param']:>8.2f}{r['state_bytes_per_rank'] / 2**20:>10.2f}"
            f"{_ratio(r.get('state_ratio_to_fsdp2')):>8}{r['max_rss_bytes'] / 2**20:>9.0f}"
            f"{_ratio(r.get('rss_ratio_to_fsdp2')):>8}{r['wire_bytes_per_step'] / 1e6:>9.2f}"
            f"  {by_stage:<14}{colls}"
        )
    lines.append("collectives: the busiest stage's first rank; stage_*: between the stages "
                 "(activations and their grads, the tied embedding's grads); on gloo, "
                 "distopt's reduce-scatters and all-gathers are point-to-point sends")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
