"""One rank's run of a ``distopt bench --pp`` configuration, and what the ranks' runs add up to.

A step is timed in three phases: the schedule (every micro-batch's forward and backward, the
sends between stages and the bubbles), the end of the grad sync (FSDP2: the tie's all-reduce)
and the optimizer step. distopt's collective waits are cut out of the phase they happen in and
reported apart, as in the unpipelined benchmark.

The ranks of one stage hold the same params, the stages different ones, so the memory is
reported per stage (the most any rank of that stage measured) and, in the table, for the
busiest stage; the collectives per step are those of the busiest stage's first rank.
"""

from __future__ import annotations

import resource
import statistics
from typing import Any

import torch

from .models import build_model
from .phases import PhaseClock
from .stages import build_staged_system, stage_mesh, stage_param_count
from .systems import CollectiveCounter, wire_bytes

PIPELINE_PHASES = ("schedule", "wait_reduce", "step", "wait_gather", "wait_agree")


def measure_stages(rank: int, config: Any, device: torch.device) -> dict[str, Any]:
    """Train ``config`` (a ``RunConfig`` with ``pp > 1``) on this rank's stage; the rank's
    timings, losses, state bytes and collectives."""
    torch.manual_seed(config.seed)
    bench_model = build_model(config.model, config.seq_len)
    gpt = bench_model.module.to(device)
    mesh = stage_mesh(config.pp, device)
    counter = CollectiveCounter()
    counter.install()
    staged = build_staged_system(config.system, gpt, mesh, device,
                                 micro_batches=config.microbatches, schedule=config.schedule,
                                 bucket_size=config.bucket_size)
    del gpt, bench_model.module  # the other stages' layers
    counter.stage_groups = [g for g in (staged.pp_group, staged.tie_group) if g is not None]
    stats = staged.system.model.comm_stats if staged.is_distopt else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if stats is not None:
        stats.timed = True
        stats.synchronize = sync

    clock = PhaseClock(stats, sync)

    dp_rank = mesh.get_coordinate()[1]
    rows, losses = [], []
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            counter.reset()
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if stats is not None:
                stats.reset()
        # Every stage of a pipeline makes the same batch; the first feeds the inputs, the last
        # the targets.
        x, y = bench_model.batch(step, dp_rank, config.batch_size, device)
        before = clock.waits()
        m0 = clock.mark()
        staged.zero_grad()
        loss = staged.run(x, y)
        m1 = clock.mark()
        staged.sync()
        m2 = clock.mark()
        staged.step()
        m3 = clock.mark()
        if loss is not None:
            losses.append(float(loss))
        if step >= config.warmup:
            compute = clock.compute
            rows.append(clock.row(m0, m3, before, schedule=compute(m0, m1),
                                  step=compute(m1, m2) + compute(m2, m3)))
    counter.uninstall()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    calls, sent = dict(counter.calls), dict(counter.bytes)
    # Read before the checksum, whose gather of sharded params is not a step's.
    own = None if stats is None else (dict(stats.calls), dict(stats.bytes))
    staged.finish_param_sync()
    checksum = float(sum(p.detach().double().sum() for p in staged.whole_model_params()))
    result: dict[str, Any] = {
        "rank": rank,
        "stage": mesh.get_coordinate()[0],
        "rows": rows,
        "losses": losses,
        "num_params": stage_param_count(staged.stage),
        "state_bytes": staged.state_bytes(),
        "calls": calls,
        "bytes": sent,
        "newton_schulz_calls": 0,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "page_faults": faults,
        "model_source": "distopt.train.stages.GPTStage",
        "checksum": checksum,
    }
    if own is not None:
        # On gloo distopt's reductions are point-to-point sends, counted above with the rest;
        # its own counts say what they amount to.
        result["distopt_comm"] = {"calls": own[0], "bytes": own[1],
                                  "buckets": len(staged.system.model.buckets),
                                  "bucket_size": staged.system.model.bucket_size}
    if device.type == "cuda":
        result["max_cuda_bytes"] = torch.cuda.max_memory_allocated()
    return result


def summarize_stages(config: Any, per_rank: list[dict[str, Any]],
                     summary: dict[str, Any]) -> dict[str, Any]:
    """Turn ``summary`` (``runner._summarize`` of the ranks, which reads rank 0 as one of
    equals) into the pipeline's: the loss of the last stage, the whole model's checksum, and
    memory and collectives per stage, the table's from the busiest stage."""
    pp, dp = config.pp, config.nproc // config.pp
    steps = len(per_rank[0]["rows"])
    by_stage: list[list[dict[str, Any]]] = [[] for _ in range(pp)]
    for r in per_rank:
        by_stage[r["stage"]].append(r)
    stages = []
    for index, ranks in enumerate(by_stage):
        first = ranks[0]
        payload = {op: b / steps for op, b in first["bytes"].items()}
        state = max(sum(r["state_bytes"].values()) for r in ranks)
        stages.append({
            "stage": index,
            "num_params": first["num_params"],
            "state_bytes": state,
            "state_by_kind": first["state_bytes"],
            "bytes_per_param": state / first["num_params"],
            "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
            "calls_per_step": {op: c / steps for op, c in first["calls"].items()},
            "payload_bytes_per_step": payload,
            "wire_bytes_per_step": sum(
                wire_bytes(op, b, pp if op.startswith("stage_") else dp)
                for op, b in payload.items()),
            **({"distopt_comm": {
                "calls_per_step": {op: c / steps
                                   for op, c in first["distopt_comm"]["calls"].items()},
                "payload_bytes_per_step": {op: b / steps
                                           for op, b in first["distopt_comm"]["bytes"].items()},
                "buckets": first["distopt_comm"]["buckets"],
            }} if "distopt_comm" in first else {}),
        })
    busiest = max(stages, key=lambda s: s["state_bytes"])
    last = by_stage[-1]
    final = [r["losses"][-1] for r in last]
    summary.update({
        "pp": pp,
        "dp": dp,
        "stages": stages,
        "busiest_stage": busiest["stage"],
        # The table's memory and traffic: the busiest stage's.
        "num_params": busiest["num_params"],
        "state_bytes": busiest["state_by_kind"],
        "state_bytes_per_rank": busiest["state_bytes"],
        "bytes_per_param": busiest["bytes_per_param"],
        "max_rss_bytes": max(s["max_rss_bytes"] for s in stages),
        "calls_per_step": busiest["calls_per_step"],
        "payload_bytes_per_step": busiest["payload_bytes_per_step"],
        "wire_bytes_per_step": busiest["wire_bytes_per_step"],
        # Each DP rank's loss is its own batch's: their mean is the step's whole-batch loss.
        "final_loss": statistics.mean(final),
        "losses": [statistics.mean(r["losses"][i] for r in last)
                   for i in range(len(last[0]["losses"]))],
        "checksum": sum(by_stage[i][0]["checksum"] for i in range(pp)),
    })
    summary.pop("distopt_comm", None)
    if "distopt_comm" in busiest:
        summary["distopt_comm"] = busiest["distopt_comm"]
    return summary
