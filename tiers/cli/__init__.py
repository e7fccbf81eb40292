"""The ``hicache-tiers`` command: run, operate and measure a node's KV-cache tier daemons.

Each module of COMMAND_MODULES (and of the hicache_tiers.commands entry points) exposes ``register(subparsers)``, which adds its
parsers and sets ``func`` (args -> exit code).  Exit codes: 0 success, 1 the
work failed, 2 usage or configuration error.  A command never ends in a
traceback: argparse errors, unwritable outputs and anything unexpected become
one line on stderr (HICACHE_TIERS_DEBUG=1 shows the traceback of the latter).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from typing import List, Optional

# The node's own commands; the engine side adds demo and bench by entry point (tiers/plugins.py).
COMMAND_MODULES = [
    "tiers.cli.serve",
    "tiers.cli.sglang",
    "tiers.cli.ops",
    "tiers.cli.experiments",
    "tiers.cli.plan",
    "tiers.cli.keys",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

DESCRIPTION = ("Run, operate and measure the tier daemons that give SGLang's HiCache an L3: "
               "DRAM, NVMe and remote memory pools shared by every engine on a node.")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and values such as ``-5t`` read as values, not options."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes any "-<digit>..." that is not a plain number for an option and then
        # says "expected one argument"; no option of ours starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type for counts and sizes that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def output_file(path: str) -> str:
    """An argparse type for files a command writes: refuse before the work, not after it."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {directory} is not writable")
    return path


# A daemon's start is on the path of every restart (a tier serves again only once its process is up): `serve`
# needs its own module, not the simulator, the planner and the plugins' entry points that every other command
# module imports (0.3 s of a 0.7 s start here).  Its parser is the one the full one holds.
DAEMON_COMMANDS = {"serve": "tiers.cli.serve"}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line, or (command one of DAEMON_COMMANDS) only that command's module."""
    parser = Parser(prog="hicache-tiers", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.import_module('tiers').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in DAEMON_COMMANDS:
        modules = [DAEMON_COMMANDS[command]]
    else:
        from tiers.plugins import command_modules
        modules = COMMAND_MODULES + [m for m in command_modules() if m not in COMMAND_MODULES]
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    # SGLang warns at import that AWQ/GGUF kernels need a GPU; the commands that load it
    # (demo, bench, replay --live) never quantize, so the lines are noise here.
    warnings.filterwarnings("ignore", message=r"Only CUDA, .* support", category=UserWarning)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"hicache-tiers {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file that went away, a full disk, a closed pipe: not a bug
        print(f"hicache-tiers {args.command}: {exc.strerror or exc}"
              + (f": {exc.filename}" if getattr(exc, "filename", None) else ""), file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        if os.environ.get("HICACHE_TIERS_DEBUG"):
            raise
        print(f"hicache-tiers {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(HICACHE_TIERS_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
