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
  Reads land in registered staging memory and are copied into the host buffer
  (the default); with --direct-reads the same batch is also read straight
  into the host buffer (``direct_reads = true``, zero copy), as path tier_direct,
  and the batch is copied host to host once (memcpy: the landing copy's floor).
- via daemon: an engine-side client whose host pool is a memfd, a remote tier
  daemon process, the pool (put_region / get_region): the whole path.
Every path runs once in each repetition, one after the other and in an
order rotated from one repetition to the next, so a noisy machine slows all
of them alike.  Prints medians over repetitions and each
path's ratio to the raw engine.

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
from tiers.wire import protocol as P  # noqa: E402
from tiers.shm.buffers import scatter_copy  # noqa: E402
from tiers.wire.client import Deadlines, TierClient  # noqa: E402
from tiers.ops.node_runner import NodeRunner  # noqa: E402
from tiers.shm.buffers import address_of  # noqa: E402
from tiers.stores.remote.engine import Engine, EngineConfig  # noqa: E402
from tiers.stores.remote.loopback import free_ports, pool_config, remote_node_config  # noqa: E402
from tiers.stores.remote.pool_client import PoolClient  # noqa: E402
from tiers.stores.remote.store import RemoteStore  # noqa: E402
from tiers.bench.stats import gbps, timed  # noqa: E402


class InProcess:
    """The raw engine and a RemoteStore in this process, against the pool daemon."""

    def __init__(self, port: int, size: int, pages: int):
        endpoint = f"tcp://127.0.0.1:{port}"
        self.size, self.pages = size, pages
        self.engine = Engine(EngineConfig(hostname="127.0.0.1"))
        self.store = RemoteStore([endpoint], self.engine, max_page_bytes=size, pool_timeout=1.0, staging_slots=1)
        self.host = mmap.mmap(-1, 2 * size * pages)
        view = memoryview(self.host)
        view[:] = np.random.default_rng(1).integers(0, 256, len(view), dtype=np.uint8).tobytes()
        self.store.region_mapped(view)
        self.src = [view[i * size:(i + 1) * size] for i in range(pages)]
        self.dst = [view[(pages + i) * size:(pages + i + 1) * size] for i in range(pages)]
        # Arena addresses for the raw engine: granted once, kept reserved for the whole run.
        self.control = PoolClient(endpoint, "bench-raw", timeout=1.0, retry_max=1.0)
        end = time.monotonic() + 30  # a loaded machine may miss the first connect: the client backs off, retry
        while True:
            self.grant = self.control.alloc([f"raw-{i}" for i in range(pages)], [size] * pages, [None] * pages,
                                            ttl=3600.0)
            if self.grant is not None or time.monotonic() > end:
                break
            time.sleep(0.2)
        if self.grant is None or any(e is None or len(e) != 1 for e in self.grant.extents):
            raise SystemExit("the pool did not grant contiguous room for the raw transfers")
        self.remote = [e[0][0] for e in self.grant.extents]
        self.keys = [("bench", f"p{i}") for i in range(pages)]

    def halves(self, views):
        """Each page as two regions (K and V), as SGLang's page_first layout hands it over."""
        return [[v[:self.size // 2], v[self.size // 2:]] for v in views]

    def raw_sync(self, write: bool) -> None:  # the engine's own blocking batch call
        te = self.engine.raw()
        call = te.batch_transfer_sync_write if write else te.batch_transfer_sync_read
        local = [address_of(v) for v in (self.src if write else self.dst)]
        if call(self.grant.segment, local, self.remote, [self.size] * self.pages) != 0:
            raise SystemExit("raw transfer failed")

    def raw_poll(self, write: bool) -> None:  # every page in flight at once (adjacent ones merged), polled as the tier polls
        pieces = [[(address_of(v), r, self.size)] for v, r in zip(self.src if write else self.dst, self.remote)]
        if not all(self.engine.transfer_pages(self.grant.segment, write, pieces, 30.0)):
            raise SystemExit("raw transfer failed")

    def tier(self, write: bool) -> None:  # the batch path the tier daemon takes
        if write:
            outcomes = self.store.put_many(self.keys, self.halves(self.src), [None] * self.pages)
            if any(o is not None for o in outcomes):
                raise SystemExit(f"tier write failed: {outcomes}")
        else:
            found = self.store.get_many_into(self.keys, self.halves(self.dst))
            if not all(found):
                raise SystemExit(f"tier read missed: {found} {self.store.stats()}")

    def tier_direct(self, write: bool) -> None:  # reads only: direct_reads = true, no landing copy
        self.store.direct_reads = True
        try:
            self.tier(write)
        finally:
            self.store.direct_reads = False

    def memcpy(self, write: bool) -> None:  # what the landing copy costs at best: the batch, host to host
        scatter_copy(self.dst, self.src)

    def tier_page_by_page(self, write: bool) -> None:
        for key, s, d in zip(self.keys, self.halves(self.src), self.halves(self.dst)):
            if write:
                self.store.put(key, s)
            elif not self.store.get_into(key, d):
                raise SystemExit("tier read missed")

    def check(self) -> None:
        if any(d != s for d, s in zip(self.dst, self.src)):
            raise SystemExit("a page read back differs")

    def close(self) -> None:
        self.control.release(self.grant.lease)
        self.control.close()
        self.store.close()


class ViaDaemon:
    """An engine-side client with a memfd host pool, a remote tier daemon process, the pool."""

    def __init__(self, tmp: str, port: int, size: int, pages: int, page_mib: int):
        self.node = NodeRunner(remote_node_config([port], max_page_bytes=f"{page_mib}MiB", pool_timeout_ms=1000),
                               os.path.join(tmp, "node", "run"), os.path.join(tmp, "node", "data"))
        self.node.start()
        try:
            self._connect(size, pages)
        except BaseException:
            self.node.stop()  # no daemon outlives a failed start
            raise

    def _connect(self, size: int, pages: int) -> None:
        self.client = TierClient("remote", self.node.config.tier("remote").endpoint, "bench-e2e",
                                 deadlines=Deadlines(base=10.0, lookup=2.0), attach=True)
        self.nbytes = size * pages
        self.fd = os.memfd_create("bench-host-pool")
        os.ftruncate(self.fd, 2 * self.nbytes)
        self.host = mmap.mmap(self.fd, 2 * self.nbytes)
        self.host[:] = np.random.default_rng(2).integers(0, 256, 2 * self.nbytes, dtype=np.uint8).tobytes()
        end = time.monotonic() + 30  # a loaded machine may miss the first connect or registration: again
        while True:
            if self.client.region_id is None:
                self.client.attach_region(self.fd, 2 * self.nbytes)  # registers again once a session is open
            if (self.client.lookup(["warm"]) is not None and self.client.region_id is not None
                    and self.client.can_lease()):
                break
            if time.monotonic() > end:
                raise SystemExit("the remote tier did not take the host pool region")
            time.sleep(0.2)
        self.keys = [f"e{i}" for i in range(pages)]
        half = size // 2
        self.put_desc, self.counts = P.encode_descriptors([[(i * size, half), (i * size + half, half)]
                                                           for i in range(pages)])
        base = address_of(memoryview(self.host))
        self.get_runs = [[(base + (pages + i) * size, half), (base + (pages + i) * size + half, half)]
                         for i in range(pages)]

    def run(self, write: bool) -> None:
        if write:
            ok = self.client.put_region(self.keys, self.put_desc, self.counts, self.nbytes)
        else:
            ok = self.client.get_leased(self.keys, self.get_runs)
        if not all(ok):
            raise SystemExit(f"end-to-end {'put' if write else 'get'} failed")

    def check(self) -> None:
        if self.host[:self.nbytes] != self.host[self.nbytes:]:
            raise SystemExit("end-to-end read back differs")

    def close(self) -> None:
        self.client.close()
        self.host.close()
        os.close(self.fd)
        self.node.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-mib", type=int, default=8, help="page size in MiB (default 8)")
    ap.add_argument("--page-kib", type=int, default=0,
                    help="page size in KiB instead (64: the smallest the bench runs)")
    ap.add_argument("--pages", type=int, default=8, help="pages per repetition")
    ap.add_argument("--runs", type=int, default=7, help="repetitions (medians are reported)")
    ap.add_argument("--no-daemon", action="store_true", help="skip the path through a remote tier daemon")
    ap.add_argument("--direct-reads", action="store_true",
                    help="also read the batch with direct_reads (straight into the host buffer; path tier_direct)")
    ap.add_argument("--json", metavar="FILE", help="write the figures here too")
    args = ap.parse_args(argv)
    size = args.page_kib << 10 if args.page_kib else args.page_mib << 20
    max_mib = max(1, -(-size // (1 << 20)))  # the pool's and the tier's max_page_bytes, in whole MiB
    total = size * args.pages
    tmp = tempfile.mkdtemp(prefix="bench-remote-")
    (port,) = free_ports(1)
    # Room for the raw pages, the tier's, the daemon's, and both overwritten batches mid-commit.
    block = "1MiB" if size >= 1 << 20 else "64KiB"  # a small page in a block of its size, as the bench's pool
    pools = NodeRunner(pool_config([port], capacity=f"{6 * total >> 20}MiB", block_size=block,
                                   max_page_bytes=f"{max_mib}MiB", max_lease_ms=3_600_000),
                       os.path.join(tmp, "pool", "run"), os.path.join(tmp, "pool", "data"))
    pools.start()
    local = daemon = None
    try:
        local = InProcess(port, size, args.pages)
        daemon = None if args.no_daemon else ViaDaemon(tmp, port, size, args.pages, max_mib)
        paths = {"raw_sync": local.raw_sync, "raw_poll": local.raw_poll, "tier": local.tier,
                 "tier1": local.tier_page_by_page}
        if daemon is not None:
            paths["daemon"] = daemon.run
        if args.direct_reads:
            paths["tier_direct"] = local.tier_direct
            paths["memcpy"] = local.memcpy
        read_only = {"tier_direct", "memcpy"}
        for op in (True, False):  # warm: connections, segment handles, first touches of the arena
            for name, run in paths.items():
                if op or name not in read_only:
                    run(op)
        series = {f"{name}_{op}": [] for op in ("write", "read") for name in paths
                  if op == "read" or name not in read_only}
        names = list(paths)
        for rep in range(args.runs):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotated: no path always runs first
            for write, op in ((True, "write"), (False, "read")):
                for name in order:
                    if not write or name not in read_only:
                        series[f"{name}_{op}"].append(timed(lambda: paths[name](write)))
        local.check()
        if daemon is not None:
            daemon.check()
    finally:
        for part in (daemon, local):
            if part is not None:
                part.close()
        pools.stop()
    results = {"page_bytes": size, "pages": args.pages, "runs": args.runs}
    results.update({f"{k}_gbps": gbps(total, statistics.median(v)) for k, v in series.items()})
    print(f"{args.pages} pages of {size >> 10} KiB, medians of {args.runs} interleaved runs (GB/s; ratio to the "
          "better raw engine call):")
    for op in ("write", "read"):
        base = max(results[f"raw_sync_{op}_gbps"], results[f"raw_poll_{op}_gbps"])
        line = (f"  {op:5s}  raw sync {results[f'raw_sync_{op}_gbps']:.2f}"
                f"  raw poll {results[f'raw_poll_{op}_gbps']:.2f}")
        for name, label in (("tier", "tier"), ("tier_direct", "tier direct_reads"), ("tier1", "tier page by page"),
                            ("daemon", "via daemon"), ("memcpy", "memcpy")):
            if f"{name}_{op}_gbps" in results:
                results[f"{name}_{op}_ratio"] = results[f"{name}_{op}_gbps"] / base
                line += f"  {label} {results[f'{name}_{op}_gbps']:.2f} ({results[f'{name}_{op}_ratio']:.2f}x)"
        print(line)
    if "tier_direct_read_gbps" in results:
        results["staged_over_direct_read"] = results["tier_read_gbps"] / results["tier_direct_read_gbps"]
        print(f"  staged reads (default) / direct_reads: {results['staged_over_direct_read']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
