"""Host overhead of step() + zero_grad(): distopt against torch.optim.AdamW(foreach=True).

The same as ``distopt bench --host-overhead``; see benchmarks/README.md.

    python benchmarks/host_overhead.py --out benchmarks/results
"""

import sys

from distopt.bench import main

if __name__ == "__main__":
    sys.exit(main(["--host-overhead", *sys.argv[1:]]))
