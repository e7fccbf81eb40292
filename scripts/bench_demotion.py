#!/usr/bin/env python3
"""Demotion throughput: write_back pages acknowledged in DRAM reach an fsynced NVMe tier behind it.

Starts a DRAM -> NVMe node (write_back, max_dirty_pages = 1, so every page but
the newest goes down at once), puts --pages pages into DRAM as a client would,
and times from the first put until the DRAM daemon counts them demoted.
Prints the median GB/s of --repeat rounds, how many pages went down through
shared memory (``demotions_by_region``) and how many NVMe wrote unaligned
(buffered, ``unaligned_writes``). Run it on two trees to compare them.

    python3 scripts/bench_demotion.py --page-kib 1024 --pages 256 --repeat 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def node_config(page: int, pages: int, direct_io: bool) -> str:
    mib = max(1, page >> 20)
    return f'''[node]
write_policy = "write_back"
max_dirty_pages = 1

[[tiers]]
name = "dram"
kind = "dram"
capacity = "{max(64, (pages * page * 2) >> 20)}MiB"
max_page_bytes = "{mib}MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "{max(64, (pages * page * 3) >> 20)}MiB"
max_page_bytes = "{mib}MiB"
direct_io = {str(direct_io).lower()}
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-kib", type=int, default=1024, help="page size in KiB (default 1024)")
    p.add_argument("--pages", type=int, default=256, help="pages a round (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the figure is their median (default 3)")
    p.add_argument("--buffered", action="store_true", help="NVMe tier with direct_io = false")
    p.add_argument("--work-dir", default="/var/tmp", help="where the node's files go (default /var/tmp)")
    args = p.parse_args(argv)
    if args.page_kib < 4 or args.pages < 2 or args.repeat < 1:
        p.error("--page-kib >= 4, --pages >= 2 and --repeat >= 1")
    import numpy as np
    from tiers.ops.node_runner import NodeRunner
    from tiers.wire.client import TierClient

    page = args.page_kib << 10
    root = tempfile.mkdtemp(dir=args.work_dir, prefix="demotion-")
    runner = NodeRunner(node_config(page, args.pages, not args.buffered), os.path.join(root, "run"),
                        os.path.join(root, "data"))
    runner.start()
    clients = []
    try:
        endpoint = runner.config.tier("dram").endpoint
        dram, admin = TierClient("dram", endpoint, "demotion-bench"), TierClient("dram", endpoint, "_admin")
        nvme = TierClient("nvme", runner.config.tier("nvme").endpoint, "_admin")
        clients = [dram, admin, nvme]
        data = np.random.default_rng(0).integers(0, 255, page * 32, dtype=np.uint8)
        rates, demoted = [], 0
        for rnd in range(args.repeat):
            keys = [f"r{rnd}-{i}" for i in range(args.pages)]
            start = time.perf_counter()
            for first in range(0, args.pages, 32):
                batch = keys[first:first + 32]
                pages = [[memoryview(data[(i % 32) * page:(i % 32 + 1) * page])] for i in range(len(batch))]
                if not all(dram.put_frames(batch, pages, page * len(batch), mode="back", min_reads=2)):
                    print("the DRAM tier refused pages", file=sys.stderr)
                    return 1
            want = demoted + args.pages - 1
            while (admin.stats() or {}).get("demotions", 0) < want:
                if time.perf_counter() - start > 600:
                    print("demotion did not finish in 600 s", file=sys.stderr)
                    return 1
                time.sleep(0.005)
            rates.append(args.pages * page / (time.perf_counter() - start) / 1e9)
            demoted = admin.stats()["demotions"]
            nvme.clear(everything=True)
            print(f"round {rnd + 1}/{args.repeat}: {rates[-1]:.2f} GB/s", file=sys.stderr)
        st, ns = admin.stats(), nvme.stats()
        print(f"{args.page_kib} KiB x {args.pages}, NVMe {'buffered' if args.buffered else 'O_DIRECT'}: demotion "
              f"{statistics.median(rates):.2f} GB/s (rounds {', '.join(f'{x:.2f}' for x in rates)}); by region "
              f"{st.get('demotions_by_region', 'n/a')} of {st.get('demotions')}, NVMe unaligned writes "
              f"{ns.get('unaligned_writes', 'n/a')}")
        return 0
    finally:
        for client in clients:
            client.close()
        runner.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
