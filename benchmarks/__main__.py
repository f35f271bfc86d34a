"""``python -m benchmarks``: every benchmark, then benchmarks/RESULTS.md (see run_all.py)."""

import sys

from benchmarks.run_all import main

if __name__ == "__main__":
    sys.exit(main())
