#!/usr/bin/env python3
"""NvmeStore against raw file I/O on the same directory, durability and thread pool.

Per repetition: raw write (one new file per page, fdatasync per file when
fsync is on) against NvmeStore.put of the same bytes; raw cold read (page
cache dropped with posix_fadvise DONTNEED under --no-direct-io; by default O_DIRECT on both sides)
against NvmeStore.get_into of cold chunks; then both warm.  Each operation
runs through a pool of --io-threads threads, like the tier daemon, in slices
of --slice pages alternating raw and store (the disk is shared and noisy).
Prints medians over repetitions and store/raw.

    python scripts/bench_nvme.py --dir /var/tmp/nvme-bench --pages 128 --page-mib 8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiers.stores.nvme import NvmeStore  # noqa: E402
from tiers.stores.nvme.chunkfile import O_DIRECT, preadv_all, pwritev_all, read_header  # noqa: E402
from tiers.stores.nvme.codec import Codec  # noqa: E402

REGIONS = 2  # a page_first page is a K region and a V region


def make_pages(n_distinct: int, size: int, seed: int):
    """Page buffers (aligned mmaps) of bf16-like data, each split into REGIONS views."""
    rng = np.random.default_rng(seed)
    pages = []
    for _ in range(n_distinct):
        buf = mmap.mmap(-1, size)
        f32 = rng.normal(0, 1, size // 2).astype(np.float32)
        np.frombuffer(buf, dtype=np.uint16)[:] = (f32.view(np.uint32) >> 16).astype(np.uint16)
        view = memoryview(buf)
        step = size // REGIONS
        pages.append([view[i * step:(i + 1) * step if i < REGIONS - 1 else size] for i in range(REGIONS)])
    return pages


class DstBuffers(threading.local):
    """One aligned destination page per worker thread."""

    def __init__(self, size: int):
        view = memoryview(mmap.mmap(-1, size))
        step = size // REGIONS
        self.views = [view[i * step:(i + 1) * step if i < REGIONS - 1 else size] for i in range(REGIONS)]


def timed(pool, fn, items) -> float:
    """Seconds to run fn over items in the pool."""
    start = time.perf_counter()
    for _ in pool.map(fn, items):
        pass
    return time.perf_counter() - start


def drop_cache(paths) -> None:
    """Write back and drop the page cache of each file (a cold read follows)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(root):
    return [os.path.join(d, f) for d, _s, fs in os.walk(root) for f in fs if f.endswith(".kv")]


def run(args) -> dict:
    size = int(args.page_mib * (1 << 20))
    size -= size % 4096  # whole blocks, so O_DIRECT can take every page
    pages = make_pages(min(args.pages, 8), size, args.seed)
    dst = DstBuffers(size)
    raw_dir, store_dir = os.path.join(args.dir, "raw"), os.path.join(args.dir, "store")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(raw_dir)
    batch = size * args.pages
    store = NvmeStore(store_dir, batch + (64 << 20), policy="lru", fsync=args.fsync, direct_io=args.direct_io,
                      direct_writes=args.direct_io,
                      compression=args.compression, compression_level=args.level, io_threads=args.io_threads)
    results = {k: [] for k in ("raw_write", "store_write", "raw_cold", "store_cold", "raw_warm", "store_warm")}
    read_flags = os.O_RDONLY | (O_DIRECT if args.direct_io else 0)
    write_flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if args.direct_io else 0)

    def raw_write(i):
        fd = os.open(os.path.join(raw_dir, f"p{i}"), write_flags, 0o600)
        try:
            pwritev_all(fd, pages[i % len(pages)])
            if args.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def raw_read(i):
        fd = os.open(os.path.join(raw_dir, f"p{i}"), read_flags)
        try:
            if preadv_all(fd, dst.views) != size:
                raise RuntimeError("short raw read")
        finally:
            os.close(fd)

    def store_read(i):
        if not store.get_into(("bench", f"p{i}"), dst.views):
            raise RuntimeError(f"store miss on p{i}")

    gbs = lambda seconds: batch / seconds / 1e9  # noqa: E731
    items = range(args.pages)

    def fresh_start() -> None:
        # Deletions discard blocks at the next journal commit (mount -o discard):
        # settle them before the clock starts, for both sides alike.
        store.clear()
        for i in items:
            try:
                os.unlink(os.path.join(raw_dir, f"p{i}"))
            except FileNotFoundError:
                pass
        os.sync()

    put = lambda i: store.put(("bench", f"p{i}"), pages[i % len(pages)])  # noqa: E731
    slices = [range(a, min(a + args.slice, args.pages)) for a in range(0, args.pages, args.slice)]

    def interleaved(raw_fn, store_fn) -> tuple:
        """GB/s of raw and store over the batch, run slice by slice in alternating order."""
        spent = {"raw": 0.0, "store": 0.0}
        for n, part in enumerate(slices):
            # The disk is shared and noisy: alternating short slices makes both
            # sides see the same conditions, and neither always goes first.
            order = [("raw", raw_fn), ("store", store_fn)]
            for side, fn in (order if n % 2 == 0 else order[::-1]):
                spent[side] += timed(pool, fn, part)
        return gbs(spent["raw"]), gbs(spent["store"])

    def record(op: str, pair: tuple) -> None:
        results[f"raw_{op}"].append(pair[0])
        results[f"store_{op}"].append(pair[1])

    with ThreadPoolExecutor(max_workers=args.io_threads) as pool:
        for i in items:  # warm-up, not timed: creates the fan-out directories once
            store.put(("bench", f"p{i}"), pages[0][:1])
        for _rep in range(args.reps):
            fresh_start()
            record("write", interleaved(raw_write, put))
            if not args.direct_io:
                drop_cache([os.path.join(raw_dir, f"p{i}") for i in items])
            drop_cache(store_files(store_dir))
            record("cold", interleaved(raw_read, store_read))
            record("warm", interleaved(raw_read, store_read))
    stats = store.stats().as_dict()
    store.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in results.items()}
    return {"config": vars(args), "page_bytes": size, "gb_per_s": results, "median_gb_per_s": medians,
            "ratio": {op: medians[f"store_{op}"] / medians[f"raw_{op}"] for op in ("write", "cold", "warm")},
            "compression_ratio": stats.get("compression_ratio", 1.0), "store_stats": stats}


def run_codecs(args) -> dict:
    """In-memory encode/decode GB/s (one thread) and ratio of every codec on bf16-like pages."""
    size = int(args.page_mib * (1 << 20))
    pages = make_pages(4, size, args.seed)
    out = {}
    for name in ("zstd", "zstd-shuffle"):
        for level in sorted({1, 3, args.level}):
            codec = Codec(name, level)
            enc, dec, stored = [], [], 0
            dst = [memoryview(bytearray(size))]
            for page in pages:
                start = time.perf_counter()
                payload = codec.encode(page, size)
                enc.append(time.perf_counter() - start)
                payload = payload if payload is not None else b"".join(page)
                stored += len(payload)
                start = time.perf_counter()
                codec.decode(codec.codec_id, payload, dst, size)
                dec.append(time.perf_counter() - start)
            out[f"{name}/{level}"] = {"ratio": size * len(pages) / stored,
                                      "encode_gb_per_s": size / statistics.median(enc) / 1e9,
                                      "decode_gb_per_s": size / statistics.median(dec) / 1e9}
    return out


def run_rebuild(args) -> dict:
    """Restart time over --rebuild-files small chunks: name scan (ours) against reading every header."""
    root = os.path.join(args.dir, "rebuild")
    shutil.rmtree(args.dir, ignore_errors=True)
    store = NvmeStore(root, 1 << 36, fsync=False)
    small = [memoryview(b"x" * 64)]
    for i in range(args.rebuild_files):
        store.put(("bench", f"r{i}"), small)
    store.close()
    os.sync()
    report = {"files": args.rebuild_files, "name_scan_s": [], "header_scan_s": [], "header_scan_cold_s": []}
    for _rep in range(args.reps):
        store = NvmeStore(root, 1 << 36, fsync=False, io_threads=args.io_threads)
        report["name_scan_s"].append(store.stats().extra["rebuild_seconds"])
        store.close()
        paths = store_files(root)
        for key, cold in (("header_scan_s", False), ("header_scan_cold_s", True)):
            if cold:  # data blocks out of the page cache, as after a reboot (inodes stay cached)
                drop_cache(paths)
            start = time.perf_counter()
            for path in paths:
                read_header(path)
            report[key].append(time.perf_counter() - start)
    shutil.rmtree(args.dir, ignore_errors=True)
    return report


def print_table(report: dict) -> None:
    m, ratio = report["median_gb_per_s"], report["ratio"]
    cfg = report["config"]
    print(f"{cfg['pages']} pages of {report['page_bytes'] / (1 << 20):.2f} MiB, {cfg['io_threads']} io threads, "
          f"fsync={cfg['fsync']} direct_io={cfg['direct_io']} codec={cfg['compression']}, "
          f"median of {cfg['reps']} (GB/s)")
    print(f"{'operation':<12}{'raw':>10}{'store':>10}{'store/raw':>11}")
    names = {"write": "write", "cold": "cold read", "warm": "warm read"}
    for op, label in names.items():
        print(f"{label:<12}{m['raw_' + op]:>10.2f}{m['store_' + op]:>10.2f}{ratio[op]:>11.2f}")
    if cfg["compression"] != "none":
        print(f"compression ratio {report['compression_ratio']:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp/hicache-bench-nvme", help="scratch directory (removed after)")
    parser.add_argument("--pages", type=int, default=128, help="pages per batch")
    parser.add_argument("--page-mib", type=float, default=8.0, help="page size in MiB")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    parser.add_argument("--slice", type=int, default=16, help="pages per alternating raw/store slice")
    parser.add_argument("--io-threads", type=int, default=4, help="thread pool size, as the daemon's")
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                        help="O_DIRECT for the store and the raw side (the tier's default)")
    parser.add_argument("--compression", default="none", choices=["none", "zstd", "zstd-shuffle"])
    parser.add_argument("--level", type=int, default=1, help="zstd level")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", help="save the report here")
    parser.add_argument("--codecs", action="store_true", help="also measure every codec in memory")
    parser.add_argument("--rebuild-files", type=int, default=0, help="also time a restart over this many chunks")
    args = parser.parse_args(argv)
    report = run(args)
    print_table(report)
    if args.codecs:
        report["codecs"] = run_codecs(args)
        print(f"{'codec/level':<16}{'ratio':>7}{'enc GB/s':>10}{'dec GB/s':>10}")
        for name, c in report["codecs"].items():
            print(f"{name:<16}{c['ratio']:>7.3f}{c['encode_gb_per_s']:>10.2f}{c['decode_gb_per_s']:>10.2f}")
    if args.rebuild_files:
        report["rebuild"] = r = run_rebuild(args)
        print(f"restart over {r['files']} chunks: name scan {statistics.median(r['name_scan_s']):.2f} s, "
              f"reading every header {statistics.median(r['header_scan_s']):.2f} s warm, "
              f"{statistics.median(r['header_scan_cold_s']):.2f} s cold (median of {args.reps})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
