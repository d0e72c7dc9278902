"""The memory wall: a GPT whose replicated training state does not fit this machine trains under
``shard_params=True`` at d = 4, beside FSDP2 ``fully_shard`` on the same model.

The model is ``distopt.train.model.GPT`` built on the meta device (no rank ever holds it whole):
distopt materializes it module by module into each rank's param shards
([Note: meta-device models] in src/distopt/ddp/params/materialize.py), its blocks its gather units
([Note: gather units] in src/distopt/ddp/params/gather_units.py); FSDP2 shards it with
``fully_shard`` on every block and the root, then ``to_empty`` and ``reset_parameters`` on the
local shards, as its documentation shows. Both train fp32 params and grads with AdamW for a few
steps on tiny batches, one gloo process per rank with one thread each; ``--lean`` trains
distopt's lean tier instead (bf16 params with remainders, bf16 grads, bf16 AdamW state: 10
B/param sharded), beside what FSDP2 would need (16 B/param). Each rank reports the peak of its
resident set (the torch import included) in each phase (the kernel's ``VmHWM``, reset between
phases; the largest is the process's peak): setup (materialization included),
the first step (the optimizer state is allocated), the later steps, with ``--checkpoint
DIR`` a save and a load, and with ``--torch-checkpoint DIR`` the same through torch's functions
(``get_state_dict`` + ``dcp.save``; ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``),
printed beside distopt's own (after one untimed save, each road twice, in the order A B B A,
the mean of the two; each checkpoint removed after its load), and with ``--async-save`` each
road's async save too
(``save_checkpoint(..., async_save=True)``; ``dcp.async_save`` with torch's default
stager). distopt's peak is broken down into what the torch import costs, its state, and
its measured transients, beside ``distopt.transient_bound``'s prediction. The bytes torch
DDP and distopt's ZeRO-1 and ZeRO-2 would need are computed from their bytes per parameter
and compared with this machine's memory, not run: they would be killed for memory, and so
could be the machine's other work.

``--offload DIR`` runs distopt with its offload tier in DIR (``offload_dir=``: the masters and
the optimizer state in a file, one bucket's shard in memory at a time); beside
``--systems distopt-shard-params distopt-offload`` it runs both in one launch and prints the
offloaded step's time over the in-memory step's, the disk's own time for the bytes the tier
moved, and whether both runs ended on the same bits.

    nice -n 15 python benchmarks/memory_wall.py --layers 20 --width 2048 --steps 3
    nice -n 15 python benchmarks/memory_wall.py --layers 32 --width 2304 --steps 5 --lean \
        --systems distopt-shard-params
    nice -n 15 python benchmarks/memory_wall.py --layers 44 --width 2944 --seq-len 4 \
        --steps 3 --lean --offload /tmp/tier
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
SYSTEMS = ("distopt-shard-params", "distopt-offload", "fsdp2")
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _rss_bytes() -> int:
    """This process's resident set now."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def _phase_peak_bytes() -> int:
    """The resident set's high-water mark since the last ``_start_phase``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _start_phase() -> None:
    """Reset the high-water mark to the resident set now (Linux's clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def meminfo() -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable, in bytes."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":")
        values[key] = int(value.split()[0]) * 1024
    return {"total": values["MemTotal"], "available": values["MemAvailable"]}


class PageCacheSampler:
    """The machine's page cache during the steps, sampled every 0.2 s on a thread: the most it
    held above its level at the start (``Cached``), and the most of it dirty or being
    written (``Dirty`` + ``Writeback``), in bytes."""

    def __init__(self) -> None:
        import threading

        self._start = self._read()["Cached"]
        self.peaks = {"cached_above_start": 0, "dirty_or_writeback": 0}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> dict[str, int]:
        values = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":")
            values[key] = int(value.split()[0]) * 1024
        return values

    def _run(self) -> None:
        while not self._stopped.wait(0.2):
            now = self._read()
            self.peaks["cached_above_start"] = max(self.peaks["cached_above_start"],
                                                   now["Cached"] - self._start)
            self.peaks["dirty_or_writeback"] = max(self.peaks["dirty_or_writeback"],
                                                   now["Dirty"] + now["Writeback"])

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def build_on_meta(args: argparse.Namespace):
    import torch
    from torch import nn

    from distopt.train.model import GPT, GPTConfig

    config = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width)
    with torch.device("meta"):
        model = GPT(config)
        if args.lean:
            model = model.to(torch.bfloat16)
    # Meta-device init goes through each module's reset_parameters (both systems call it on
    # their shards): GPT-2's normal(0, 0.02) here rather than torch's defaults, whose
    # unit-variance embedding, tied to the head, starts the loss far above log(vocab).
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.reset_parameters = functools.partial(GPT._init_weights, module)
    return model


def wrap(system: str, model, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(the module to call, its optimizer, the distopt wrapper or None), the model's values
    created on this rank's shards only."""
    import torch

    if system in ("distopt-shard-params", "distopt-offload"):
        import distopt

        lean = {"grad_dtype": torch.bfloat16} if args.lean else {}
        ddp = distopt.DistributedDataParallel(model, shard_params=True,
                                              bucket_size=args.bucket_size, **lean)
        tier = ({"store_param_remainders": True, "state_dtype": torch.bfloat16} if args.lean
                else {})
        offload = {"offload_dir": args.offload} if system == "distopt-offload" else {}
        opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, **ADAMW, **tier, **offload)
        return ddp, opt, ddp
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # one unit per block and one at the root, as FSDP2's docs do
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return model, torch.optim.AdamW(model.parameters(), **ADAMW), None


def _untimed_save(ddp: Any, opt: Any, path: str) -> None:
    """torch's road once into ``path``, removed after: the page cache's first fill, outside the
    roads' times."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ddp, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    del msd, osd
    _remove(path)


def _remove(path: str) -> None:
    """Rank 0 removes ``path`` once every rank is done with it (a road's checkpoint, after its
    load: the rounds would otherwise hold four checkpoints' bytes on the disk)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _distopt_road(ddp: Any, opt: Any, path: str, timed: Any) -> None:
    """``save_checkpoint`` and ``load_checkpoint``, timed as the phases "save" and "load"."""
    import distopt

    timed("save", lambda: distopt.save_checkpoint(path, ddp, opt))
    timed("load", lambda: distopt.load_checkpoint(path, ddp, opt))
    _remove(path)


def _torch_road(ddp: Any, opt: Any, path: str, timed: Any) -> None:
    """``get_state_dict`` + ``dcp.save``, then ``get_state_dict`` + ``dcp.load`` +
    ``set_state_dict``, timed as "torch save" and "torch load"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save() -> None:
        msd, osd = get_state_dict(ddp, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load() -> None:
        msd, osd = get_state_dict(ddp, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(ddp, opt, model_state_dict=msd, optim_state_dict=osd)

    timed("torch save", save)
    timed("torch load", load)
    _remove(path)


def run_rank(rank: int, system: str, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    import distopt  # noqa: F401  (imported before the baseline, as every rank pays it)

    torch.set_num_threads(1)
    baseline = _rss_bytes()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, f"store-{system}"),
                                                         args.nproc),
                            rank=rank, world_size=args.nproc)
    phases: dict[str, int] = {}
    torch.manual_seed(0)  # the same initial values in every launch: runs compare bit for bit
    _start_phase()
    start = time.perf_counter()
    model = build_on_meta(args)
    num_params = sum(p.numel() for p in model.parameters())
    module, opt, ddp = wrap(system, model, args)
    setup_s = time.perf_counter() - start
    phases["setup"] = _phase_peak_bytes()
    after_setup = _rss_bytes()
    generator = torch.Generator().manual_seed(1000 + rank)
    losses, times = [], []
    page_cache = PageCacheSampler() if rank == 0 and system == "distopt-offload" else None
    for step in range(args.steps):
        _start_phase()
        if ddp is not None and step == 1:  # the transients of a step after the first
            for pool in (*ddp.param_pools.values(), *ddp.grad_pools.values()):
                pool.reset_peak()
        tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=generator)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = module(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        key = "first step" if step == 0 else "later steps"
        phases[key] = max(phases.get(key, 0), _phase_peak_bytes())
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / args.nproc)
    if page_cache is not None:
        page_cache.stop()
    checkpoint_s: dict[str, list[float]] = {}

    def timed(name: str, work: Any) -> None:
        """Run ``work`` as the phase ``name``: its time appended, its peak the phase's."""
        _start_phase()
        start = time.perf_counter()
        work()
        checkpoint_s.setdefault(name, []).append(time.perf_counter() - start)
        phases[name] = max(phases.get(name, 0), _phase_peak_bytes())

    roads = []
    if args.checkpoint and ddp is not None:
        roads.append(functools.partial(_distopt_road, ddp, opt,
                                       os.path.join(args.checkpoint, "memory-wall"), timed))
    if args.torch_checkpoint and ddp is not None:
        roads.append(functools.partial(_torch_road, ddp, opt,
                                       os.path.join(args.torch_checkpoint, "memory-wall-dcp"),
                                       timed))
    if roads:
        # The first large write of a launch pays for the page cache's first fill, whichever
        # road writes it (at 1.0B, d = 4: 17.7 s for torch's road first, against 5.4 s after
        # distopt's): one untimed save first, so that the roads are timed alike. Then each road
        # saves and loads twice, in the order A B B A, so that neither always follows the
        # other's writeback.
        _untimed_save(ddp, opt, os.path.join(args.checkpoint or args.torch_checkpoint,
                                             "memory-wall-first-fill"))
        for road in roads + roads[::-1] if len(roads) > 1 else roads:
            road()
    if args.async_save and ddp is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import distopt

        if args.checkpoint:  # the host buffer kept between saves is in this phase's peak
            path = os.path.join(args.checkpoint, "memory-wall")
            timed("async save",
                  lambda: distopt.save_checkpoint(path, ddp, opt, async_save=True).wait())
            _remove(path)
        if args.torch_checkpoint:  # torch's default stager: its staged copy of what it writes
            def torch_async_save() -> None:
                msd, osd = get_state_dict(ddp, opt)
                dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(
                    args.torch_checkpoint, "memory-wall-dcp-async")).result()

            timed("torch async save", torch_async_save)
            _remove(os.path.join(args.torch_checkpoint, "memory-wall-dcp-async"))
    record = {
        "num_params": num_params, "baseline": baseline, "after_setup": after_setup,
        # The phases' high-water marks: resetting them resets ru_maxrss's too.
        "after_steps": _rss_bytes(), "peak": max(phases.values()), "setup_s": setup_s,
        "step_s": times, "loss": losses, "phases": phases, "checkpoint_s": checkpoint_s,
    }
    if ddp is not None:
        import distopt

        record["state"] = distopt.measure_state_bytes(opt).as_dict()
        record["gathered_peak"] = sum(pool.peak_bytes for pool in ddp.param_pools.values())
        record["gathered_peak_buckets"] = max(pool.peak_buffers
                                              for pool in ddp.param_pools.values())
        record["grads_peak"] = sum(pool.peak_buffers * pool.buffer_bytes
                                   for pool in ddp.grad_pools.values())
        record["buckets"] = len(ddp.buckets)
        record["units"] = len(ddp.gather_units)
        record["bound"] = distopt.transient_bound(
            ddp, store_param_remainders=args.lean,
            state_dtype=torch.bfloat16 if args.lean else None,
            offload=opt.offload_tier is not None).as_dict()
        record["digest"] = _digest(ddp, opt)
        tier = opt.offload_tier
        if tier is not None:
            tier.wait()
            record["page_cache"] = None if page_cache is None else page_cache.peaks
            record["tier"] = {"reserved": tier.nbytes, "on_disk": tier.disk_bytes(),
                              "largest_chunk": max(size for _, size in tier.regions),
                              "written": tier.bytes_written, "read": tier.bytes_read}
    with open(os.path.join(tmp, f"{system}-{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)
    dist.barrier()
    os._exit(0)  # every result written: no group teardown to wait on


def _digest(ddp, opt) -> str:
    """A hash of this rank's param shards, fp32 masters and optimizer state, piece by piece
    (no whole-shard transient): equal digests, equal bits."""
    import hashlib

    import torch

    digest = hashlib.sha256()

    def add(tensor: torch.Tensor) -> None:
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())

    for buffer in ddp.flat_buffers:
        for storage in buffer.param_storage():
            add(storage)
    with torch.no_grad():
        for (_, piece, main) in opt.pieces():
            owned = opt._piece_owner[main][0]
            add(owned.main_value(main, piece))
            for key in sorted(opt.state.get(main, {})):
                value = opt.state[main][key]
                if isinstance(value, torch.Tensor):
                    add(value.reshape(-1))
    return digest.hexdigest()


def disk_baseline(directory: str, nbytes: int) -> dict[str, float]:
    """The disk's own time to write ``nbytes`` to a file in ``directory`` (and to sync it), and
    to read them back with nothing in the page cache: what the offload tier's bytes cost at
    the disk's speed, with no step beside them."""
    block = bytearray(64 << 20)
    path = os.path.join(directory, "disk-baseline.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, block[: min(len(block), nbytes - written)], written)
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        done = 0
        view = memoryview(block)
        while done < nbytes:
            got = os.preadv(fd, [view[: min(len(block), nbytes - done)]], done)
            if got <= 0:
                break
            done += got
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return {"bytes": nbytes, "write_s": write_s, "read_s": read_s}


def launch(system: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(system, args, tmp), nprocs=args.nproc, join=True)
        out = []
        for rank in range(args.nproc):
            with open(os.path.join(tmp, f"{system}-{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out


def wall_arithmetic(num_params: int, d: int, memory: dict[str, int],
                    lean: bool = False) -> list[str]:
    """What each replicated or partly sharded system needs per rank and for d ranks, from its
    bytes per parameter (fp32 params and grads, Adam's two fp32 moments; ``lean``: distopt's
    lean tier beside them)."""
    import torch

    import distopt

    fp32, bf16 = torch.float32, torch.bfloat16
    rows = [] if not lean else [
        ("distopt lean tier (sharded)",
         distopt.theoretical_bytes_per_param(bf16, bf16, d, shard_params=True,
                                             store_param_remainders=True, state_dtype=bf16)),
    ]
    rows += [
        ("torch DDP + AdamW", distopt.theoretical_bytes_per_param(fp32, fp32, d,
                                                                   distributed=False)),
        ("distopt ZeRO-1 (default)", distopt.theoretical_bytes_per_param(fp32, fp32, d)),
        ("distopt ZeRO-2 (shard_grads)",
         distopt.theoretical_bytes_per_param(fp32, fp32, d, shard_grads=True)),
        ("distopt shard_params / FSDP2",
         distopt.theoretical_bytes_per_param(fp32, fp32, d, shard_params=True)),
    ]
    lines = [f"{'system':30s} {'B/param':>8s} {'GiB/rank':>9s} {f'GiB x{d}':>8s}  fits?"]
    rows = rows[1:] + rows[:1] if lean else rows  # the lean tier last
    for name, per_param in rows:
        rank_bytes = per_param * num_params
        total = rank_bytes * d
        verdict = ("no: over the machine's memory" if total > memory["total"]
                   else "no: over what is available" if total > memory["available"]
                   else "yes")
        lines.append(f"{name:30s} {per_param:8.2f} {rank_bytes / GiB:9.2f} "
                     f"{total / GiB:8.2f}  {verdict}")
    return lines


def report(system: str, ranks: list[dict[str, Any]]) -> list[str]:
    peaks = [r["peak"] / GiB for r in ranks]
    first = ranks[0]
    phase_names = list(first["phases"])
    lines = [
        f"{system}: peak RSS per rank (GiB) {' '.join(f'{p:.2f}' for p in peaks)}; "
        f"sum {sum(peaks):.2f}",
        "  peak per phase, the highest rank (GiB): " + ", ".join(
            f"{name} {max(r['phases'][name] for r in ranks) / GiB:.2f}" for name in phase_names),
        f"  after import {first['baseline'] / GiB:.2f}, after setup "
        f"{first['after_setup'] / GiB:.2f}, after the steps {first['after_steps'] / GiB:.2f} "
        f"(rank 0, GiB); setup {max(r['setup_s'] for r in ranks):.1f} s (slowest rank)",
        "  step s (slowest rank): "
        + " ".join(f"{max(r['step_s'][i] for r in ranks):.1f}" for i in range(len(first["step_s"])))
        + f"; loss {' '.join(f'{x:.4f}' for x in first['loss'])}",
    ]
    if "torch save" in phase_names and "save" in phase_names:
        gib = {name: max(r["phases"][name] for r in ranks) / GiB for name in phase_names}
        # Each round's slowest rank, then the mean over the rounds (A B B A).
        rounds = {name: [max(r["checkpoint_s"][name][i] for r in ranks)
                         for i in range(len(times))]
                  for name, times in first["checkpoint_s"].items()}
        secs = {name: sum(times) / len(times) for name, times in rounds.items()}
        lines.append("  torch's road beside distopt's (the highest rank GiB, the slowest rank s, "
                     "the mean of the rounds: " + "; ".join(
                         f"{name} " + " ".join(f"{t:.1f}" for t in times)
                         for name, times in rounds.items()) + "):")
        lines += [
            f"    {road} {gib[f'torch {ours}']:.2f} against distopt's {ours} {gib[ours]:.2f}: "
            f"{gib[f'torch {ours}'] / gib[ours]:.3f}x; {secs[f'torch {ours}']:.1f} s against "
            f"{secs[ours]:.1f} s (distopt's {secs[ours] / secs[f'torch {ours}']:.2f}x)"
            for ours, road in (("save", "get_state_dict + dcp.save"),
                               ("load", "get_state_dict + dcp.load + set_state_dict"))]
    if "state" in first:
        state, bound = first["state"], first["bound"]
        predicted = first["baseline"] + state["total"] + bound["total"]
        worst = max(peaks) * GiB
        lines += [
            f"  distopt's state (rank 0): {state['total'] / GiB:.2f} GiB = "
            f"{state['total'] / first['num_params']:.2f} B/param; {first['units']} gather units "
            f"in {first['buckets']} buckets",
            f"  transients after the first step, measured (rank 0): gathered params "
            f"{first['gathered_peak'] / GiB:.2f} GiB ({first['gathered_peak_buckets']} buckets), "
            f"grads in flight {first['grads_peak'] / GiB:.2f} GiB",
            f"  bound (distopt.transient_bound): gathered params "
            f"{bound['gathered_params'] / GiB:.2f}, grads in flight "
            f"{bound['grads_in_flight'] / GiB:.2f}, step {bound['step'] / GiB:.2f}: "
            f"{bound['total'] / GiB:.2f} GiB",
            f"  predicted peak = import {first['baseline'] / GiB:.2f} + state "
            f"{state['total'] / GiB:.2f} + bound {bound['total'] / GiB:.2f}"
            f" = {predicted / GiB:.2f} GiB; measured {worst / GiB:.2f} GiB "
            f"({worst / predicted - 1:+.1%}); the rest is activations and the allocator",
            f"  digest of rank 0's params, masters and state: {first['digest'][:16]}",
        ]
    if "tier" in first:
        tiers = [r["tier"] for r in ranks]
        steps = max(len(first["step_s"]), 1)
        lines.append(
            f"  offload tier: {first['state']['offloaded'] / GiB:.2f} GiB reserved per rank "
            f"(rank 0), {sum(t['on_disk'] for t in tiers) / GiB:.2f} GiB on disk for "
            f"{len(ranks)} ranks; written {sum(t['written'] for t in tiers) / steps / GiB:.2f}"
            f" GiB and read {sum(t['read'] for t in tiers) / steps / GiB:.2f} GiB a step, "
            f"all ranks")
        if first.get("page_cache"):
            cache = first["page_cache"]
            lines.append(
                f"  the machine's page cache during the steps: at most "
                f"{cache['cached_above_start'] / GiB:.2f} GiB above its start, at most "
                f"{cache['dirty_or_writeback'] / GiB:.2f} GiB of it dirty or being written")
    return lines


def offload_against_memory(memory: list[dict[str, Any]], offloaded: list[dict[str, Any]],
                           directory: str) -> list[str]:
    """The offloaded step's time over the in-memory step's (the steps after the first, the
    slowest rank), beside the disk's own time for the bytes the tier moved in a step, and
    whether both runs ended on the same bits."""
    def later(ranks: list[dict[str, Any]]) -> float:
        steps = range(1, len(ranks[0]["step_s"]))
        return sum(max(r["step_s"][i] for r in ranks) for i in steps) / max(len(steps), 1)

    steps = max(len(offloaded[0]["step_s"]), 1)
    moved = sum(r["tier"]["written"] for r in offloaded) // steps
    disk = disk_baseline(directory, moved)
    t_mem, t_off = later(memory), later(offloaded)
    same = all(a["digest"] == b["digest"] for a, b in zip(memory, offloaded, strict=True))
    return [
        f"offloaded step over in-memory step (steps after the first, slowest rank): "
        f"{t_off:.1f} s / {t_mem:.1f} s = {t_off / t_mem:.2f}x; overhead {t_off - t_mem:.1f} s",
        f"the disk alone for one step's bytes ({moved / GiB:.2f} GiB, all ranks): write + sync "
        f"{disk['write_s']:.1f} s ({moved / disk['write_s'] / 1e6:.0f} MB/s), read "
        f"{disk['read_s']:.1f} s ({moved / disk['read_s'] / 1e6:.0f} MB/s): "
        f"{disk['write_s'] + disk['read_s']:.1f} s",
        f"params, masters and state bitwise equal on every rank: {same}",
    ]


def fsdp2_need(num_params: int, d: int, baseline: float) -> str:
    """What FSDP2 would hold for this model: fp32 sharded params, grads and AdamW state."""
    per_rank = 16 / d * num_params
    return (f"fsdp2 (not run): 16 B/param sharded, {per_rank / GiB:.2f} GiB of state per rank, "
            f"{(per_rank + baseline) / GiB * d:.2f} GiB for {d} ranks with the import")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=None, help="distopt's, elements")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--lean", action="store_true",
                        help="distopt's lean tier: bf16 params with remainders, bf16 grads, "
                             "bf16 AdamW state (FSDP2 is then reported, not run)")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="glibc's M_MMAP_THRESHOLD for every rank (MALLOC_MMAP_THRESHOLD_): "
                             "blocks above it are mapped and given back when freed, none left "
                             "in the heap's holes; default: glibc's own (dynamic, up to 32 MiB)")
    parser.add_argument("--offload", default=None, metavar="DIR",
                        help="distopt's offload tier in DIR (offload_dir=): the system "
                             "distopt-offload; without --systems, the only one run")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="also save and load a distopt checkpoint in DIR, measuring both")
    parser.add_argument("--torch-checkpoint", default=None, metavar="DIR",
                        help="then save and load distopt's state with torch's road in DIR "
                             "(get_state_dict + dcp.save; get_state_dict + dcp.load + "
                             "set_state_dict), measuring both")
    parser.add_argument("--async-save", action="store_true",
                        help="with --checkpoint and --torch-checkpoint, also an async save of "
                             "each road (save_checkpoint(..., async_save=True); dcp.async_save "
                             "with torch's default stager), each waited for, measured apart")
    args = parser.parse_args(argv)
    if args.offload is not None and "--systems" not in (argv or sys.argv):
        args.systems = ["distopt-offload"]
    if "distopt-offload" in args.systems and args.offload is None:
        parser.error("distopt-offload keeps its state in a directory: pass --offload DIR")

    if args.mmap_threshold is not None:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    memory = meminfo()
    with_torch = build_on_meta(args)
    num_params = sum(p.numel() for p in with_torch.parameters())
    del with_torch
    tier = "lean tier: bf16 + remainders, bf16 grads and state" if args.lean else "fp32"
    print(f"GPT: {args.layers} blocks, width {args.width}: {num_params / 1e6:.0f}M params "
          f"({tier}, AdamW); d = {args.nproc}; batch {args.batch_size} x {args.seq_len} tokens "
          f"per rank")
    print(f"machine: {memory['total'] / GiB:.1f} GiB, {memory['available'] / GiB:.1f} GiB "
          f"available at the start; {os.cpu_count()} cores")
    print("\n".join(wall_arithmetic(num_params, args.nproc, memory, lean=args.lean)))
    baseline = 0.0
    runs: dict[str, list[dict[str, Any]]] = {}
    for system in args.systems:
        if args.lean and system == "fsdp2":
            continue
        print()
        ranks = runs[system] = launch(system, args)
        baseline = ranks[0]["baseline"]
        print("\n".join(report(system, ranks)), flush=True)
    if "distopt-offload" in runs and "distopt-shard-params" in runs:
        print()
        print("\n".join(offload_against_memory(runs["distopt-shard-params"],
                                               runs["distopt-offload"], args.offload)))
    if args.lean:
        print()
        print(fsdp2_need(num_params, args.nproc, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
