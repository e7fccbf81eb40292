"""The ``hicache-tiers`` command: one sub-command per module in COMMAND_MODULES.

Each module exposes ``register(subparsers)``, which adds its parsers and sets
``func`` (args -> exit code).  Exit codes: 0 success, 1 the work failed,
2 usage or configuration error.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

COMMAND_MODULES = [
    "tiers.cli_serve",
    "tiers.cli_sglang",
    "tiers.cli_ops",
    "tiers.cli_demo",
    "tiers.cli_experiments",
    "tiers.cli_keys",
    "tiers.cli_bench",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.import_module('tiers').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
