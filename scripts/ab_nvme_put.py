#!/usr/bin/env python3
"""Two versions of the NVMe tier's daemon, paired: the same engine's puts alternated between them.

This machine's disk moved by up to 1.8x between samples a minute apart, so a
before-and-after of two bench runs says little about a change worth 10%.
This script starts one node a source tree given (--trees: two checkouts, the
daemons import `tiers` from each), one rank of SGLang's real host pool and
backend on each, and per round writes a fresh batch through each (in turn,
the order swapped every round) after the raw limit of `hicache-tiers bench`
(one file and one fdatasync for the batch). It prints each tree's median
GB/s and its ratio to the limit's median, and the median of each tree's rate over the first tree's in
the same round.  Each tree needs its C extensions
built in place (`git worktree add ../wt && cd ../wt && python3 -c "from
setuptools import setup; setup()" build_ext --inplace`).

    python3 scripts/ab_nvme_put.py --trees /work/main,/work/wt --page-kib 64,256,1024 --rounds 10
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="two (or more) source trees, comma-separated: their daemons")
    p.add_argument("--page-kib", default="64,256,1024", help="page sizes in KiB, comma-separated (default 64,256,1024)")
    p.add_argument("--pages", type=int, default=128, help="pages a put (default 128, the bench's batch)")
    p.add_argument("--rounds", type=int, default=10, help="puts a tree a page size; figures are medians (default 10)")
    p.add_argument("--work-dir", default="/var/tmp", help="a directory on the disk to measure (default /var/tmp)")
    args = p.parse_args(argv)
    args.tree_list = [t for t in args.trees.split(",") if t]
    if len(args.tree_list) < 2 or not all(os.path.isdir(os.path.join(t, "tiers")) for t in args.tree_list):
        p.error("--trees: two or more directories that each hold a tiers/ package")
    try:
        args.sizes = [int(s) << 10 for s in args.page_kib.split(",")]
    except ValueError:
        p.error(f"--page-kib: KiB numbers separated by commas, got {args.page_kib!r}")
    if args.pages < 1 or args.rounds < 1 or any(s < 4096 or s % 4096 for s in args.sizes):
        p.error("--pages and --rounds >= 1; page sizes multiples of 4 KiB")
    return args


def paired(args, size: int, root: str) -> str:
    from hicache_ext.lab.bench.project import settle
    from hicache_ext.lab.bench.rig import Node, Rank, node_toml, tier_toml
    from tiers.bench import limits
    nodes, ranks = [], []
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONSAFEPATH")}
    try:
        for k, tree in enumerate(args.tree_list):
            # The daemons' tiers from the tree: `python -m` puts the working directory first on sys.path,
            # ahead of PYTHONPATH, unless PYTHONSAFEPATH is set (without it every tree ran this one's code).
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, saved["PYTHONPATH"]]))
            os.environ["PYTHONSAFEPATH"] = "1"
            nodes.append(Node(os.path.join(root, f"node{k}"),
                              node_toml([tier_toml("nvme", 4 * args.pages * size, size)])))
            check_tree(nodes[-1], tree)
            ranks.append(Rank.tiered(nodes[-1], size, args.pages))
            ranks[-1].write(ranks[-1].keys(99))  # connections, registration: not timed
            ranks[-1].clear()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    disk = limits.RawDisk(os.path.join(root, "raw"), size)
    rates = [[] for _ in ranks]
    limit = []
    try:
        for rnd in range(args.rounds):
            print(f"  {size >> 10} KiB: round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
            limit.append(disk.write_batch(args.pages))
            order = list(range(len(ranks)))
            for k in (order if rnd % 2 == 0 else order[::-1]):
                keys = ranks[k].keys(1000 + rnd)
                settle()
                began = time.perf_counter()
                written = ranks[k].write(keys)
                seconds = time.perf_counter() - began
                if written != args.pages:
                    raise SystemExit(f"{args.tree_list[k]}: wrote {written} of {args.pages} pages")
                rates[k].append(args.pages * size / seconds / 1e9)
                ranks[k].clear()
    finally:
        disk.clean(args.pages)
        for rank in ranks:
            rank.close()
        for node in nodes:
            node.close()
    lim = statistics.median(limit)
    cells = [f"{tree}: {statistics.median(r):.2f} GB/s ({statistics.median(r) / lim:.2f}x)"
             for tree, r in zip(args.tree_list, rates)]
    # The disk drifts between rounds more than most changes are worth: each tree's rate over the first
    # tree's in the same round (the two puts seconds apart), the median of those and its spread.
    for tree, r in list(zip(args.tree_list, rates))[1:]:
        paired = sorted(b / a for a, b in zip(rates[0], r))
        cells.append(f"{tree} / {args.tree_list[0]} in the same round: {statistics.median(paired):.2f}x "
                     f"({paired[len(paired) // 4]:.2f}-{paired[(3 * len(paired)) // 4]:.2f} between quartiles)")
    return f"{size >> 10} KiB pages, {args.pages} a put: limit {lim:.2f} GB/s; " + "; ".join(cells)


def check_tree(node, tree: str) -> None:
    """The daemon runs the tree's code: its C extension is mapped from the tree (SystemExit if not)."""
    pid = node.runner.pid("nvme")
    with open(f"/proc/{pid}/maps") as fh:
        mapped = {line.split()[-1] for line in fh if "_chunkscan" in line}
    want = os.path.realpath(tree)
    if not any(os.path.realpath(path).startswith(want + os.sep) for path in mapped):
        raise SystemExit(f"the daemon meant to run {tree} runs {sorted(mapped) or 'no tiers extension'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    root = tempfile.mkdtemp(dir=args.work_dir, prefix="ab-nvme-put-")
    try:
        for size in args.sizes:
            print(paired(args, size, os.path.join(root, f"{size >> 10}k")), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
