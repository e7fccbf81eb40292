"""An NVMe tier restarted over many chunks: how soon it serves, how long until its index is complete.

The chunk directory is filled fast: a few real pages through the daemon, the
rest as hard links of one small chunk file under the names (and fan-out
directories) real keys would have.  The rebuild trusts names and sizes, so
the scan costs what a real directory of that many chunks costs; a linked name
would fail its checksum on read (the header names another key), which this
part never does.  Figures: seconds from the daemon's spawn to its first
answered lookup (serving), and to the end of the background index build,
first after a crash (the daemon scans every name), then after a clean stop
(it loads the index snapshot it saved); the index's RAM a chunk: the
daemon's anonymous RSS over the directory less what it held over the few
real pages before, once whole (steady) and the most sampled every 50 ms
while the index was built (peak).
"""
from __future__ import annotations

import errno
import os
import time

from hicache_ext.lab.bench.rig import KiB, Node, Rank, node_toml, tier_toml
from tiers.bench.stats import Figures, Progress, percentile
from tiers.stores.nvme.layout import chunk_path, key_digest, namespace_hash
from tiers.wire.client import TierClient

REAL_PAGES = 16


def run_restart(figs: Figures, args, progress: Progress) -> None:
    chunks = args.restart_chunks
    page = 64 * KiB
    # Capacity for every linked name at the template's size (the links take no space; an index over
    # capacity would evict them at the end of the rebuild).
    config = node_toml([tier_toml("nvme", chunks * (page + 8 * KiB) + 256 * (1 << 20), page)])
    node = Node(os.path.join(args.work_dir, "restart"), config)
    try:
        rank = Rank.tiered(node, page, REAL_PAGES)
        namespace = rank.backend.namespace
        keys = rank.keys(42)
        rank.close()
        # As frames, a page a put: each page is a chunk file of its own, the template the names link to (a
        # batch from a host pool goes into one batch file).
        writer = TierClient("nvme", node.runner.config.tier("nvme").endpoint, namespace, "restart-bench")
        try:
            stored = sum(writer.put_frames([key], [[os.urandom(page)]], page) == [True] for key in keys)
        finally:
            writer.close()
        if stored != REAL_PAGES:
            figs.failures.append(f"restart: stored {stored} of {REAL_PAGES} real pages")
            return
        empty_rss = anon_rss(node.runner.pid("nvme"))  # the daemon over the real pages only
        node.runner.kill("nvme")  # a crash: no index snapshot, so the next start scans what is linked below
        root = node.data_path("nvme")
        template = _any_chunk(root)
        progress.step(f"restart: linking {chunks:,} chunk names")
        _link_names(root, template, namespace, chunks - REAL_PAGES, progress)
        os.sync()
        for label, how in (("restart", "after a crash (a scan)"), ("restart.clean", "after a clean stop (the snapshot)")):
            progress.step(f"restart: starting the NVMe daemon over {chunks:,} chunks {how}")
            got = _start_and_watch(node, namespace)
            if got["lookups"]:
                figs.set(f"{label}.lookup_during.p50", percentile(got["lookups"], 50) * 1e6, "us")
                figs.set(f"{label}.lookup_during.p99", percentile(got["lookups"], 99) * 1e6, "us")
            figs.set(f"{label}.lookup_during.unanswered", float(got["unanswered"]), "calls")
            figs.set(f"{label}.serving_s", got["serving"], "s")
            figs.set(f"{label}.indexed_s", got["indexed"], "s")
            figs.set(f"{label}.scan_s", got["stats"].get("rebuild_seconds", 0.0), "s")
            figs.set(f"{label}.chunks", float(got["stats"].get("rebuild_files", 0)), "chunks")
            figs.set(f"{label}.rss_per_chunk", (got["steady_rss"] - empty_rss) / chunks, "B")
            figs.set(f"{label}.rss_per_chunk_peak", (got["peak_rss"] - empty_rss) / chunks, "B")
            figs.set(f"{label}.index_bytes_per_chunk", float(got["stats"].get("index_bytes", 0)) / chunks, "B")
            if got["stats"].get("rebuild_files") != chunks:
                figs.failures.append(f"{label}: indexed {got['stats'].get('rebuild_files')} of {chunks} chunks")
            node.runner.stop("nvme")  # graceful: the daemon saves its index for the next start
    finally:
        node.close()


def _start_and_watch(node: Node, namespace: str) -> dict:
    """Spawn the NVMe daemon; seconds to its first answered lookup and to a whole index, 128-key lookups
    meanwhile (inf: unanswered), its anonymous RSS once whole and the most sampled before."""
    spawned = time.monotonic()
    node.runner.start(timeout=600.0)
    pid = node.runner.pid("nvme")
    peak_rss, last_rss = 0, 0.0
    client = TierClient("nvme", node.runner.config.tier("nvme").endpoint, namespace)
    probe_keys = [f"restart-{i}" for i in range(128)]
    try:
        while client.lookup(["probe"]) is None:
            time.sleep(0.01)
        serving = time.monotonic() - spawned
        # Lookups while the index is rebuilt: the latency an engine sees from a restarting tier.
        during, stats, last_stats = [], {}, 0.0
        while True:
            if time.monotonic() - last_rss > 0.05:
                last_rss = time.monotonic()
                peak_rss = max(peak_rss, anon_rss(pid))
            start = time.perf_counter()
            answered = client.lookup(probe_keys) is not None
            during.append(time.perf_counter() - start if answered else float("inf"))
            if time.monotonic() - last_stats > 0.5 or not stats:
                last_stats = time.monotonic()
                stats = client.stats() or {}
                if stats.get("index_building", 1.0) == 0.0:
                    break
            time.sleep(0.002)
        indexed = time.monotonic() - spawned
        steady_rss = anon_rss(pid)
    finally:
        client.close()
    return {"serving": serving, "indexed": indexed, "stats": stats, "steady_rss": steady_rss,
            "peak_rss": max(peak_rss, steady_rss), "unanswered": sum(1 for d in during if d == float("inf")),
            "lookups": [d for d in during if d != float("inf")]}


def anon_rss(pid: int) -> int:
    """Anonymous resident bytes of a process (RssAnon: the heap and the index, not mapped files)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _copy_of(path: str, n: int) -> str:
    copy = f"{path}.template-{n}"  # not a chunk name: the scan leaves it alone
    with open(path, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    return copy


def _any_chunk(root: str) -> str:
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".kv"):
                return os.path.join(directory, name)
    raise RuntimeError(f"no chunk file under {root}")


def _link_names(root: str, template: str, namespace: str, count: int, progress: Progress) -> None:
    """count hard links of template, each under the path of a key of namespace (its fan-out directory)."""
    ns_hash = namespace_hash(namespace)
    original, copies = template, 0
    made = set()
    step = max(1, count // 20)
    for i in range(count):
        path = chunk_path(root, ns_hash, key_digest(namespace, f"restart-{i}"))
        leaf = os.path.dirname(path)
        if leaf not in made:
            os.makedirs(leaf, exist_ok=True)
            made.add(leaf)
        try:
            os.link(template, path)
        except OSError as exc:
            if exc.errno != errno.EMLINK:
                raise
            copies += 1  # a file takes ~65,000 names (ext4): link a fresh copy from here
            template = _copy_of(original, copies)
            os.link(template, path)
        if i % step == 0:
            progress.step(f"restart: linked {i:,} of {count:,} chunk names")
