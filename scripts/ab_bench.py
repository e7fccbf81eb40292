#!/usr/bin/env python3
"""Two source trees through `hicache-tiers bench`, runs alternated, every sample pooled.

This machine's memory and disk figures move by up to 2x between runs minutes
apart, so one bench run before a change and one after say little about a
change worth 10-25%.  This script runs the same `bench --only ...` from each
tree in turn (the order swapped every run), reads each run's --json, pools
the samples of each figure across runs, and prints each tree's median, the
ratio of the later trees to the first, and how many samples each median is
of.  Each tree needs its C extensions built in place (`git worktree add
../wt REV && cd ../wt && python3 -c "from setuptools import setup; setup()"
build_ext --inplace`).

    python3 scripts/ab_bench.py --trees /work/old,/work/main --only nvme,remote --page-sizes 256KiB --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="two (or more) source trees, comma-separated; the first is the base")
    p.add_argument("--only", default="dram", help="the bench parts to run, as bench --only takes them (default dram)")
    p.add_argument("--page-sizes", default="64KiB,256KiB", help="as bench --page-sizes takes them (default 64KiB,256KiB)")
    p.add_argument("--repeat", type=int, default=5, help="bench repetitions a run (default 5)")
    p.add_argument("--runs", type=int, default=3, help="runs a tree, alternated (default 3)")
    p.add_argument("--figures", default="", help="only figures whose name matches this regular expression")
    p.add_argument("--work-dir", default=None, help="scratch directory on the disk to measure (bench --work-dir)")
    args = p.parse_args(argv)
    args.tree_list = [os.path.abspath(t) for t in args.trees.split(",") if t]
    if len(args.tree_list) < 2 or not all(os.path.isdir(os.path.join(t, "tiers")) for t in args.tree_list):
        p.error("--trees needs two or more source trees (directories holding tiers/)")
    if args.repeat < 1 or args.runs < 1:
        p.error("--repeat and --runs must be positive")
    try:
        args.pattern = re.compile(args.figures)
    except re.error as exc:
        p.error(f"--figures is not a regular expression: {exc}")
    return args


def run_bench(tree: str, args, out: str) -> None:
    """One bench run from tree, its figures written to out; RuntimeError with its output's tail if it fails."""
    cmd = [sys.executable, "-m", "tiers.cli", "bench", "--only", args.only, "--page-sizes", args.page_sizes,
           "--repeat", str(args.repeat), "--quiet", "--json", out]
    if args.work_dir:
        cmd += ["--work-dir", os.path.join(args.work_dir, os.path.basename(tree))]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(out):
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"bench from {tree} exited {done.returncode}: " + " | ".join(tail))


def pooled(paths: List[str], pattern) -> Dict[str, List[float]]:
    """Every sample of every figure (name matching pattern) in these bench --json files."""
    out: Dict[str, List[float]] = {}
    for path in paths:
        with open(path) as f:
            figures = json.load(f)["figures"]
        for name, fig in figures.items():
            if pattern.search(name) and isinstance(fig, dict) and fig.get("samples"):
                out.setdefault(name, []).extend(fig["samples"])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    trees = args.tree_list  # by position: the same checkout may be given twice (an A/A run shows the spread)
    with tempfile.TemporaryDirectory(prefix="ab-bench-") as scratch:  # the runs' --json files, gone after
        return _compare(args, trees, scratch)


def _compare(args, trees: List[str], scratch: str) -> int:
    """Run every tree in turn, args.runs times, then print the pooled table; the exit status."""
    files: List[List[str]] = [[] for _ in trees]
    started = time.monotonic()
    try:
        for run in range(args.runs):
            order = list(range(len(trees)))
            if run % 2:
                order.reverse()  # neither tree always goes first
            for at in order:
                out = os.path.join(scratch, f"{run}-{at}.json")
                print(f"[{time.monotonic() - started:6.0f}s] run {run + 1}/{args.runs}: {trees[at]}", flush=True)
                run_bench(trees[at], args, out)
                files[at].append(out)
    except RuntimeError as exc:
        print(f"ab_bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ab_bench: interrupted", file=sys.stderr)
        return 130
    samples = [pooled(paths, args.pattern) for paths in files]
    names = sorted(set().union(*samples))
    labels = [f"{i + 1}: {os.path.basename(t) or t}" for i, t in enumerate(trees)]
    header = ["figure"] + labels + [f"{i + 2} x 1" for i in range(len(trees) - 1)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in names:
        meds = [statistics.median(s[name]) if s.get(name) else None for s in samples]
        cells = [f"{m:.3g} (n={len(s.get(name, []))})" if m is not None else "-" for s, m in zip(samples, meds)]
        ratios = [f"{m / meds[0]:.2f}" if m is not None and meds[0] else "-" for m in meds[1:]]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
