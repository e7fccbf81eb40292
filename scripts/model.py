#!/usr/bin/env python3
"""Thin wrapper: `python scripts/model.py ...` is `hicache-tiers model ...`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiers.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["model", *sys.argv[1:]]))
