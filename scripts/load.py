#!/usr/bin/env python3
"""Load: eight clients of mixed lookups, reads and writes against a node's DRAM and NVMe daemons.

Each client is a process with its own host pool (a memfd registered with both
daemons, as an engine's is) and a working set larger than the tiers, so pages
are evicted all along.  Per operation: a batch of 8 pages of 32 KiB; 50 %
lookups, 30 % reads, 20 % writes; 3 in 4 operations go to the DRAM tier.  Reads
are checked (a page's bytes are derived from its key).  Every second this
process samples completed operations and each daemon's private resident
memory (VmRSS less RssShmem: the arenas are memfds the configuration bounds).

Reported (``--json``): operations per second over time, latency percentiles
per operation, each daemon's private resident memory over time, and the leak check:
RSS after warm-up (the first quarter) against the end (must grow less than
``--rss-slack-mib``).  ``--plot PNG`` draws both series (needs matplotlib).

    python scripts/load.py --seconds 60 --json load.json --plot load.png
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sys
import tempfile
import time
from multiprocessing import get_context
from typing import Dict, List
from tiers.bench.stats import percentile  # noqa: E402  (q in 0..100, nearest rank)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PAGE = 32 << 10
BATCH = 8
POOL = 4 * BATCH * PAGE  # a client's host pool: write slots, read slots


def node_config() -> str:
    return """
[node]
write_policy = "write_through"

[[tiers]]
name = "dram"
kind = "dram"
capacity = "64MiB"
block_size = "32KiB"
max_page_bytes = "1MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "128MiB"
max_page_bytes = "1MiB"
fsync = false
"""


def content(key: str) -> bytes:
    """A page's bytes, derived from its key (8 bytes of its hash, repeated)."""
    seed = random.Random(key).getrandbits(64).to_bytes(8, "little")
    return seed * (PAGE // 8)


def client_main(index: int, endpoints: Dict[str, str], keys_per_client: int, until: float, seed: int, conn) -> None:
    from tiers.wire import protocol as P
    from tiers.shm.buffers import address_of
    from tiers.wire.client import Deadlines, TierClient

    rng = random.Random(seed * 1000 + index)
    fd = os.memfd_create(f"load-{index}")
    os.ftruncate(fd, POOL)
    pool = mmap.mmap(fd, POOL)
    clients = {name: TierClient(name, ep, f"load-{index % 4}", f"load{index}", Deadlines(), attach=True)
               for name, ep in endpoints.items()}
    for client in clients.values():
        client.attach_region(fd, POOL)
    ops: List[tuple] = []  # (end time, op, ok, seconds)
    wrong = 0
    write_desc = P.encode_descriptors([[(i * PAGE, PAGE)] for i in range(BATCH)])
    while time.time() < until:
        client = clients["dram"] if rng.random() < 0.75 or "nvme" not in clients else clients["nvme"]
        first = rng.randrange(keys_per_client - BATCH)
        keys = [f"c{index}-{first + i}" for i in range(BATCH)]
        roll = rng.random()
        started = time.perf_counter()
        if roll < 0.5:
            op = "lookup"
            ok = client.lookup(keys) is not None
        elif roll < 0.8:
            op = "read"
            if client.can_lease():
                base = address_of(memoryview(pool))
                found = client.get_leased(keys, [[(base + (BATCH + i) * PAGE, PAGE)] for i in range(BATCH)])
                pages = [pool[(BATCH + i) * PAGE:(BATCH + i + 1) * PAGE] for i in range(BATCH)]
            else:
                found, frames = client.get_frames(keys, BATCH * PAGE)
                it = iter(frames)
                pages = [next(it).bytes if f else b"" for f in found]
            wrong += sum(1 for k, f, p in zip(keys, found, pages) if f and p != content(k))
            ok = True
        else:
            op = "write"
            for i, key in enumerate(keys):
                pool[i * PAGE:(i + 1) * PAGE] = content(key)
            if client.region_id is not None:
                stored = client.put_region(keys, *write_desc, BATCH * PAGE)
            else:
                stored = client.put_frames(keys, [[pool[i * PAGE:(i + 1) * PAGE]] for i in range(BATCH)], BATCH * PAGE)
            ok = all(stored)
        ops.append((time.time(), op, ok, time.perf_counter() - started))
        if len(ops) >= 200:
            conn.send(("ops", ops))
            ops = []
    conn.send(("ops", ops))
    conn.send(("end", wrong))
    for client in clients.values():
        client.close()
    conn.close()
    os._exit(0)


def vm_rss(pid: int) -> int:
    """A daemon's private resident memory: VmRSS less its shared memory (RssShmem).

    The DRAM arena and the staging arena are memfds, faulted in at start or in the background
    after it: memory the configuration bounds, not a leak.  A leak grows the heap.
    """
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "RssShmem:")):
                    name, value = line.split()[:2]
                    fields[name] = int(value) * 1024
    except OSError:
        pass
    return fields.get("VmRSS:", 0) - fields.get("RssShmem:", 0)


def run(args) -> dict:
    from tiers.ops.node_runner import NodeRunner

    work = args.workdir or tempfile.mkdtemp(prefix="hicache-load-")
    runner = NodeRunner(node_config(), os.path.join(work, "run"), os.path.join(work, "data"))
    runner.start()  # stops what it started if it fails
    pipes, procs = [], []
    try:
        endpoints = {t.name: t.endpoint for t in runner.config.tiers}
        pids = {name: runner.pid(name) for name in endpoints}
        ctx = get_context("fork")
        started = time.time() + 1.0  # the clients start together
        until = started + args.seconds
        for i in range(args.clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(i, endpoints, args.keys, until, args.seed, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        ops: List[tuple] = []
        wrong = 0
        rss: Dict[str, List[int]] = {name: [] for name in pids}
        ended = 0
        finished = set()
        next_sample = started
        while ended < len(pipes):
            now = time.time()
            if now >= next_sample and now <= until + 1:
                for name, pid in pids.items():
                    rss[name].append(vm_rss(pid))
                next_sample += 1.0
            for i, pipe in enumerate(pipes):
                while i not in finished and pipe.poll(0):
                    try:
                        kind, payload = pipe.recv()
                    except EOFError:
                        raise RuntimeError(f"client {i} exited early (exit codes {[p.exitcode for p in procs]})") from None
                    if kind == "ops":
                        ops.extend(payload)
                    else:
                        wrong += payload
                        finished.add(i)
                        ended += 1
            time.sleep(0.02)
        for proc in procs:
            proc.join(10)
        stats = {name: c for name, c in ((t.name, _stats(t.endpoint)) for t in runner.config.tiers)}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        runner.stop()
    return summarize(args, ops, rss, wrong, started, stats)


def _stats(endpoint: str) -> dict:
    from tiers.wire.client import TierClient
    client = TierClient("stats", endpoint, "_admin", "load")
    try:
        stats = client.stats() or {}
        return {k: stats.get(k) for k in ("pages", "used_bytes", "evictions", "hits", "misses", "sessions")}
    finally:
        client.close()


def summarize(args, ops, rss, wrong, started, stats) -> dict:
    seconds = int(args.seconds)
    per_second = [0] * seconds
    failed = 0
    for end, _op, ok, _took in ops:
        i = int(end - started)
        if 0 <= i < seconds:
            per_second[i] += 1
        failed += not ok
    latency = {}
    for op in ("lookup", "read", "write"):
        took = [t * 1000 for _e, o, _ok, t in ops if o == op]
        latency[op] = {"count": len(took), "p50_ms": round(percentile(took, 50), 2) if took else 0.0,
                       "p99_ms": round(percentile(took, 99), 2) if took else 0.0,
                       "max_ms": round(max(took, default=0), 2)}
    warm = max(1, len(next(iter(rss.values()))) // 4)
    growth = {name: (series[-1] - series[warm]) if len(series) > warm else 0 for name, series in rss.items()}
    summary = {
        "clients": args.clients, "seconds": args.seconds, "ops": len(ops), "failed_ops": failed,
        "ops_per_second": per_second, "ops_per_second_mean": round(len(ops) / max(args.seconds, 1e-9), 1),
        "latency": latency, "wrong_pages": wrong,
        "rss_mib": {name: [round(v / (1 << 20), 1) for v in series] for name, series in rss.items()},
        "rss_growth_after_warmup_mib": {name: round(v / (1 << 20), 1) for name, v in growth.items()},
        "rss_slack_mib": args.rss_slack_mib, "tier_stats": stats,
    }
    summary["leak"] = any(v > args.rss_slack_mib * (1 << 20) for v in growth.values())
    summary["ok"] = not summary["leak"] and wrong == 0 and len(ops) > 0
    return summary


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(summary["ops_per_second"])
    a.set_ylabel("operations / s")
    a.set_title(f"{summary['clients']} clients, batches of {BATCH} x {PAGE >> 10} KiB pages")
    for name, series in summary["rss_mib"].items():
        b.plot(series, label=name)
    b.set_ylabel("daemon private RSS (MiB)")
    b.set_xlabel("seconds")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--keys", type=int, default=2000, help="keys a client cycles through (its working set)")
    parser.add_argument("--rss-slack-mib", type=float, default=16.0, help="RSS growth after warm-up that counts as a leak")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args(argv)
    summary = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    if args.plot:
        plot(summary, args.plot)
    brief = {k: v for k, v in summary.items() if k not in ("rss_mib",)}
    print(json.dumps(brief))
    print("ok" if summary["ok"] else "FAILED")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
