"""The NVMe tier: verified chunk records (a put's in one batch file), bounded in on-disk bytes, evicting by policy.

Concurrency: the daemon calls put/get_into from its I/O pool.  The ledger's
lock guards only the index, the policy and the counters; file I/O runs
outside it.  Per-digest stripe locks order the two steps that must match
between disk and index for one key: "rename + commit" of a write and "unlink
unless re-added" of a delete, eviction or corruption removal.  Readers take
no stripe lock: a reader holding an open file keeps reading that file's inode
however it is renamed over or unlinked, and everything it reads is verified.

This module is the PageStore and its glue (start-up, the index rebuilt or
loaded, deletes, evictions, stats, close); a page's write is
tiers/stores/nvme/page_writes.py's, its read page_reads.py's, a batch's
batch_writes.py's and batch_reads.py's, and removal.py keeps the disk in
step with the index.
"""
from __future__ import annotations

import fcntl
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

from tiers.logs import RateLimitedLog
from tiers.stores.nvme import batch, chunkfile as cf, ledger_figures, snapshot
from tiers.stores.nvme.batch_reads import BatchReadSource, BatchReads
from tiers.stores.nvme.batch_writes import BUFFERED_BATCH_BYTES, BatchTarget, BatchWrites
from tiers.stores.nvme.ceiling import UsageCeiling
from tiers.stores.nvme.codec import Codec
from tiers.stores.nvme.dirsync import DirSyncer
from tiers.stores.nvme.rebuild import IndexBuild
from tiers.stores.nvme.layout import LeafDirs, key_digest, namespace_hash
from tiers.stores.nvme.page_reads import PageReadSource, PageReads
from tiers.stores.nvme.page_writes import PageWrites
from tiers.stores.nvme.recycle import RECYCLE_BYTES, RecycledFiles
from tiers.stores.nvme.removal import Removal
from tiers.wire.protocol import pack_key_digests
from tiers.stores.nvme.entry import Victim
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.base import (Buffers, EvictionListener, FillPages, OnFinal, PageKey, PageStore, StoreError,
                               StoreIOError, StoreStats)
from tiers.plugins import StoreKind
from tiers.stores.kind_options import KIND_OPTIONS

log = logging.getLogger("hicache.nvme")


class NvmeStore(PageStore):
    """Chunk files under a directory; capacity counts on-disk bytes (header + payload)."""

    parallel_io = True
    streams_reads = True  # each run of a get told of as it is read: the engine copies while the rest are read
    batched = True  # a put's pages go to disk as one batch chunk file with one flush (tiers/stores/nvme/batch.py)
    fills_in_parts = True  # tiers/stores/nvme/batch_writes.py
    persistent = True  # the index is rebuilt from the chunk files at start
    keeps_checksums = True  # in the chunk header (tiers/stores/nvme/chunkfile.py FLAG_PAGE_SUM)
    answers_digests = True  # the ledger is keyed by key_digest

    def __init__(self, path: str, capacity: int, policy: str = "lru", max_page_bytes: int = 64 << 20,
                 fsync: bool = True, compression: str = "none", compression_level: int = 1,
                 direct_io: bool = True, direct_writes: bool = False, io_threads: int = 4, name: str = "nvme",
                 index_snapshot: bool = True, recycle_bytes: Optional[int] = None,
                 quotas: Optional[dict] = None, evictions: Optional[EvictionListener] = None):
        if capacity < cf.HEADER_SIZE + 1:
            raise ValueError("capacity must hold at least one chunk")
        self.root = os.path.abspath(path)
        self.capacity = capacity
        self.max_page_bytes = max_page_bytes
        self.fsync = fsync
        self.name = name
        self.io_threads = io_threads  # the daemon's I/O pool size for this store (several reads in flight)
        self._codec = Codec(compression, compression_level)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._lock_fd: Optional[int] = self._lock_directory()
        self._direct = bool(direct_io) and self._probe_direct()
        # Writes go through the page cache unless asked: a buffered write + fdatasync measured 1.0-1.7x an
        # O_DIRECT one at 256 KiB-4 MiB here (docs/NVME.md); its pages are dropped once clean.
        self._direct_writes = bool(direct_writes)
        if self._direct and compression != "none":
            log.info("%s: direct_io applies to uncompressed chunks only", name)
        # Batch chunks give evicted pages' blocks back by punching holes; a file system that cannot keeps
        # them until the whole file goes, which the byte count would not see: a file a page there instead.
        self.batched = self._probe_punch()
        # Dead batch files are written over by the next batch of their size (tiers/stores/nvme/recycle.py)
        # unless recycle_bytes is 0: kept within the index's room, they cost the cache nothing.  Dead records left
        # in place in live files do: up to recycle_bytes of them (an eighth of the capacity at most; None:
        # RECYCLE_BYTES where that is a 64th or less, else none) come out of what the index may hold, so the disk
        # holds the capacity at most.
        recycling = self.batched and compression == "none" and recycle_bytes != 0
        if recycle_bytes is None:
            recycle_bytes = RECYCLE_BYTES if capacity >= 64 * RECYCLE_BYTES else 0
        left_in_place = min(max(0, recycle_bytes), capacity // 8) if recycling else 0
        pages_capacity = capacity - left_in_place
        self._ledger = Ledger(self.root, pages_capacity, policy, quotas,
                              ceiling=UsageCeiling(self.root, pages_capacity))
        self._recycled = RecycledFiles(self._ledger, left_in_place, ready=lambda: self._build.done.is_set(),
                                       on=recycling)
        self._ledger.dead_bytes.spares = self._recycled
        self._snapshots = index_snapshot
        self._dirsync = DirSyncer()
        warn_once = RateLimitedLog(log, interval=math.inf)  # each kind once per store
        rlog = RateLimitedLog(log)
        self._removal = Removal(name, self._ledger, self._codec, evictions, rlog, self._recycled)
        self._readers = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-read")
        self._writers = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-write")
        self._dirs = LeafDirs()
        # Batch files go to the device with O_DIRECT while the next part is prepared, then one flush; without
        # fsync, small ones go through the page cache (batch_writes.BUFFERED_BATCH_BYTES).
        puts = BatchTarget(
            name, self.root, pages_capacity, max_page_bytes, fsync, self._ledger, self._codec, self._writers,
            self._dirsync, direct=lambda: self._direct, discard=self._removal.discard_many,
            replaced=self._removal.replaced, buffered_up_to=0 if fsync or self._direct_writes else BUFFERED_BATCH_BYTES,
            recycled=self._recycled)
        self._page_writes = PageWrites(puts, self._dirs, self._removal, warn_once, self._direct_writes,
                                       self._refuse_direct)
        self._page_reads = PageReads(PageReadSource(
            name, self._ledger, self._codec, self._removal, warn_once, rlog,
            direct=lambda: self._direct, refuse_direct=self._refuse_direct))
        self._batches = BatchWrites(puts)
        self._reads = BatchReads(BatchReadSource(self._ledger, self._readers, max(1, io_threads),
                                                 lambda: self._direct, self.get_into_with_sum))
        self._rebuild()

    @classmethod
    def from_config(cls, tier, quotas: Optional[dict] = None,
                    evictions: Optional[EvictionListener] = None) -> "NvmeStore":
        """Build the store a tiers.ops.config.TierConfig of kind nvme describes."""
        opt = {k: tier.options[k] if k in tier.options else parser(default, k)
               for k, (parser, default, _help) in KIND_OPTIONS["nvme"].items()}
        if not opt["path"]:
            raise ValueError(f"nvme tier {tier.name}: options.path is required")
        return cls(opt["path"], tier.capacity, policy=tier.policy, max_page_bytes=tier.max_page_bytes,
                   fsync=opt["fsync"], compression=opt["compression"], compression_level=opt["compression_level"],
                   direct_io=opt["direct_io"], direct_writes=opt["direct_writes"], io_threads=opt["io_threads"],
                   index_snapshot=opt["index_snapshot"], recycle_bytes=opt["recycle_bytes"], name=tier.name,
                   quotas=quotas,
                   evictions=evictions)

    # ------------------------------------------------------------ start-up
    def _lock_directory(self) -> int:
        # Two stores on one directory would delete each other's temp files.
        fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreIOError(f"{self.root} is in use by another store") from None
        return fd

    def _probe_direct(self) -> bool:
        probe = os.path.join(self.root, ".direct-probe.tmp")
        try:
            cf.write_file(probe, [cf.header_block("write")], fsync=False, direct=True)
        except OSError as exc:
            log.warning("%s: direct_io off: %s refuses O_DIRECT (%s); using buffered I/O",
                        self.name, self.root, exc.strerror)
            return False
        cf.unlink_quietly(probe)
        return True

    def _probe_punch(self) -> bool:
        probe = os.path.join(self.root, ".punch-probe.tmp")
        try:
            cf.write_file(probe, [memoryview(bytes(2 * cf.ALIGN))], fsync=False, direct=False)
            ok = batch.punch(probe, 0, 1)
        except OSError:
            ok = False
        cf.unlink_quietly(probe)
        if not ok:
            log.warning("%s: %s cannot punch holes; a file a page (slower writes)", self.name, self.root)
        return ok

    def _rebuild(self) -> None:
        """Index the chunk files: from the snapshot of a clean shutdown, else by a scan (at once for a small
        directory, else in the background while serving)."""
        self._build = IndexBuild(self.root, self._ledger, self.name, self._dirs, self._removal.discard,
                                 self._removal.unlink_stale, self._batches.writing)
        started = time.perf_counter()
        self._ledger.ceiling.load()  # what a scan may find on disk at most (tiers/stores/nvme/ceiling.py)
        loaded = snapshot.load(self.root, self._ledger, self._dirs) if self._snapshots else None
        if loaded is not None:
            self._ledger.extra.update(rebuild_seconds=time.perf_counter() - started, rebuild_files=loaded,
                                      snapshot_loaded=1.0)
            self._build.done.set()
            log.info("%s: index of %d chunks loaded from the snapshot of the last clean shutdown in %.2f s",
                     self.name, loaded, time.perf_counter() - started)
            held_at_most = self._ledger.capacity
            for victim in self._ledger.evict_bytes(self._ledger.used - held_at_most, full_disk=False) \
                    if self._ledger.used > held_at_most else ():
                self._removal.discard(*victim)  # capacity lowered since
            self._ledger.settle_ceiling()
        elif not self._build.start():
            log.info("%s: serving while the index is rebuilt in the background (chunks not yet indexed miss)",
                     self.name)
        try:
            st = os.statvfs(self.root)
            if self.capacity > self._ledger.used + st.f_bavail * st.f_frsize:
                log.warning("%s: capacity %d bytes exceeds the free space of %s; a full disk will evict",
                            self.name, self.capacity, self.root)
        except OSError:
            pass

    def _refuse_direct(self) -> None:
        """The device refused O_DIRECT: buffered I/O from now on, for reads and writes alike."""
        self._direct = False

    # ------------------------------------------------------------ writing
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        self._page_writes.put(key, buffers, parent, checksum)

    # ------------------------------------------------------------ reading
    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        return self._page_reads.get_into(key, buffers)

    def get_bytes(self, key: PageKey) -> Optional[bytearray]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytearray], int]:
        return self._page_reads.get_bytes(key)

    # ---------------------------------------------------------- the rest
    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        return [b != 0 for b in self._ledger.held([key_digest(ns, k) for ns, k in keys])]

    def held(self, namespace: str, keys: List[str]) -> bytes:
        return self._ledger.held_packed(pack_key_digests(namespace, keys))

    def held_digests(self, namespace: str, digests: bytes) -> bytes:
        return self._ledger.held_packed(digests)

    def _remove(self, digests: Iterable[int]) -> int:
        # Their bytes stay counted until their files or records are gone: a put meanwhile gets no room they
        # still take on disk.
        victims: List[Victim] = self._ledger.pop_many(digests, held=True)
        self._removal.discard_many(victims, held=True)  # a batch file's records punched together (a call a file)
        self._ledger.settle_ceiling(slack_steps=2)  # a clear of a full tier: a restart then need not assume it full
        return len(victims)

    def delete(self, keys: Iterable[PageKey]) -> int:
        return self._remove([key_digest(ns, k) for ns, k in keys])

    def clear(self, namespace: Optional[str] = None) -> int:
        ns_hash = None if namespace is None else namespace_hash(namespace)
        self._ledger.cleared(ns_hash)  # chunks the rebuild has not reached yet go too
        return self._remove(self._ledger.digests(ns_hash))

    def assign_tenant(self, namespace: str, tenant: str, quota: Optional[int] = None) -> None:
        self._ledger.assign_tenant(namespace_hash(namespace), tenant, quota)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        victims = self._ledger.evict_bytes(nbytes, None if namespace is None else namespace_hash(namespace),
                                           full_disk=False)
        self._removal.discard_many(victims, evicted=True)
        self._ledger.settle_ceiling(slack_steps=2)
        return len(victims), sum(entry.disk_size for _d, entry in victims)

    # ---------------------------------------------------- batch chunks
    def put_many_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                           parents: Sequence[Optional[str]], deadline: Optional[float],
                           checksums: Sequence[int],
                           page_sums: Optional[Sequence[int]] = None) -> List[Optional[StoreError]]:
        """A put's pages into batch chunk files, each written sequentially with one flush
        (tiers/stores/nvme/batch_writes.py); None or the refusal of each page.  page_sums (the base's
        declaration): the bytes are not hashed again."""
        if deadline is not None and time.time() > deadline:  # the engine stopped waiting: store nothing
            return [StoreIOError(f"{self.name}: the put's deadline passed before it was written")] * len(keys)
        if not self.batched:
            return [self._put_one(k, p, parent, c) for k, p, parent, c in zip(keys, pages, parents, checksums)]
        return self._batches.put_many(keys, pages, parents, checksums, page_sums)

    def put_many_filled(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                        parents: Sequence[Optional[str]], deadline: Optional[float],
                        checksums: Optional[Sequence[int]], fill: FillPages,
                        aligned: bool = False) -> List[Optional[StoreError]]:
        """Each part of a batch chunk filled just before it is prepared: the daemon's copy of part k+1 out of
        the engine's memory overlaps the device writing part k."""
        if not self.batched:
            return super().put_many_filled(keys, pages, parents, deadline, checksums, fill, aligned)
        if deadline is not None and time.time() > deadline:  # each page refused, nothing filled
            return self.put_many_with_sums(keys, pages, parents, deadline, [0] * len(keys))
        return self._batches.put_many(keys, pages, parents, checksums, fill=fill, aligned=aligned)

    def put_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], parents: Sequence[Optional[str]],
                 deadline: Optional[float]) -> List[Optional[StoreError]]:
        return self.put_many_with_sums(keys, pages, parents, deadline, [0] * len(keys))

    def get_many_into(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                      deadline: Optional[float]) -> List[bool]:
        return [s is not None for s in self.get_many_into_with_sums(keys, pages, deadline)]

    def _put_one(self, key, page, parent, checksum) -> Optional[StoreError]:
        try:
            self.put_with_sum(key, page, parent if isinstance(parent, str) else None, checksum)
            return None
        except StoreError as exc:
            return exc

    def get_many_into_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                                deadline: Optional[float] = None, hold=None) -> List[Optional[int]]:
        """Each page's checksum (0: unknown), None for a miss; nothing moves into the buffers once this
        returns.  Adjacent records of one batch file are read with one preadv a run, several runs and pages
        at once (tiers/stores/nvme/batch_reads.py)."""
        return self._reads.get_many(keys, pages, deadline)

    def get_many_streamed(self, keys: Sequence[PageKey], pages: Sequence[Buffers], deadline: Optional[float],
                          on_final: OnFinal, hold=None) -> None:
        """As get_many_into_with_sums, each run of pages told of as its read ends (PageStore); every read
        started is waited for, so nothing is ever held."""
        self._reads.get_many(keys, pages, deadline, on_final)

    def index_bytes(self) -> int:
        return ledger_figures.index_bytes(self._ledger)

    def namespace_figures(self, namespace: str) -> Optional[dict]:
        return ledger_figures.namespace_figures(self._ledger, namespace_hash(namespace))

    def stats(self) -> StoreStats:
        snap = ledger_figures.stats(self._ledger)
        snap.extra.update(direct_io=float(self._direct), direct_writes=float(self._direct and self._direct_writes),
                          fsync=float(self.fsync), dir_syncs=self._dirsync.syncs,
                          recycled_bytes=self._recycled.nbytes, recycled_kept=self._recycled.kept,
                          recycled_reused=self._recycled.reused)
        return snap

    def close(self) -> None:
        """Save the index for the next start (when it is whole) and release the directory lock; every
        acknowledged chunk is already in its file."""
        self._build.stop()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._recycled.drain()  # the next start's index will not know them
        if self._snapshots and self._build.done.is_set() and self._lock_fd is not None:
            try:
                rows = snapshot.save(self.root, self._ledger, self._dirs)
                if rows is not None:
                    log.info("%s: index of %d chunks saved for the next start", self.name, rows)
            except OSError as exc:  # the next start scans instead
                log.warning("%s: could not save the index snapshot: %s", self.name, exc)
        if self._build.done.is_set() and self._lock_fd is not None:
            self._ledger.settle_ceiling()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# The nvme kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS["nvme"]).
KIND = StoreKind("nvme", NvmeStore.from_config, description="a put's pages in one checksummed file, fsync'd")
