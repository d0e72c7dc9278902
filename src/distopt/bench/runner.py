"""One configuration of the benchmark, run in its own freshly spawned process group.

``run_config`` spawns ``nproc`` ranks (a FileStore rendezvous in a fresh directory: no ports),
each of which builds the model from the same seed, wraps it as the configuration says, trains
``warmup + steps`` steps on its own slice of the data and times every phase of every step. The
ranks' results are gathered on rank 0 and written as JSON, which the parent reads back; the
process group and its memory die with the processes, so each configuration's peak RSS and
timings are its own.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distopt

from .._forkserver import forkserver_preloading
from .models import build_model
from .muon import MUON_SYSTEMS, build_muon_system
from .peers import build_peer_system
from .phases import PhaseClock
from .stage_runs import measure_stages, summarize_stages
from .systems import PEER_SYSTEMS, CollectiveCounter, build_system, wire_bytes

PHASES = ("forward", "backward", "wait_reduce", "step", "wait_gather", "wait_agree")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What one spawned run trains and how it is measured."""

    system: str
    """One of ``systems.SYSTEMS``."""
    model: str
    """``gpt`` or ``mlp``."""
    nproc: int
    """Data-parallel ranks (processes)."""
    steps: int = 20
    """Timed steps, after the warm-up."""
    warmup: int = 5
    """Untimed steps first (allocations, lazy state, caches)."""
    batch_size: int = 1
    """Sequences per rank per step."""
    seq_len: int = 128
    """Tokens per sequence (MLP: rows per sample)."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (nccl, one GPU per rank)."""
    threads: int = 1
    """torch intra-op threads per rank."""
    bucket_size: int | None = None
    """distopt elements per bucket; None = distopt's default."""
    pp: int = 1
    """Pipeline stages: above 1, the ``nproc`` ranks form a (pp, nproc / pp) mesh and each
    stage is sharded over its row (``stages.py``)."""
    microbatches: int = 1
    """Micro-batches per step of the pipeline schedule (``pp > 1``); they split
    ``batch_size``."""
    schedule: str = "1f1b"
    """The torch schedule of the stages: ``1f1b`` or ``gpipe``."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("nproc and steps must be >= 1 and warmup >= 0")
        if self.pp < 1 or self.nproc % self.pp:
            raise ValueError(f"pp ({self.pp}) must be at least 1 and divide nproc ({self.nproc})")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"microbatches ({self.microbatches}) must be at least 1 and "
                             f"divide batch_size ({self.batch_size})")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.batch_size < 1 or self.seq_len < 1 or self.threads < 1:
            raise ValueError("batch_size, seq_len and threads must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


def run_config(config: RunConfig, timeout_s: float = 600.0) -> dict[str, Any]:
    """Spawn the configuration's process group, run it, and return rank 0's summary."""
    with tempfile.TemporaryDirectory(prefix="distopt-bench-") as tmp:
        ctx = mp.get_context(forkserver_preloading("distopt.bench.runner"))
        procs = [
            ctx.Process(target=_worker, args=(rank, config, tmp), daemon=False)
            for rank in range(config.nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        path = os.path.join(tmp, "result.json")
        if not os.path.exists(path):
            errors = [
                Path(tmp, f).read_text() for f in sorted(os.listdir(tmp)) if f.startswith("error")
            ]
            return {"config": asdict(config), "error": "\n".join(errors) or "no result"}
        with open(path) as f:
            return json.load(f)


def timed_step(system: Any, bench_model: Any, inputs: tuple[torch.Tensor, ...]) -> float:
    """One training step of ``system`` on ``inputs``, started after a barrier: this rank's
    seconds (for the benchmarks that take the steps of several systems in turn)."""
    dist.barrier()
    start = time.perf_counter()
    system.zero_grad()
    system.backward(bench_model.loss(system.forward(*inputs)))
    system.sync()
    system.step()
    return time.perf_counter() - start


def slowest_rank(seconds: list[Any]) -> list[Any]:
    """``seconds`` (a list, or a list of equal lists) with each entry the slowest rank's."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def init_rank(rank: int, nproc: int, device: str, threads: int, tmp: str) -> torch.device:
    """Join the group of ``nproc`` spawned ranks that meet in directory ``tmp`` (gloo on
    ``cpu``, nccl on ``cuda`` with one GPU per rank); return this rank's device."""
    torch.set_num_threads(threads)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(os.path.join(tmp, "store"), nproc)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=nproc,
        timeout=datetime.timedelta(seconds=300),
    )
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _worker(rank: int, config: RunConfig, tmp: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = init_rank(rank, config.nproc, config.device, config.threads, tmp)
    try:
        result = measure_rank(rank, config, device)
        gathered: list[Any] = [None] * config.nproc
        dist.all_gather_object(gathered, result)
        if rank == 0:
            summary = summarize(config, gathered)
            with open(os.path.join(tmp, "result.json.tmp"), "w") as f:
                json.dump(summary, f)
            os.replace(os.path.join(tmp, "result.json.tmp"), os.path.join(tmp, "result.json"))
    except Exception:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def measure_rank(rank: int, config: RunConfig, device: torch.device) -> dict[str, Any]:
    """Run ``config`` on this rank of an initialized process group of ``config.nproc`` ranks;
    this rank's timings, losses, state bytes and collectives (``summarize`` joins them)."""
    if config.pp > 1:
        return measure_stages(rank, config, device)
    return _measure(rank, config, device)


def summarize(config: RunConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration's result from every rank's ``measure_rank``."""
    summary = _summarize(config, per_rank)
    return summarize_stages(config, per_rank, summary) if config.pp > 1 else summary


def _measure(rank: int, config: RunConfig, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    bench_model = build_model(config.model, config.seq_len)
    module = bench_model.module.to(device)
    num_params = sum(p.numel() for p in module.parameters())
    # Installed before the system is built: some peers bind torch's collectives when imported.
    counter = CollectiveCounter()
    counter.install()
    if config.system in MUON_SYSTEMS:
        build = build_muon_system
    elif config.system in PEER_SYSTEMS:
        build = build_peer_system
    else:
        build = build_system
    system = build(config.system, module, device, bucket_size=config.bucket_size)
    # Configurations on distopt's DDP (gather-muon too) time its collectives' waits.
    is_distopt = isinstance(system.model, distopt.DistributedDataParallel)
    newton_schulz = NewtonSchulzCounter()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if is_distopt:
        # distopt times its own collectives' waits; see collectives.CommStats.
        system.model.comm_stats.timed = True
        system.model.comm_stats.synchronize = sync

    clock = PhaseClock(system.model.comm_stats if is_distopt else None, sync)

    rows, losses = [], []
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            counter.reset()
            newton_schulz.calls = 0
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if is_distopt:
                system.model.comm_stats.reset()
        inputs = bench_model.batch(step, rank, config.batch_size, device)
        before = clock.waits()
        m0 = clock.mark()
        system.zero_grad()
        loss = bench_model.loss(system.forward(*inputs))
        m1 = clock.mark()
        system.backward(loss)
        m2 = clock.mark()
        system.sync()
        m3 = clock.mark()
        with newton_schulz:
            system.step()
        m4 = clock.mark()
        losses.append(float(loss.detach()))
        if step >= config.warmup:
            compute = clock.compute
            rows.append(clock.row(m0, m4, before, forward=compute(m0, m1),
                                  backward=compute(m1, m2),
                                  step=compute(m2, m3) + compute(m3, m4)))
    counter.uninstall()
    # First touches of freshly mapped pages: what a heap that unmaps its freed blocks costs
    # (docs/memory.md, "The process's heap at the edge of memory").
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    # Taken before the last gather: peers that bound the wrapped functions still call them.
    calls, sent = dict(counter.calls), dict(counter.bytes)
    system.finish_param_sync()

    state = system.state_bytes()
    result: dict[str, Any] = {
        "rank": rank,
        "rows": rows,
        "losses": losses,
        "num_params": num_params,
        "state_bytes": state,
        "calls": calls,
        "bytes": sent,
        "newton_schulz_calls": newton_schulz.calls,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "page_faults": faults,
        "model_source": bench_model.source,
        "checksum": float(sum(p.double().sum() for p in system.full_params())),
    }
    if is_distopt:
        result["distopt_comm"] = {
            "calls": dict(system.model.comm_stats.calls),
            "bytes": dict(system.model.comm_stats.bytes),
            "buckets": len(system.model.buckets),
            "bucket_size": system.model.bucket_size,
        }
    if device.type == "cuda":
        result["max_cuda_bytes"] = torch.cuda.max_memory_allocated()
    return result


class NewtonSchulzCounter:
    """Counts torch Muon's Newton-Schulz runs in this process while inside its block (the Muon
    configurations call the same function)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original: Any = None

    def __enter__(self) -> NewtonSchulzCounter:
        import torch.optim._muon as torch_muon

        self._original = original = torch_muon._zeropower_via_newtonschulz

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            return original(*args, **kwargs)

        torch_muon._zeropower_via_newtonschulz = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.optim._muon as torch_muon

        torch_muon._zeropower_via_newtonschulz = self._original


def _summarize(config: RunConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    steps = len(per_rank[0]["rows"])
    names = [name for name in per_rank[0]["rows"][0] if name != "total"]  # the phases
    # A step ends when the slowest rank ends it: take the max over ranks, then the median.
    totals = [max(r["rows"][i]["total"] for r in per_rank) for i in range(steps)]
    phases = {
        name: statistics.median(
            statistics.mean(r["rows"][i][name] for r in per_rank) for i in range(steps)
        )
        for name in names
    }
    median = statistics.median(totals)
    # A pipeline's stages share their batch: the ranks of one stage train the step's tokens.
    d = config.nproc // config.pp
    tokens = d * config.batch_size * config.seq_len
    first = per_rank[0]
    state = first["state_bytes"]
    payload = {op: b / steps for op, b in first["bytes"].items()}
    summary = {
        "config": asdict(config),
        "model_source": first["model_source"],
        "num_params": first["num_params"],
        "median_step_s": median,
        "step_s": totals,
        "tokens_per_s": tokens / median,
        "phases_s": phases,
        "phases_by_rank_s": [
            {name: statistics.median(row[name] for row in r["rows"]) for name in names}
            for r in per_rank
        ],
        "bytes_per_param": max(sum(r["state_bytes"].values()) for r in per_rank)
        / first["num_params"],
        "state_bytes": state,
        "max_rss_bytes": max(r["max_rss_bytes"] for r in per_rank),
        "page_faults_per_step": max(r["page_faults"] for r in per_rank) / steps,
        "calls_per_step": {op: c / steps for op, c in first["calls"].items()},
        "payload_bytes_per_step": payload,
        "wire_bytes_per_step": sum(wire_bytes(op, b, d) for op, b in payload.items()),
        "newton_schulz_per_step": [r["newton_schulz_calls"] / steps for r in per_rank],
        "final_loss": first["losses"][-1] if first["losses"] else None,
        "checksum": first["checksum"],
    }
    if "distopt_comm" in first:
        dc = first["distopt_comm"]
        summary["distopt_comm"] = {
            "calls_per_step": {op: c / steps for op, c in dc["calls"].items()},
            "payload_bytes_per_step": {op: b / steps for op, b in dc["bytes"].items()},
            "buckets": dc["buckets"],
            "bucket_size": dc["bucket_size"],
        }
    if "max_cuda_bytes" in first:
        summary["max_cuda_bytes"] = max(r["max_cuda_bytes"] for r in per_rank)
    return summary


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs of a configuration: the median of their median step
    times and phases; the per-run medians are kept for pairing ratios (report.add_ratios)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    merged = dict(ok[0])
    merged["step_s"] = [t for r in ok for t in r["step_s"]]
    merged["round_median_step_s"] = [r["median_step_s"] for r in ok]
    # The median of the runs' medians: a slow spell of the machine during one run moves it less
    # than it moves the pooled steps.
    median = statistics.median(merged["round_median_step_s"])
    merged["median_step_s"] = median
    merged["tokens_per_s"] = ok[0]["tokens_per_s"] * ok[0]["median_step_s"] / median
    merged["phases_s"] = {
        name: statistics.median(r["phases_s"][name] for r in ok) for name in ok[0]["phases_s"]
    }
    merged["max_rss_bytes"] = max(r["max_rss_bytes"] for r in ok)
    merged["failed_rounds"] = len(rounds) - len(ok)
    return merged
