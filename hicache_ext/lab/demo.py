"""``hicache-tiers demo``: real SGLang pages through the backend and the node's daemons, verified and timed."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, create_backend, fill_pages,
                                        host_indices_for_pages, make_keys, make_storage_config,
                                        page_checksums, zero_pages)
from tiers.ops.config import DEFAULT_CONFIG_TOML
from tiers.ops.node_runner import NodeRunner


def memcpy_gbps(nbytes: int, chunk: int = 64 << 20) -> float:
    """Single-thread memcpy speed over nbytes, in 64 MiB buffers (the limit we compare against)."""
    src = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination in first: first touches are not memcpy speed
    rounds = max(2, nbytes // chunk)
    start = time.perf_counter()
    for _ in range(rounds):
        np.copyto(dst, src)
    return rounds * chunk / (time.perf_counter() - start) / 1e9


def run_demo(args) -> int:
    temp = tempfile.TemporaryDirectory(prefix="hicache-demo-")
    runtime_dir = args.runtime_dir or os.path.join(temp.name, "run")
    data_dir = args.data_dir or os.path.join(temp.name, "data")
    config_text = open(args.config, encoding="utf-8").read() if args.config else DEFAULT_CONFIG_TOML
    runner = NodeRunner(config_text, runtime_dir, data_dir, config_path=os.path.join(temp.name, "node.toml"),
                        log_level="warning")
    try:
        if not args.use_running:
            print(f"starting tiers {', '.join(t.name for t in runner.config.tiers)} under {runtime_dir}")
            runner.start()
        return _drive(args, runner)
    finally:
        if not args.use_running:
            runner.stop()
        temp.cleanup()


def _drive(args, runner: NodeRunner) -> int:
    allocator = "default" if args.no_shm else "shm"
    pool = build_mha_host_pool(layout=args.layout, allocator=allocator, layers=args.layers, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, page_size=args.page_tokens, pages=args.pages)
    extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
             "interface_v1": 1, "runtime_dir": runner.runtime_dir, "tiers_config": runner.config_path}
    if allocator == "shm":
        extra["allocator"] = "shm"
    if args.write_policy:
        extra["write_policy"] = args.write_policy
    config = make_storage_config(model_name="demo-llama-3-8b", layout=args.layout, extra_config=extra)
    backend = create_backend("dynamic", config, pool)
    driver = PageDriver(backend, pool, config, "dynamic")
    indices = host_indices_for_pages(pool, 0, args.pages)
    print(f"host pool: {args.pages} pages of {_page_bytes(pool) / 2**20:.1f} MiB ({args.layout}, "
          f"{'memfd' if allocator == 'shm' else 'plain memory'})")
    nbytes = args.pages * _page_bytes(pool)
    writes, reads, wrong = [], [], 0
    hits = written = read = 0
    for round_no in range(args.repeat):
        keys = make_keys(args.pages, salt=1000 + round_no, page_size=args.page_tokens)
        fill_pages(pool, indices, seed=round_no)  # new content each round, checked after the read
        expected = page_checksums(pool, indices)
        start = time.perf_counter()
        written = driver.backup(keys, indices)
        writes.append(nbytes / (time.perf_counter() - start) / 1e9)
        hits = driver.exists(keys)
        zero_pages(pool, indices)
        start = time.perf_counter()
        read = driver.prefetch(keys, indices)
        reads.append(nbytes / (time.perf_counter() - start) / 1e9)
        got = page_checksums(pool, indices)
        wrong += sum(1 for a, b in zip(got[:read], expected[:read]) if a != b)
        print(f"round {round_no + 1}/{args.repeat}: wrote {written}, hits {hits}, read {read} pages; "
              f"write {writes[-1]:.2f} GB/s, read {reads[-1]:.2f} GB/s")
    limit = memcpy_gbps(nbytes)
    write_med, read_med = statistics.median(writes), statistics.median(reads)
    print()
    print(f"{'':18}{'pages':>8}{'GB/s (median)':>15}{'x memcpy':>10}")
    print(f"{'write (backup)':18}{written:>8}{write_med:>15.2f}{write_med / limit:>10.2f}")
    print(f"{'lookup hits':18}{hits:>8}")
    print(f"{'read (prefetch)':18}{read:>8}{read_med:>15.2f}{read_med / limit:>10.2f}")
    print(f"{'memcpy (1 thread)':18}{'':>8}{limit:>15.2f}{1.0:>10.2f}")
    print(f"wrong pages: {wrong}")
    tiers = [t.name for t in runner.config.tiers]
    policy = args.write_policy or runner.config.write_policy
    print(_policy_note(policy, tiers, backend.tier_stats()))
    for name, stats in backend.tier_stats().items():
        if stats:
            print(f"tier {name}: {stats['pages']} pages, {stats['used_bytes'] / 2**30:.2f} of "
                  f"{stats['capacity_bytes'] / 2**30:.2f} GiB, hits {stats['hits']}, evictions {stats['evictions']}")
    backend.close()
    ok = written == args.pages and read == args.pages and wrong == 0
    print("demo: OK" if ok else "demo: FAILED (see above)")
    return 0 if ok else 1


def _policy_note(policy: str, tiers: list, stats: dict) -> str:
    """What the write figure above measured, in words: which tiers held a page when it was acknowledged."""
    if len(tiers) < 2:
        return f"(write: a page is acknowledged once {tiers[0]} holds it)"
    top, below = tiers[0], ", ".join(tiers[1:])
    if policy == "write_through":
        return (f"(write_through: a page is acknowledged once {', '.join(tiers)} all hold it, so the write figure is "
                f"the slowest tier's; write_back, the default, acknowledges at {top})")
    mine = stats.get(top) or {}
    behind = (f"{mine.get('demotions', 0)} written down so far, {mine.get('dirty_pages', 0)} not yet"
              if mine else "its figures unavailable")
    if policy == "write_back":
        return (f"(write_back, the default by measurement (docs/PERFORMANCE.md): a page is acknowledged once {top} "
                f"holds it and reaches {below} behind: {behind}; dirty pages go down past max_dirty_pages, on "
                f"eviction and at a graceful stop. write_through would acknowledge at the slowest tier's speed)")
    return (f"(selective: a page is acknowledged once {top} holds it and reaches {below} only once read often "
            f"enough: {behind})")


def _page_bytes(pool) -> int:
    _, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, 0, 1))
    return int(sum(sizes))
