#!/usr/bin/env python3
"""Durable write sequences on one disk, beside the raw limit of `hicache-tiers bench`.

Each variant writes --pages new files of --page-kib KiB on 4 threads and
makes them durable a different way (the NVMe tier's own sequence is the
first); the raw limit is tiers/bench/limits.RawDisk. Prints the median GB/s
of --repeat rounds. It explains why the NVMe tier trails the raw limit at
small pages (docs/PERFORMANCE.md, round of issue 16).

    python3 scripts/nvme_write_variants.py --page-kib 1024 --repeat 3
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-kib", type=int, default=1024, help="page size in KiB, a multiple of 4 (default 1024)")
    p.add_argument("--pages", type=int, default=128, help="files a round (default 128)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--work-dir", default="/var/tmp", help="a directory on the disk to measure (default /var/tmp)")
    args = p.parse_args(argv)
    if args.page_kib < 4 or args.page_kib % 4 or args.pages < 1 or args.repeat < 1:
        p.error("--page-kib a positive multiple of 4, --pages and --repeat >= 1")
    import numpy as np
    from tiers.bench.limits import RawDisk

    size, n = args.page_kib << 10, args.pages
    root = tempfile.mkdtemp(dir=args.work_dir, prefix="nvme-variants-")
    leaf = os.path.join(root, "d")
    os.makedirs(leaf)
    buf = mmap.mmap(-1, size * n)  # page-aligned, as O_DIRECT needs
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 255, size * n, dtype=np.uint8)
    views = [memoryview(buf)[i * size:(i + 1) * size] for i in range(n)]

    def dir_sync() -> None:
        fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)

    def create(path: str, i: int, direct: bool, sync: bool) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o600)
        os.pwritev(fd, [views[i]], 0)
        if sync:
            os.fdatasync(fd)
        return fd

    def per_page(tag: str, direct: bool, rename: bool) -> None:
        def one(i: int) -> None:
            final = os.path.join(leaf, f"{tag}{i}")
            os.close(create(final + ".tmp" if rename else final, i, direct, True))
            if rename:
                os.rename(final + ".tmp", final)
                dir_sync()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(n)))

    def grouped(tag: str, direct: bool) -> None:
        with ThreadPoolExecutor(4) as pool:
            fds = list(pool.map(lambda i: create(os.path.join(leaf, f"{tag}{i}.tmp"), i, direct, False), range(n)))
            list(pool.map(os.fdatasync, fds))
        for i, fd in enumerate(fds):
            os.close(fd)
            os.rename(os.path.join(leaf, f"{tag}{i}.tmp"), os.path.join(leaf, f"{tag}{i}"))
        dir_sync()

    def syncfs(tag: str) -> None:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: os.close(create(os.path.join(leaf, f"{tag}{i}.tmp"), i, False, False)), range(n)))
        for i in range(n):
            os.rename(os.path.join(leaf, f"{tag}{i}.tmp"), os.path.join(leaf, f"{tag}{i}"))
        os.sync()

    variants = {
        "the tier's sequence: O_DIRECT write, fdatasync, rename, dir fsync": lambda t: per_page(t, True, True),
        "the same, buffered write": lambda t: per_page(t, False, True),
        "O_DIRECT write + fdatasync, no rename": lambda t: per_page(t, True, False),
        "buffered write + fdatasync, no rename": lambda t: per_page(t, False, False),
        "a batch: write all, fdatasync all, rename all, one dir fsync (O_DIRECT)": lambda t: grouped(t, True),
        "the same, buffered": lambda t: grouped(t, False),
        "write all buffered, rename, one sync": syncfs,
    }
    raw = RawDisk(os.path.join(root, "raw"), size)
    results = {name: [] for name in [*variants, "raw limit (buffered write + fdatasync, file a page)"]}
    try:
        for rnd in range(args.repeat):
            for k, (name, run) in enumerate(variants.items()):
                os.sync()
                start = time.perf_counter()
                run(f"v{k}r{rnd}-")
                results[name].append(n * size / (time.perf_counter() - start) / 1e9)
            results["raw limit (buffered write + fdatasync, file a page)"].append(raw.write(n))
        for name, rates in results.items():
            print(f"{args.page_kib} KiB  {statistics.median(rates):5.2f} GB/s  {name}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
