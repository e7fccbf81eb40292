"""Demotion throughput: pages written back into DRAM (mode back, max_dirty_pages 1) reach an fsync NVMe tier.

Measures the time from the first put until the DRAM daemon reports every page but one demoted.
"""
import os, shutil, statistics, sys, tempfile, time
import numpy as np
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import TierClient

size = int(sys.argv[1]) << 10
n = int(sys.argv[2])
reps = int(sys.argv[3])
direct = (sys.argv[4] if len(sys.argv) > 4 else "true")
root = tempfile.mkdtemp(dir="/var/tmp", prefix="demote-ab-")
cfg = f'''[node]
write_policy = "write_back"
max_dirty_pages = 1

[[tiers]]
name = "dram"
kind = "dram"
capacity = "{(n * size * 2) >> 20}MiB"
max_page_bytes = "{max(1, size >> 20)}MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "{(n * size * 3) >> 20}MiB"
max_page_bytes = "{max(1, size >> 20)}MiB"
direct_io = {direct}
'''
runner = NodeRunner(cfg, os.path.join(root, "run"), os.path.join(root, "data"))
runner.start()
out = []
try:
    dram = TierClient("dram", runner.config.tier("dram").endpoint, "ab")
    admin = TierClient("dram", runner.config.tier("dram").endpoint, "_admin")
    nvme = TierClient("nvme", runner.config.tier("nvme").endpoint, "_admin")
    data = np.random.default_rng(0).integers(0, 255, size * 32, dtype=np.uint8)
    done0 = 0
    for rep in range(reps):
        keys = [f"r{rep}-{i}" for i in range(n)]
        start = time.perf_counter()
        for first in range(0, n, 32):
            batch = keys[first:first + 32]
            pages = [[memoryview(data[(i % 32) * size:(i % 32 + 1) * size])] for i in range(len(batch))]
            assert all(dram.put_frames(batch, pages, size * len(batch), mode="back", min_reads=2))
        want = done0 + n - 1
        while (admin.stats() or {}).get("demotions", 0) < want:
            time.sleep(0.005)
        seconds = time.perf_counter() - start
        done0 = admin.stats()["demotions"]
        out.append(n * size / seconds / 1e9)
        nvme.clear(everything=True)
    st = admin.stats(); ns = nvme.stats()
    print(f"{size >> 10} KiB x {n}: demotion {statistics.median(out):.2f} GB/s (runs {', '.join(f'{x:.2f}' for x in out)}); "
          f"by_region {st.get('demotions_by_region', 'n/a')}, nvme unaligned_writes {ns.get('unaligned_writes', 'n/a')}")
finally:
    runner.stop()
    shutil.rmtree(root, ignore_errors=True)
