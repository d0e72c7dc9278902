"""Peak memory and time of save_checkpoint, load_checkpoint and export_checkpoint on one process.

A model of ``--params`` fp32 parameters of ``--numel`` elements each is trained one AdamW step,
so its optimizer state (two fp32 moments) is 8 bytes per element. Each operation's peak is the
resident set's high-water mark above what the process held before it (Linux: the mark is reset
through /proc/self/clear_refs), so it measures what the operation itself allocates. The script
runs itself with MALLOC_MMAP_THRESHOLD_=65536, so that glibc gives every freed block of 64 KiB
or more back to the system and no operation can hide its allocations in memory freed earlier.

    python benchmarks/checkpoint_memory.py --params 32 --numel 1048576 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024


def _measure(fn) -> tuple[float, float]:
    """(peak bytes above the resident set at the start, seconds) of ``fn()``."""
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current resident set
    before = _status("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return _status("VmHWM") - before, seconds


def _train_one_step(params: int, numel: int):
    import torch
    from torch import nn

    import distopt

    module = nn.ParameterList(
        nn.Parameter(torch.zeros(numel // 1024, 1024)) for _ in range(params)
    )
    ddp = distopt.DistributedDataParallel(module)
    opt = distopt.DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    for buf in ddp.flat_buffers:
        buf.grad_data.normal_()
    opt.step()
    return ddp, opt


def run(params: int, numel: int, root: Path) -> dict[str, float]:
    # Imported here, after main() has set the allocator up. distopt imports DCP on first use;
    # its modules are memory of the interpreter, not of any one save, so import it first.
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    import distopt

    torch.set_num_threads(1)
    ddp, opt = _train_one_step(params, numel)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values()
                      for k, v in s.items() if k != "step")
    largest = 4 * numel
    results = {"params": params, "numel": numel, "largest_param_MiB": largest / MiB,
               "optimizer_state_MiB": state_bytes / MiB}
    run_dir = root / "run"
    peak, seconds = _measure(lambda: distopt.save_checkpoint(run_dir, ddp, opt))
    results.update(save_peak_MiB=peak / MiB, save_s=seconds)
    peak, seconds = _measure(lambda: distopt.load_checkpoint(run_dir, ddp, opt))
    results.update(load_peak_MiB=peak / MiB, load_s=seconds)
    out = root / "export.pt"
    peak, seconds = _measure(lambda: distopt.export_checkpoint(run_dir, out))
    results.update(export_peak_MiB=peak / MiB, export_s=seconds,
                   checkpoint_MiB=sum(f.stat().st_size for f in (run_dir / "ckpt-000001").iterdir())
                   / MiB, export_file_MiB=out.stat().st_size / MiB)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=32)
    parser.add_argument("--numel", type=int, default=1 << 20, help="a multiple of 1024")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, __file__, *(argv or sys.argv[1:])], env)
    if not Path("/proc/self/clear_refs").exists():
        print("needs Linux's /proc/self/clear_refs to reset the peak RSS", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = run(args.params, args.numel, Path(tmp))
    print(f"{args.params} fp32 params of {args.numel} elements; AdamW state "
          f"{results['optimizer_state_MiB']:.0f} MiB; largest param "
          f"{results['largest_param_MiB']:.0f} MiB")
    print(f"{'operation':<10} {'peak above start (MiB)':>24} {'seconds':>9}")
    for op in ("save", "load", "export"):
        print(f"{op:<10} {results[op + '_peak_MiB']:>24.1f} {results[op + '_s']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
