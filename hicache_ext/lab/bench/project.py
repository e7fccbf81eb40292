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

from hicache_ext.lab.bench import memory_backend
from hicache_ext.lab.bench.rig import MiB, Node, Rank, drop_page_cache, node_toml, tier_capacity, tier_toml
from tiers.bench import limits
from tiers.bench.stats import Figures, Progress, gbps, size_label, timed
from tiers.stores.remote.loopback import free_ports, pool_config

WRITE_POLICIES = ("write_through", "write_back", "selective")


def measure(rank: Rank, figs: Figures, prefix: str, reps: int, progress: Progress, salt: int,
            before: Optional[Dict[str, Callable[[], None]]] = None, cold_dir: Optional[str] = None,
            warm: bool = False, read: bool = True) -> None:
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
        reads = ([("read", cold_dir)] if read else []) + ([("read_warm", None)] if warm else [])
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


def measure_full(rank: Rank, figs: Figures, prefix: str, reps: int, progress: Progress, salt: int,
                 capacity: int) -> None:
    """Writes into a full tier, the steady state of a cache: the tier filled past capacity bytes first
    (untimed), then each timed batch evicts its own size; figure prefix.write_full."""
    for fill in range(capacity // rank.nbytes + 1):
        rank.write(rank.keys(salt + 100 + fill))
    for rep in range(reps):
        progress.step(f"{prefix}: into a full tier, repetition {rep + 1}/{reps}")
        keys = rank.keys(salt + rep)
        done = {}
        seconds = timed(lambda: done.setdefault("n", rank.write(keys)))
        if done["n"] != rank.pages:
            figs.failures.append(f"{prefix}: wrote {done['n']} of {rank.pages} pages into a full tier")
            continue
        figs.add(f"{prefix}.write_full", gbps(rank.nbytes, seconds))
    rank.clear()


def _through_node(figs: Figures, args, progress: Progress, root: str, config: str, page: int, prefix: str,
                  salt: int, write_policy: Optional[str] = None, cold_tier: Optional[str] = None,
                  settings: Optional[dict] = None, full_capacity: int = 0, **kw) -> None:
    """Start the node's daemons, build a rank on them, warm up (untimed), measure (then, with full_capacity,
    into the full tier: measure_full), stop everything."""
    node = Node(os.path.join(args.work_dir, root), config)
    try:
        rank = Rank.tiered(node, page, args.pages, write_policy=write_policy, settings=settings)
        rank.write(rank.keys(99))  # connections, region registration, first touches: not timed
        rank.clear()
        cold = node.data_path(cold_tier) if cold_tier else None
        measure(rank, figs, prefix, args.repeat, progress, salt=salt, cold_dir=cold, **kw)
        if full_capacity:
            measure_full(rank, figs, prefix, args.repeat, progress, salt + 500, full_capacity)
        rank.close()
    finally:
        node.close()


def run_dram(figs: Figures, args, progress: Progress, size: int) -> None:
    label = size_label(size)
    copy, shared = limits.Memcpy(size), limits.Memcpy(size, shared=True)
    floor = SGLangFloor(figs, label, size, args.pages)

    def sample():
        figs.add(f"limit.memcpy.{label}", copy.sample(args.pages))
        figs.add(f"limit.memcpy_shm.{label}", shared.sample(args.pages))

    def before_write():
        sample()
        floor.write()

    def before_read():
        sample()
        floor.read()
    try:
        _through_node(figs, args, progress, "dram", node_toml([tier_toml("dram", args.pages * size, size)]), size,
                      f"dram.{label}", 1000, before={"write": before_write, "read": before_read},
                      full_capacity=tier_capacity(args.pages * size))
    finally:
        floor.close()


class SGLangFloor:
    """SGLang's own floor for a DRAM batch, sampled beside each of the tier's: the same page functions driving
    an in-process backend that copies each batch once, on one core, between the host pool and a dict of this
    process, with no daemon, wire or checksum (hicache_ext/lab/bench/memory_backend.py).  Our tier reads with
    two cores and can beat it; what it leaves of a target is what the page functions and a memfd's copy leave
    any backend.  Figures dram_floor.{label}.write / .read."""

    def __init__(self, figs: Figures, label: str, size: int, pages: int):
        self.figs, self.label = figs, label
        self.rank = Rank("dynamic", size, pages, memory_backend.extra_config())
        self.rank.write(self.rank.keys(1))  # the dict's arrays allocated and faulted in: not timed
        self.rank.clear()
        self._salt = 500
        self._keys: Optional[list] = None

    def write(self) -> None:
        self._salt += 1
        self._keys = self.rank.keys(self._salt)
        seconds = timed(lambda: self.rank.write(self._keys))
        self.figs.add(f"dram_floor.{self.label}.write", gbps(self.rank.nbytes, seconds))

    def read(self) -> None:
        if self._keys is None:
            return
        self.rank.zero()
        got = {}
        seconds = timed(lambda: got.setdefault("n", self.rank.read(self._keys)))
        if got["n"] != self.rank.pages or self.rank.wrong_pages(got["n"]):
            self.figs.failures.append(f"dram_floor.{self.label}: read {got['n']} of {self.rank.pages} pages or "
                                      "wrong bytes")
        else:
            self.figs.add(f"dram_floor.{self.label}.read", gbps(self.rank.nbytes, seconds))
        self.rank.clear()
        self._keys = None

    def close(self) -> None:
        self.rank.close()


def run_sealed(figs: Figures, args, progress: Progress, size: int) -> None:
    """The DRAM tier with every page sealed (AES-256-GCM) in the engine's process, beside AES alone."""
    label = size_label(size)
    aes = limits.AesGcm(size)

    def sample():
        seal, open_ = aes.sample(args.pages)
        figs.add(f"limit.aes_seal.{label}", seal)
        figs.add(f"limit.aes_open.{label}", open_)
    key_file = os.path.join(args.work_dir, "page.key")
    if not os.path.exists(key_file):
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
    # A sealed page is 28 bytes longer: the tier's max_page_bytes leaves room for it.
    tier = tier_toml("dram", args.pages * (size + 4096), size + 4096)
    _through_node(figs, args, progress, "sealed", node_toml([tier]),
                  size, f"sealed.{label}", 1500, settings={"page_key_file": key_file},
                  before={"write": sample})


def run_nvme(figs: Figures, args, progress: Progress, size: int) -> None:
    label = size_label(size)
    disk = limits.RawDisk(os.path.join(args.work_dir, "raw-disk"), size)
    def sample_writes():
        figs.add(f"limit.disk_write.{label}", disk.write(args.pages))
        figs.add(f"limit.disk_write_batch.{label}", disk.write_batch(args.pages))
        settle()
    before = {"write": sample_writes,
              "read": lambda: figs.add(f"limit.disk_read_direct.{label}", disk.read(args.pages))}
    figs.pair(f"nvme.{label}.write", f"limit.disk_write.{label}")  # each limit right before each repetition
    figs.pair(f"nvme.{label}.write", f"limit.disk_write_batch.{label}")
    figs.pair(f"nvme.{label}.read", f"limit.disk_read_direct.{label}")
    try:
        _through_node(figs, args, progress, "nvme", node_toml([tier_toml("nvme", args.pages * size, size)]),
                      size, f"nvme.{label}", 2000, cold_tier="nvme", before=before, warm=True)
        # Without fsync, as SGLang's file backend writes (its files stay in the page cache): writes only.
        _through_node(figs, args, progress, "nvme", node_toml([tier_toml("nvme", args.pages * size, size,
                                                                         fsync=False)]),
                      size, f"nvme_nofsync.{label}", 2500, read=False)
    finally:
        disk.clean(args.pages)


RAW_TE_BATCH_BYTES = 128 * MiB


def run_remote(figs: Figures, args, progress: Progress, size: int) -> None:
    pages, label = args.pages, size_label(size)
    # The raw engine moves the tier's own batch where the pool's memory allows (up to 128 MiB a batch: every
    # page size to 1 MiB): at small pages its fixed cost a transfer is amortised over the batch as the tier's is
    # (64 KiB pages, write / read: 2.39 / 3.04 GB/s on 128 pages in the 2026-11-27 23:21 run, 1.96 / 2.01 on 16
    # pages at 20:22).
    te_pages = min(pages, max(16, RAW_TE_BATCH_BYTES // size))
    (port,) = free_ports(1)
    pool_capacity = 2 * pages * size + 3 * te_pages * size + 64 * MiB
    pool = Node(os.path.join(args.work_dir, "pool"), pool_config([port], capacity=f"{pool_capacity >> 20}MiB",
                                                                  block_size="1MiB" if size >= MiB else "64KiB",
                                                                  max_page_bytes=f"{max(1, size // MiB)}MiB"))
    try:
        te = limits.load_bench_remote()
        if te is None:
            figs.note("remote", "scripts/bench_remote.py is missing: no raw Transfer Engine figure.")
        else:
            progress.step(f"remote.{label}: raw Transfer Engine ({te_pages} pages)")
            raw = te.InProcess(port, size, te_pages)
            try:
                for _ in range(args.repeat):  # the better of the engine's blocking batch call and polling
                    for op, write in (("write", True), ("read", False)):
                        best = min(timed(lambda: raw.raw_sync(write)), timed(lambda: raw.raw_poll(write)))
                        figs.add(f"limit.te_{op}.{label}", gbps(te_pages * size, best))
                raw.check()
            finally:
                raw.close()
        _through_node(figs, args, progress, "remote", node_toml([tier_toml("remote", pages * size, size,
                                                                           pool_port=port)]),
                      size, f"remote.{label}", 3000)
    finally:
        pool.close()


def settle() -> None:
    """Commit what the file system holds (the limits' unlinks, the last repetition's clear) before a timed
    write, as each limit does before its own: which blocks a write gets depends on what was freed and
    committed (ext4 reuses no block freed in an open transaction), and on this machine's virtio disk the
    batch limit at 1 MiB ran 2.2-2.3 GB/s when it followed the tier's clear unsynced, 1.3-1.5 after a sync:
    the tier's write and its limit must start from the same state."""
    os.sync()


def run_policies(figs: Figures, args, progress: Progress, size: int) -> None:
    """The DRAM + NVMe chain under each write policy (reads come from DRAM).

    write_through is bounded by its slowest tier, NVMe: a node of NVMe alone writes a batch of its own right
    before each of the chain's (chain.nvme_alone), so the two see the same disk; this machine's virtio disk
    moved between 1.5 and 4 GB/s from one minute to the next, and the NVMe part ran minutes earlier."""
    label = size_label(size)
    chain = node_toml([tier_toml("dram", args.pages * size, size), tier_toml("nvme", args.pages * size, size)])
    alone = Node(os.path.join(args.work_dir, "nvme-alone"), node_toml([tier_toml("nvme", args.pages * size, size)]))
    try:
        rank = Rank.tiered(alone, size, args.pages)
        rank.write(rank.keys(98))  # connections and first touches: not timed
        rank.clear()
        salt = [5000]

        def nvme_alone() -> None:
            settle()
            salt[0] += 1
            keys = rank.keys(salt[0])
            seconds = timed(lambda: rank.write(keys))
            figs.add(f"chain.nvme_alone.{label}.write", gbps(rank.nbytes, seconds))
            rank.clear()
            settle()
        figs.pair(f"chain.write_through.{label}.write", f"chain.nvme_alone.{label}.write")
        for policy in WRITE_POLICIES:
            _through_node(figs, args, progress, "chain", chain, size, f"chain.{policy}.{label}", 4000,
                          write_policy=policy, before={"write": nvme_alone if policy == "write_through" else settle})
        rank.close()
    finally:
        alone.close()
