#!/usr/bin/env python3
"""The remote tier against the raw Mooncake Transfer Engine, same bytes, same processes, same run.

A pool daemon runs as a real process (``hicache-tiers serve``, TCP loopback).
This process is the inference node: it holds an engine, a host-pool buffer
registered with it, and a RemoteStore.  Per repetition, interleaved:
- raw write / read: the engine alone moves the batch of pages between the
  host buffer and arena addresses the pool granted once (no control
  messages), both with the engine's own blocking batch call
  (batch_transfer_sync_*) and with every page submitted at once and polled as
  the tier polls; the better of the two is the baseline;
- tier write / read: RemoteStore.put_many / get_many_into of the same pages,
  the path the tier daemon takes for a batch (one alloc, all transfers, one
  commit a pool; one locate, all transfers), and page by page (put / get_into).
Then end to end: a remote tier daemon process serving an engine-side client
whose host pool is a memfd (put_region / get_region), against the same
baseline.  Prints medians over repetitions and tier/raw.

    python scripts/bench_remote.py --page-mib 8 --pages 8 --runs 7 --json out.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiers import protocol as P  # noqa: E402
from tiers.client import Deadlines, TierClient  # noqa: E402
from tiers.node_runner import NodeRunner  # noqa: E402
from tiers.remote.engine import Engine, EngineConfig, address_of  # noqa: E402
from tiers.remote.loopback import free_ports, pool_config, remote_node_config  # noqa: E402
from tiers.remote.pool_client import PoolClient  # noqa: E402
from tiers.remote.store import RemoteStore  # noqa: E402


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-mib", type=int, default=8)
    ap.add_argument("--pages", type=int, default=8, help="pages per repetition")
    ap.add_argument("--runs", type=int, default=7, help="repetitions (medians are reported)")
    ap.add_argument("--no-daemon", action="store_true", help="skip the end-to-end remote tier daemon run")
    ap.add_argument("--json", metavar="FILE", help="write the figures here too")
    args = ap.parse_args(argv)
    size = args.page_mib << 20
    total = size * args.pages
    tmp = tempfile.mkdtemp(prefix="bench-remote-")
    (port,) = free_ports(1)
    pools = NodeRunner(pool_config([port], capacity=f"{3 * total >> 20}MiB", block_size="1MiB",
                                   max_page_bytes=f"{args.page_mib}MiB"),
                       os.path.join(tmp, "pool", "run"), os.path.join(tmp, "pool", "data"))
    pools.start()
    results = {"page_bytes": size, "pages": args.pages, "runs": args.runs}
    try:
        results.update(in_process(port, size, args))
        if not args.no_daemon:
            results.update(end_to_end(tmp, port, size, args))
    finally:
        pools.stop()
    base_w = max(results["raw_sync_write_gbps"], results["raw_poll_write_gbps"])
    base_r = max(results["raw_sync_read_gbps"], results["raw_poll_read_gbps"])
    for op, base in (("write", base_w), ("read", base_r)):
        results[f"tier_{op}_ratio"] = results[f"tier_{op}_gbps"] / base
        results[f"tier1_{op}_ratio"] = results[f"tier1_{op}_gbps"] / base
    if "daemon_write_gbps" in results:
        results["daemon_write_ratio"] = results["daemon_write_gbps"] / base_w
        results["daemon_read_ratio"] = results["daemon_read_gbps"] / base_r
    print(f"{args.pages} pages of {args.page_mib} MiB, medians of {args.runs} runs (GB/s):")
    for op in ("write", "read"):
        line = (f"  {op:5s}  raw sync {results[f'raw_sync_{op}_gbps']:.2f}  raw poll {results[f'raw_poll_{op}_gbps']:.2f}"
                f"  tier {results[f'tier_{op}_gbps']:.2f} ({results[f'tier_{op}_ratio']:.2f}x raw)"
                f"  tier page by page {results[f'tier1_{op}_gbps']:.2f} ({results[f'tier1_{op}_ratio']:.2f}x)")
        if f"daemon_{op}_gbps" in results:
            line += f"  via daemon {results[f'daemon_{op}_gbps']:.2f} ({results[f'daemon_{op}_ratio']:.2f}x raw)"
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


def in_process(port: int, size: int, args) -> dict:
    """Raw engine and RemoteStore in this process against the pool daemon."""
    endpoint = f"tcp://127.0.0.1:{port}"
    engine = Engine(EngineConfig(hostname="127.0.0.1"))
    store = RemoteStore([endpoint], engine, max_page_bytes=size, pool_timeout=1.0, staging_slots=1)
    host = mmap.mmap(-1, 2 * size * args.pages)
    view = memoryview(host)
    view[:] = np.random.default_rng(1).integers(0, 256, len(view), dtype=np.uint8).tobytes()
    store.region_mapped(view)
    src = [view[i * size:(i + 1) * size] for i in range(args.pages)]
    dst = [view[(args.pages + i) * size:(args.pages + i + 1) * size] for i in range(args.pages)]
    # Arena addresses for the raw engine: granted once, kept reserved for the whole run.
    control = PoolClient(endpoint, "bench-raw", timeout=1.0, retry_max=1.0)
    grant = control.alloc([f"raw-{i}" for i in range(args.pages)], [size] * args.pages, [None] * args.pages,
                          ttl=600.0)
    if grant is None or any(e is None for e in grant.extents):
        raise SystemExit("the pool did not grant room for the raw transfers")
    te = engine.raw()
    remote = [e[0][0] for e in grant.extents]  # a fresh arena: one contiguous extent a page
    if any(len(e) != 1 for e in grant.extents):
        raise SystemExit("raw baseline expects contiguous arena extents")

    def raw_sync(write: bool):  # the engine's own blocking batch call
        call = te.batch_transfer_sync_write if write else te.batch_transfer_sync_read
        local = [address_of(src[i] if write else dst[i]) for i in range(args.pages)]
        if call(grant.segment, local, remote, [size] * args.pages) != 0:
            raise SystemExit("raw transfer failed")

    def raw_poll(write: bool):  # every page in flight at once, polled as the tier polls
        pieces = [[(address_of(src[i] if write else dst[i]), remote[i], size)] for i in range(args.pages)]
        if not all(engine.transfer_pages(grant.segment, write, pieces, 30.0)):
            raise SystemExit("raw transfer failed")

    keys = [("bench", f"p{i}") for i in range(args.pages)]
    halves = lambda views: [[v[:size // 2], v[size // 2:]] for v in views]  # noqa: E731  (K and V regions)

    def tier_write():
        outcomes = store.put_many(keys, halves(src), [None] * args.pages)
        if any(o is not None for o in outcomes):
            raise SystemExit(f"tier write failed: {outcomes}")

    def tier_read():
        if not all(store.get_many_into(keys, halves(dst))):
            raise SystemExit("tier read missed")

    def tier_write_1():
        for key, page in zip(keys, halves(src)):
            store.put(key, page)

    def tier_read_1():
        for key, page in zip(keys, halves(dst)):
            if not store.get_into(key, page):
                raise SystemExit("tier read missed")

    series = {k: [] for k in ("raw_sync_write", "raw_poll_write", "tier_write", "tier1_write",
                              "raw_sync_read", "raw_poll_read", "tier_read", "tier1_read")}
    tier_write()  # warm: connections, segment handles, first touches of the arena
    raw_poll(True)
    for _ in range(args.runs):
        series["raw_sync_write"].append(timed(lambda: raw_sync(True)))
        series["tier_write"].append(timed(tier_write))
        series["raw_poll_write"].append(timed(lambda: raw_poll(True)))
        series["tier1_write"].append(timed(tier_write_1))
        series["raw_sync_read"].append(timed(lambda: raw_sync(False)))
        series["tier_read"].append(timed(tier_read))
        series["raw_poll_read"].append(timed(lambda: raw_poll(False)))
        series["tier1_read"].append(timed(tier_read_1))
    for i in range(args.pages):
        if dst[i] != src[i]:
            raise SystemExit(f"page {i} read back differs")
    control.release(grant.lease)
    control.close()
    store.close()
    nbytes = size * args.pages
    return {f"{k}_gbps": gbps(nbytes, statistics.median(v)) for k, v in series.items()}


def end_to_end(tmp: str, port: int, size: int, args) -> dict:
    """An engine-side client, a remote tier daemon process, the pool: put_region / get_region."""
    node = NodeRunner(remote_node_config([port], max_page_bytes=f"{args.page_mib}MiB", pool_timeout_ms=1000),
                      os.path.join(tmp, "node", "run"), os.path.join(tmp, "node", "data"))
    node.start()
    try:
        client = TierClient("remote", node.config.tier("remote").endpoint, "bench-e2e",
                            deadlines=Deadlines(base=10.0, lookup=2.0))
        host_size = 2 * size * args.pages
        fd = os.memfd_create("bench-host-pool")
        os.ftruncate(fd, host_size)
        host = mmap.mmap(fd, host_size)
        host[:] = np.random.default_rng(2).integers(0, 256, host_size, dtype=np.uint8).tobytes()
        client.attach_region(fd, host_size)
        client.lookup(["warm"])
        if client.region_id is None:
            raise SystemExit("the remote tier refused the host pool region")
        keys = [f"e{i}" for i in range(args.pages)]
        half = size // 2
        put_desc, counts = P.encode_descriptors([[(i * size, half), (i * size + half, half)] for i in range(args.pages)])
        get_desc, _ = P.encode_descriptors([[((args.pages + i) * size, half), ((args.pages + i) * size + half, half)]
                                            for i in range(args.pages)])
        nbytes = size * args.pages

        def put():
            if not all(client.put_region(keys, put_desc, counts, nbytes)):
                raise SystemExit("end-to-end put failed")

        def get():
            if not all(client.get_region(keys, get_desc, counts, nbytes)):
                raise SystemExit("end-to-end get failed")
        put()
        writes, reads = [], []
        for _ in range(args.runs):
            writes.append(timed(put))
            reads.append(timed(get))
        if host[:nbytes] != host[nbytes:2 * nbytes]:
            raise SystemExit("end-to-end read back differs")
        client.close()
        host.close()
        os.close(fd)
        return {"daemon_write_gbps": gbps(nbytes, statistics.median(writes)),
                "daemon_read_gbps": gbps(nbytes, statistics.median(reads))}
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
