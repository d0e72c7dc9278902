"""Peak memory of ``distopt convert`` on a DeepSpeed ZeRO-2 checkpoint, against the model's
fp32 size.

DeepSpeed (the ``peers`` extra, on its CPU accelerator over gloo) trains a stack of
``--layers`` square ``Linear(--width, --width)`` layers one AdamW step at d = 2 and saves with
``engine.save_checkpoint``; then ``distopt convert`` runs in a process of its own, whose peak
resident set (``ru_maxrss`` of that process alone, from ``os.wait4``) is reported beside the
model's fp32 bytes and the size of the files it read. The conversion holds one output tensor
at a time, read from the rank files with positioned reads, so its peak is the interpreter and
torch plus about two of the largest param.

    python benchmarks/convert_memory.py --layers 12 --width 5120 --dir /tmp/convert-bench
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MiB = 2**20


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _save(rank: int, layers: int, width: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from distopt.bench.peers import import_deepspeed

    deepspeed = import_deepspeed()
    deepspeed.init_distributed("gloo")
    model = _model(layers, width)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "gradient_clipping": 0.0, "steps_per_print": 2**31}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.backward(engine(torch.randn(1, width)).square().mean())
    engine.step()
    engine.save_checkpoint(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=5120)
    parser.add_argument("--dir", default="/tmp/convert-bench",
                        help="where the DeepSpeed checkpoint and the conversion are written")
    parser.add_argument("--port", type=int, default=29655)
    args = parser.parse_args()
    root = Path(args.dir)
    source, dst = root / "deepspeed", root / "converted"
    params = args.layers * (args.width * args.width + args.width)
    if not (source / "latest").exists():
        start = time.perf_counter()
        mp.spawn(_save, args=(args.layers, args.width, str(source), args.port), nprocs=2)
        print(f"DeepSpeed ZeRO-2 at d = 2 saved in {time.perf_counter() - start:.0f} s")
    read = sum(f.stat().st_size for f in source.rglob("*.pt"))
    if dst.exists():
        import shutil

        shutil.rmtree(dst)
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "distopt", "convert", str(source),
                                str(dst)])
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        sys.exit(f"distopt convert failed (status {status})")
    peak = usage.ru_maxrss * 1024  # kB on Linux
    written = sum(f.stat().st_size for f in dst.iterdir())
    print(f"model: {params / 1e6:.1f}M params, fp32 size {params * 4 / MiB:.0f} MiB; "
          f"largest param {args.width * args.width * 4 / MiB:.0f} MiB")
    print(f"read {read / MiB:.0f} MiB of DeepSpeed files, wrote {written / MiB:.0f} MiB")
    print(f"distopt convert: peak RSS {peak / MiB:.0f} MiB "
          f"({peak / (params * 4):.2f}x the fp32 model), {seconds:.1f} s")


if __name__ == "__main__":
    main()
