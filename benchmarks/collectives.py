"""distopt's reduce-scatter and all-gather against the backend's own collectives.

The same as ``distopt bench --collectives``; see benchmarks/README.md.

    python benchmarks/collectives.py --nproc 2 4 --out benchmarks/results
"""

import sys

from distopt.bench import main

if __name__ == "__main__":
    sys.exit(main(["--collectives", *sys.argv[1:]]))
