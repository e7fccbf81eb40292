#!/usr/bin/env python3
"""``hicache-tiers bench`` from a checkout: python scripts/bench.py --out BENCHMARKS.md --plot docs/img/bench.png"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiers.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
