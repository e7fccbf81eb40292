"""Prefix-lookup latency through the real backend (``batch_exists``), with the ZeroMQ round trip under it."""
from __future__ import annotations

import os
import threading
import time

from hicache_ext.lab.bench.rig import MiB, Node, Rank, node_toml, tier_toml
from tiers.bench import limits
from tiers.bench.stats import Figures, Progress, percentile

KEY_COUNTS = (1, 128, 1024)


def run_lookup(figs: Figures, args, progress: Progress, calls: int = 1000) -> None:
    """p50/p99 of batch_exists for 1, 128 and 1,024 held keys on a DRAM tier over an ipc socket."""
    node = Node(os.path.join(args.work_dir, "lookup"), node_toml([tier_toml("dram", 16 * 8 * MiB, 8 * MiB)]))
    try:
        rank = Rank.tiered(node, MiB, max(KEY_COUNTS), tiny=True)
        keys = rank.keys(11)
        if rank.write(keys) != len(keys):
            figs.failures.append("lookup: could not store the pages to look up")
            return
        calls = max(20, calls // (10 if args.quick else 1))
        progress.step(f"lookup: {', '.join(map(str, KEY_COUNTS))} keys, {calls} calls each, interleaved")
        # The machine's own round trip, sampled between the lookups: the floor they stand on.
        echo = limits.EchoServer(f"ipc://{os.path.join(args.work_dir, 'lookup-echo.sock')}")
        try:
            if not _latencies(figs, rank, {f"lookup.{n}": keys[:n] for n in KEY_COUNTS}, calls, echo):
                return
        finally:
            echo.close()
        # The same 128-key lookup while another rank writes 8 MiB pages to the same daemon.
        busy = Rank.tiered(node, 8 * MiB, 4 if args.quick else 16)
        stop = threading.Event()

        def writer():
            salt = 0
            while not stop.is_set():
                salt += 1
                busy.write(busy.keys(20000 + salt))
                busy.clear()
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            progress.step("lookup: 128 keys while 8 MiB pages are written")
            _latencies(figs, rank, {"lookup.128.busy": keys[:128]}, calls)
        finally:
            stop.set()
            thread.join()
            busy.close()
        rank.close()
    finally:
        node.close()


def _latencies(figs: Figures, rank: Rank, batches: dict, calls: int, echo=None) -> bool:
    """p50 and p99 of batch_exists for each named batch, calls calls each, taken in turn so all see
    the same machine (with echo: a bare ZeroMQ round trip in each turn too); False on a wrong answer."""
    samples = {name: [] for name in batches}
    if echo is not None:
        samples["lookup.zmq_rtt"] = rtt = []
    for _ in range(20):
        for batch in batches.values():
            rank.backend.batch_exists(batch)
    for _ in range(calls):
        if echo is not None:
            rtt.append(echo.round_trip())
        for name, batch in batches.items():
            start = time.perf_counter()
            hits = rank.backend.batch_exists(batch)
            samples[name].append(time.perf_counter() - start)
            if hits != len(batch):
                figs.failures.append(f"{name}: {hits} of {len(batch)} keys found")
                return False
    for name, values in samples.items():
        figs.set(f"{name}.p50", percentile(values, 50) * 1e6, "us")
        figs.set(f"{name}.p99", percentile(values, 99) * 1e6, "us")
    return True

