#!/usr/bin/env python3
"""SGLang's own floor for a DRAM-tier batch, beside this project's DRAM tier, against memcpy, in one run.

The DRAM targets of issue 28 (0.7x memcpy at 64 KiB pages, 0.8x at 256 KiB)
ask what fraction of a memcpy of the batch a backup or a prefetch through
SGLang's page functions reaches.  This script measures, in the same loop and
on the same host pool: memcpy of the batch (one core, page by page, as the
bench's limit); SGLang's page functions driving a backend that keeps the keys
and moves no byte (what SGLang's own machinery costs); the same functions
driving an in-process backend that keeps pages in a dict of the engine's own
process (no daemon, no wire, no checksum: one copy of the batch on one core,
as the bench's DRAM part samples it: dram_floor); and the same functions
driving this project's backend and a one-tier DRAM node.  Medians of
--repeat batches, as ratios to the memcpy measured beside them.

    python3 scripts/bench_dram_floor.py --page-kib 64,256 --pages 128 --repeat 15
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", default="64,256", help="page sizes in KiB, comma-separated (default 64,256)")
    parser.add_argument("--pages", type=int, default=128, help="pages a batch (default 128, the bench's)")
    parser.add_argument("--repeat", type=int, default=15, help="batches timed a page size and path (default 15)")
    return parser.parse_args(argv)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(rank, memcpy, pages: int, repeat: int, salt: int, check: bool = True) -> dict:
    """Median seconds of a write and a read of the batch, and of memcpy sampled beside each; check: the read
    must give back every page's bytes (a backend that moves none cannot)."""
    writes, reads, copies = [], [], []
    for rep in range(repeat):
        keys = rank.keys(salt + rep)
        copies.append(memcpy.sample(pages))
        writes.append(timed(lambda: rank.write(keys)))
        rank.zero()
        copies.append(memcpy.sample(pages))
        got = {}
        reads.append(timed(lambda: got.setdefault("n", rank.read(keys))))
        if got["n"] != pages or (check and rank.wrong_pages(got["n"])):
            raise SystemExit(f"a read returned {got['n']} of {pages} pages or wrong bytes")
        rank.clear()
    return {"write": statistics.median(writes), "read": statistics.median(reads),
            "memcpy_gbps": statistics.median(copies)}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from hicache_ext.lab.bench import memory_backend
        from hicache_ext.lab.bench.rig import Node, Rank, node_toml, tier_toml
        from tiers.bench import limits
    except ImportError as exc:
        print(f"bench_dram_floor: needs the engine side installed (scripts/install.sh): {exc}", file=sys.stderr)
        return 2
    sizes = [int(s) << 10 for s in args.page_kib.split(",") if s.strip()]
    print(f"{args.pages} pages a batch, medians of {args.repeat}; x memcpy: GB/s over one core's memcpy of the "
          "batch sampled beside it")
    print("| page | path | write ms | read ms | write x memcpy | read x memcpy |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="dram-floor-") as work:
        for size in sizes:
            memcpy = limits.Memcpy(size)
            nbytes = args.pages * size
            floor = Rank("dynamic", size, args.pages, memory_backend.extra_config())
            bare = Rank("dynamic", size, args.pages, memory_backend.extra_config(copies=False))
            node = Node(os.path.join(work, f"node{size}"), node_toml([tier_toml("dram", nbytes, size)]))
            try:
                tiered = Rank.tiered(node, size, args.pages)
                tiered.write(tiered.keys(1))  # connections, registration, first touches: not timed
                tiered.clear()
                for name, rank, salt in (("SGLang's page functions alone (a backend that moves no byte)", bare, 50),
                                         ("SGLang's floor (in-process dict, one copy on one core)", floor, 100),
                                         ("this project (DRAM tier)", tiered, 200)):
                    got = measure(rank, memcpy, args.pages, args.repeat, salt, check=rank is not bare)
                    gbps = got["memcpy_gbps"]
                    print(f"| {size >> 10} KiB | {name} | {got['write'] * 1e3:.2f} | {got['read'] * 1e3:.2f} | "
                          f"{nbytes / got['write'] / 1e9 / gbps:.2f} | {nbytes / got['read'] / 1e9 / gbps:.2f} |",
                          flush=True)
                tiered.close()
            finally:
                node.close()
                floor.close()
                bare.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
