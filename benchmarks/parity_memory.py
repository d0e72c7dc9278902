"""Print the parity and memory tables of the README from the test suite's own cases.

    .venv/bin/python benchmarks/parity_memory.py

Runs every case of tests/test_parity.py at d = 1, 2, 3, 4 (one spawned gloo group per d) and
prints, as markdown, the largest difference from single-process torch.optim over 20 steps and
the bytes per parameter each rank holds beside the formula of docs/design.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import distopt  # noqa: E402
from distopt.dtypes import dtype_name  # noqa: E402

from dist_harness import case_result, run_cases  # noqa: E402
from test_parity import MEMORY_ROWS, _cases  # noqa: E402

PARITY = ["fp32-adamw", "fp32-sgd", "fp32-adagrad", "fp32-adamw-zero-grads",
          "fp32-adamw-no-overlap", "bf16-fp32grads", "bf16-bf16grads", "no-sync"]


def main() -> None:
    worlds = [1, 2, 3, 4]
    results = {d: run_cases(d, _cases(d)) for d in worlds}
    print("| case | " + " | ".join(f"d={d}" for d in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for case in PARITY:
        cells = [max(v["max_diff"] for v in case_result(results[d], case)) for d in worlds]
        print(f"| {case} | " + " | ".join(f"{c:.1e}" for c in cells) + " |")
    print()
    print("| params / grads | d | measured B/param (max over ranks) | formula | padding |")
    print("|---|---|---|---|---|")
    for pd, gd in MEMORY_ROWS:
        for d in (1, 2, 4):
            values = case_result(results[d], f"memory-{pd}-{gd}")
            measured = max(v["report"].bytes_per_param for v in values)
            n = values[0]["report"].num_params
            theory = distopt.theoretical_bytes_per_param(pd, gd, d)
            print(f"| {dtype_name(pd)} / {dtype_name(gd)} | {d} | {measured:.3f} | {theory:.3f} | "
                  f"{values[0]['padded'] - n} elements |")


if __name__ == "__main__":
    main()
