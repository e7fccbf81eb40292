#!/usr/bin/env python3
"""The CPU the NVMe tier's batched put costs its caller, a page, without the device's time.

Issue 30's small-page writes are bound by the work the daemon does per page
(check, header, reserve, commit) more than by the disk: a 64 KiB page is
~45 us of a 1.4 GB/s device, and each microsecond of Python a page is 2% of
it.  This script puts --pages pages of each size through one NvmeStore on a
directory of its own (tmpfs by default: no device wait) with the sums a staged
put hands it, and reports the median of the calling thread's CPU time
(time.thread_time: the writer threads' system calls excluded) over --repeat
puts, a page.  Compare a change with it before the full bench.

    python3 scripts/bench_nvme_put_cpu.py --page-kib 64,256 --repeat 40
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page-kib", default="64,256", help="page sizes in KiB, comma-separated (default 64,256)")
    parser.add_argument("--pages", type=int, default=128, help="pages a put (default 128, the bench's batch)")
    parser.add_argument("--repeat", type=int, default=40, help="puts timed a page size (default 40; 5 more warm up)")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the store's directory goes (default /dev/shm: no device time)")
    return parser.parse_args(argv)


def caller_cpu_us(page: int, pages: int, repeat: int, parent_dir) -> float:
    import xxhash
    from tiers.stores.nvme.store import NvmeStore
    root = tempfile.mkdtemp(prefix="nvme-put-cpu-", dir=parent_dir)
    store = NvmeStore(os.path.join(root, "nvme"), capacity=4 * pages * (page + 8192), max_page_bytes=page,
                      fsync=False)
    try:
        buf = mmap.mmap(-1, page * pages)
        buf.write(os.urandom(page * pages))
        whole = memoryview(buf)
        pages_views = [[whole[i * page:(i + 1) * page]] for i in range(pages)]
        sums = [xxhash.xxh3_64_intdigest(p[0]) for p in pages_views]
        spent = []
        for r in range(repeat + 5):
            keys = [("ns", f"{r:08x}{i:056x}") for i in range(pages)]
            began = time.thread_time()
            out = store.put_many_with_sums(keys, pages_views, [None] * pages, None, sums, sums)
            spent.append(time.thread_time() - began)
            if any(e is not None for e in out):
                raise SystemExit(f"a put was refused: {next(e for e in out if e is not None)}")
            store.delete(keys)
        return statistics.median(spent[5:]) / pages * 1e6
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        sizes = [int(s) << 10 for s in args.page_kib.split(",")]
    except ValueError:
        print(f"--page-kib: expected KiB numbers separated by commas, got {args.page_kib!r}", file=sys.stderr)
        return 2
    for size in sizes:
        print(f"{size >> 10} KiB pages, {args.pages} a put: {caller_cpu_us(size, args.pages, args.repeat, args.dir):.1f}"
              f" us of the caller's CPU a page (median of {args.repeat})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
