"""This project through the real backend and a real host pool, each tier against its limit, in one loop.

Per page size and repetition: fresh keys, a timed backup of the whole batch
(the controller's page function), a timed prefetch into zeroed host pages
(after dropping the page cache where the read must be cold), every page
checked, the tier cleared.  Each tier's limit is sampled in the same loop,
just before the step it bounds, so both see the same machine.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional

from hicache_ext.bench.rig import MiB, Node, Rank, drop_page_cache, node_toml, tier_toml
from tiers.bench import limits
from tiers.bench.stats import Figures, Progress, gbps, timed
from tiers.remote.loopback import free_ports, pool_config

WRITE_POLICIES = ("write_through", "write_back", "selective")


def measure(rank: Rank, figs: Figures, prefix: str, reps: int, progress: Progress, salt: int,
            before: Optional[Dict[str, Callable[[], None]]] = None, cold_dir: Optional[str] = None,
            warm: bool = False) -> None:
    """Write then read the rank's batch reps times; figures prefix.write / .read (/ .read_warm)."""
    before = before or {}
    for rep in range(reps):
        progress.step(f"{prefix}: repetition {rep + 1}/{reps}")
        keys = rank.keys(salt + rep)
        if "write" in before:
            before["write"]()
        done = {}
        seconds = timed(lambda: done.setdefault("n", rank.write(keys)))
        written = done["n"]
        if written != rank.pages:
            figs.failures.append(f"{prefix}: wrote {written} of {rank.pages} pages")
            rank.clear()
            continue
        figs.add(f"{prefix}.write", gbps(rank.nbytes, seconds))
        reads = [("read", cold_dir)] + ([("read_warm", None)] if warm else [])
        for name, cold in reads:
            rank.zero()
            if cold:
                drop_page_cache(cold)
            if name in before:
                before[name]()
            got = {}
            seconds = timed(lambda: got.setdefault("n", rank.read(keys)))
            wrong = rank.wrong_pages(got["n"])
            if got["n"] != rank.pages or wrong:
                figs.failures.append(f"{prefix}.{name}: read {got['n']} of {rank.pages} pages, {wrong} wrong")
                break
            figs.add(f"{prefix}.{name}", gbps(rank.nbytes, seconds))
        rank.clear()


def run_dram(figs: Figures, args, progress: Progress, page_mib: int) -> None:
    pages = args.pages
    node = Node(os.path.join(args.work_dir, "dram"), node_toml([tier_toml("dram", pages * page_mib * MiB,
                                                                          page_mib * MiB)]))
    try:
        rank = Rank.tiered(node, page_mib, pages)
        copy = limits.Memcpy(page_mib * MiB)
        sample = lambda: figs.add(f"limit.memcpy.{page_mib}MiB", copy.sample(pages))  # noqa: E731
        rank.write(rank.keys(99))  # warm-up (connections, region registration), not timed
        rank.clear()
        measure(rank, figs, f"dram.{page_mib}MiB", args.repeat, progress, salt=1000,
                before={"write": sample, "read": sample})
        rank.close()
    finally:
        node.close()


def run_nvme(figs: Figures, args, progress: Progress, page_mib: int) -> None:
    pages = args.pages
    node = Node(os.path.join(args.work_dir, "nvme"), node_toml([tier_toml("nvme", pages * page_mib * MiB,
                                                                          page_mib * MiB)]))
    disk = limits.RawDisk(os.path.join(args.work_dir, "raw-disk"), page_mib * MiB)
    try:
        rank = Rank.tiered(node, page_mib, pages)
        rank.write(rank.keys(99))
        rank.clear()

        def raw_write():
            figs.add(f"limit.disk_write.{page_mib}MiB", disk.write(pages))

        def raw_read():
            figs.add(f"limit.disk_read_direct.{page_mib}MiB", disk.read(pages))
        measure(rank, figs, f"nvme.{page_mib}MiB", args.repeat, progress, salt=2000,
                before={"write": raw_write, "read": raw_read}, cold_dir=node.data_path("nvme"), warm=True)
        rank.close()
    finally:
        disk.clean(pages)
        node.close()


def run_remote(figs: Figures, args, progress: Progress, page_mib: int) -> None:
    pages, size = args.pages, page_mib * MiB
    te_pages = min(pages, 16)
    (port,) = free_ports(1)
    pool_capacity = 2 * pages * size + 3 * te_pages * size + 64 * MiB
    pool = Node(os.path.join(args.work_dir, "pool"), pool_config([port], capacity=f"{pool_capacity >> 20}MiB",
                                                                  block_size="1MiB", max_page_bytes=f"{page_mib}MiB"))
    try:
        te = limits.load_bench_remote()
        if te is None:
            figs.note("remote", "scripts/bench_remote.py is missing: no raw Transfer Engine figure.")
        else:
            progress.step(f"remote.{page_mib}MiB: raw Transfer Engine ({te_pages} pages)")
            raw = te.InProcess(port, size, te_pages)
            try:
                for _ in range(args.repeat):  # the better of the engine's blocking batch call and polling
                    for op, write in (("write", True), ("read", False)):
                        best = min(timed(lambda: raw.raw_sync(write)), timed(lambda: raw.raw_poll(write)))
                        figs.add(f"limit.te_{op}.{page_mib}MiB", gbps(te_pages * size, best))
                raw.check()
            finally:
                raw.close()
        node = Node(os.path.join(args.work_dir, "remote"),
                    node_toml([tier_toml("remote", pages * size, size, pool_port=port)]))
        try:
            rank = Rank.tiered(node, page_mib, pages)
            rank.write(rank.keys(99))
            rank.clear()
            measure(rank, figs, f"remote.{page_mib}MiB", args.repeat, progress, salt=3000)
            rank.close()
        finally:
            node.close()
    finally:
        pool.close()


def run_policies(figs: Figures, args, progress: Progress, page_mib: int) -> None:
    """The DRAM + NVMe chain under each write policy (reads come from DRAM)."""
    pages, size = args.pages, page_mib * MiB
    for policy in WRITE_POLICIES:
        node = Node(os.path.join(args.work_dir, "chain"),
                    node_toml([tier_toml("dram", pages * size, size), tier_toml("nvme", pages * size, size)],
                              write_policy=policy))
        try:
            rank = Rank.tiered(node, page_mib, pages)
            rank.write(rank.keys(99))
            rank.clear()
            measure(rank, figs, f"chain.{policy}.{page_mib}MiB", args.repeat, progress, salt=4000)
            rank.close()
        finally:
            node.close()
