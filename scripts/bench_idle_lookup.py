#!/usr/bin/env python3
"""A prefix lookup after the node went idle, per tier kind, beside a bare ZeroMQ round trip after the same idle.

`hicache-tiers bench --only lookup` times lookups back to back. A serving
engine's lookup mostly comes after a pause (a new request), and on a machine
whose CPUs sleep when idle every hop to a process that went idle pays its
wake-up (docs/PERFORMANCE.md, session 36). This script writes --pages pages to
a one-tier node of each --kinds, then times --calls `batch_exists` calls
through the real backend, each after --idle-ms of sleep, and as many bare
ZeroMQ ipc round trips after the same sleep; medians in ms.

    python3 scripts/bench_idle_lookup.py --kinds dram,nvme,remote --idle-ms 0,50
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("dram", "nvme", "remote")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="dram,nvme,remote", help="tier kinds, comma-separated (default all three)")
    parser.add_argument("--idle-ms", default="0,50", help="sleeps before each call, comma-separated (default 0,50)")
    parser.add_argument("--pages", type=int, default=32, help="keys a lookup (default 32: a 512-token prompt)")
    parser.add_argument("--page-kib", type=int, default=128, help="page size in KiB (default 128: the TTFT model's)")
    parser.add_argument("--calls", type=int, default=100, help="timed calls a point (default 100)")
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown tier kind(s) {', '.join(unknown)}: pick from {', '.join(KINDS)}")
    try:
        args.idle_ms = [float(v) for v in args.idle_ms.split(",") if v]
    except ValueError:
        parser.error(f"--idle-ms takes numbers, comma-separated, not {args.idle_ms!r}")
    if args.pages < 1 or args.page_kib < 1 or args.calls < 1 or any(v < 0 for v in args.idle_ms):
        parser.error("--pages, --page-kib and --calls must be positive, --idle-ms not negative")
    return args


def _median_ms(call, idle_s: float, calls: int) -> float:
    times = []
    for _ in range(calls):
        time.sleep(idle_s)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lookups(kind: str, args, work: str) -> dict:
    """Median lookup ms after each idle, on a fresh one-tier node of kind."""
    from hicache_ext.lab.bench.rig import Node, Rank, node_toml, tier_toml
    from tiers.stores.remote.loopback import free_ports, pool_config
    page = args.page_kib << 10
    pool = port = None
    if kind == "remote":
        (port,) = free_ports(1)
        capacity = f"{max(64, 4 * args.pages * args.page_kib >> 10)}MiB"
        pool = Node(os.path.join(work, "pool"), pool_config([port], capacity=capacity, block_size="64KiB",
                                                            max_page_bytes=f"{max(1, page >> 20)}MiB"))
    node = Node(os.path.join(work, kind), node_toml([tier_toml(kind, 2 * args.pages * page, page, pool_port=port)]))
    try:
        rank = Rank.tiered(node, page, args.pages)
        keys = rank.keys(1)
        if rank.write(keys) != args.pages:
            raise SystemExit(f"{kind}: could not store the pages to look up")

        def lookup():
            if rank.backend.batch_exists(keys) != args.pages:
                raise SystemExit(f"{kind}: a lookup did not find every page")
        out = {idle: _median_ms(lookup, idle / 1e3, args.calls) for idle in args.idle_ms}
        rank.close()
        return out
    finally:
        node.close()
        if pool is not None:
            pool.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    from tiers.bench import limits
    with tempfile.TemporaryDirectory(prefix="hicache-idle-lookup-") as work:
        echo = limits.EchoServer(f"ipc://{os.path.join(work, 'echo.sock')}")
        try:
            rows = {"bare round trip": {idle: _median_ms(echo.round_trip, idle / 1e3, args.calls)
                                        for idle in args.idle_ms}}
        finally:
            echo.close()
        for kind in args.kinds:
            rows[f"{kind}, {args.pages} keys"] = lookups(kind, args, work)
    print("median ms after idle: " + ", ".join(f"{idle:g} ms" for idle in args.idle_ms))
    for name, figures in rows.items():
        print(f"{name:>24}: " + ", ".join(f"{figures[idle]:.3f}" for idle in args.idle_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
