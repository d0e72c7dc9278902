"""Side-by-side benchmark: distopt against DDP, ZeroRedundancyOptimizer and FSDP2.

The same as ``distopt bench``; see benchmarks/README.md for the results and how to read them.

    python benchmarks/compare.py --nproc 2 4 --model gpt mlp --out benchmarks/results
"""

import sys

from distopt.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
