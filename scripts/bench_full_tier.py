#!/usr/bin/env python3
"""A store's puts into a full tier against an empty one: the DRAM tier's evictions and the NVMe tier's recycling.

Every target of ``hicache-tiers bench`` measures a tier cleared between
repetitions, yet a cache in service is full and each put evicts its own
size.  This script drives the stores themselves (no daemon, no engine), one
128-page batch a put:

- DRAM (tiers/stores/dram.py, page directory on): microseconds a page of a
  put's reserve and commit, into the empty tier while it fills and into the
  full one after, for each --policies entry;
- NVMe (tiers/stores/nvme/store.py, fsync on): milliseconds a put into a full
  tier of --nvme-batches batches (plus --nvme-extra-mib, so the capacity is not
  whole files), with recycle_bytes 0 (off), auto (a tier this small keeps
  no budget: each put writes over the file its own victims emptied, or a new
  one) and the capacity as its request (an eighth of it: dead records left
  in place too), the three alternated --rounds times.

    python3 scripts/bench_full_tier.py --page-kib 64,256 --rounds 2
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAGES = 128  # a batch, as the bench's


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", default="64,256", help="NVMe page sizes in KiB, comma-separated (default 64,256)")
    parser.add_argument("--policies", default="lru,fifo,s3fifo,lfu", help="DRAM policies (default lru,fifo,s3fifo,lfu)")
    parser.add_argument("--dram-pages", type=int, default=100_000,
                        help="DRAM tier capacity in 4 KiB one-block pages (default 100000)")
    parser.add_argument("--dram-batches", type=int, default=400, help="DRAM puts timed into the full tier (default 400)")
    parser.add_argument("--nvme-batches", type=int, default=12, help="NVMe capacity in batch files (default 12)")
    parser.add_argument("--nvme-extra-mib", type=int, default=3,
                        help="MiB added to the NVMe capacity, so it is not whole files (default 3; 0: whole files)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="NVMe rounds, recycling off, auto and with a budget in each (default 2)")
    parser.add_argument("--dir", default=None, help="directory for the NVMe chunks (default a temporary one)")
    return parser.parse_args(argv)


def dram(policy: str, pages: int, batches: int) -> tuple:
    """(us a page into the empty tier, into the full one, pages reserved in one call into the full one)."""
    from tiers.stores.dram import DramStore
    block = 4096
    store = DramStore(pages * block, policy, block_size=block, prefault=False)
    serial = 0

    def put() -> tuple:
        nonlocal serial
        keys = [f"{k:064x}" for k in range(serial, serial + PAGES)]
        serial += PAGES
        began = time.perf_counter()
        allocs = store.reserve_many("ns", keys, [block] * PAGES, evict=True)
        store.commit_many("ns", keys[:len(allocs)], allocs, [None] * len(allocs), [1] * len(allocs))
        for key in keys[len(allocs):]:  # what the batch call did not reserve, page by page (as transfers.py)
            store.commit(("ns", key), store.reserve(("ns", key), block), None, 1)
        return (time.perf_counter() - began) / PAGES * 1e6, len(allocs)
    try:
        empty = [put()[0] for _ in range(pages // PAGES)]
        full = [put() for _ in range(batches)]
        return statistics.median(empty), statistics.median(t for t, _n in full), statistics.median(n for _t, n in full)
    finally:
        store.close()


NVME_MODES = (("off", lambda capacity: 0), ("auto", lambda capacity: None), ("budget", lambda capacity: capacity))


def nvme(root: str, page: int, capacity_batches: int, extra: int, mode: str) -> tuple:
    """(ms a put into the full tier, files kept, batches written over a kept file)."""
    from tiers.stores.nvme.store import NvmeStore
    shutil.rmtree(root, ignore_errors=True)
    capacity = capacity_batches * (page + 4096) * PAGES + extra
    store = NvmeStore(root, capacity, name="nvme", recycle_bytes=dict(NVME_MODES)[mode](capacity))
    buffers = [memoryview(mmap.mmap(-1, page)) for _ in range(PAGES)]
    for buf in buffers:
        buf[:] = os.urandom(page)
    serial = 0

    def put() -> float:
        nonlocal serial
        keys = [("ns", f"{k:064x}") for k in range(serial, serial + PAGES)]
        serial += PAGES
        began = time.perf_counter()
        out = store.put_many(keys, [[b] for b in buffers], [None] * PAGES, None)
        if any(o is not None for o in out):
            raise SystemExit(f"a put was refused: {next(o for o in out if o is not None)}")
        return time.perf_counter() - began
    try:
        for _ in range(capacity_batches + 2):  # full, and past it
            put()
        seconds = statistics.median(put() for _ in range(12))
        extra_stats = store.stats().extra
        return seconds * 1e3, extra_stats["recycled_kept"], extra_stats["recycled_reused"]
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    print("DRAM store, 128 one-block pages a put (reserve and commit, us a page):")
    for policy in [p for p in args.policies.split(",") if p]:
        empty, full, batched = dram(policy, args.dram_pages, args.dram_batches)
        print(f"  {policy:8s} empty {empty:6.2f}  full {full:6.2f}  (pages reserved in one call into the full tier: "
              f"{batched:.0f} of {PAGES})", flush=True)
    work = args.dir or tempfile.mkdtemp(prefix="full-tier-")
    try:
        extra = args.nvme_extra_mib << 20
        print(f"NVMe store, fsync, a full tier of {args.nvme_batches} batches + {args.nvme_extra_mib} MiB "
              "(ms a put, 12 puts after filling):")
        for kib in [int(k) for k in args.page_kib.split(",") if k]:
            for round_ in range(args.rounds):
                for mode, _limit in NVME_MODES:
                    ms, kept, reused = nvme(os.path.join(work, "nvme"), kib << 10, args.nvme_batches, extra, mode)
                    print(f"  {kib:5d} KiB, round {round_ + 1}, recycling {mode:6s}: {ms:7.2f} ms "
                          f"(files kept {kept}, written over {reused})", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
