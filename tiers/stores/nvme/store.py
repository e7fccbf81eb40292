"""The NVMe tier: verified chunk records (a put's in one batch file), bounded in on-disk bytes, evicting by policy.

Concurrency: the daemon calls put/get_into from its I/O pool.  The ledger's
lock guards only the index, the policy and the counters; file I/O runs
outside it.  Per-digest stripe locks order the two steps that must match
between disk and index for one key: "rename + commit" of a write and "unlink
unless re-added" of a delete, eviction or corruption removal.  Readers take
no stripe lock: a reader holding an open file keeps reading that file's inode
however it is renamed over or unlinked, and everything it reads is verified.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

from tiers.shm.buffers import as_bytes_view
from tiers.logs import RateLimitedLog
from tiers.stores.nvme import batch, chunkfile as cf, snapshot
from tiers.stores.nvme.batch_reads import TOUCH_INTERVAL, BatchReadSource, BatchReads
from tiers.stores.nvme.batch_writes import BatchTarget, BatchWrites
from tiers.stores.nvme.codec import Codec
from tiers.stores.nvme.dirsync import DirSyncer
from tiers.stores.nvme.rebuild import IndexBuild
from tiers.stores.nvme.layout import LeafDirs, chunk_path, key_digest, namespace_hash, temp_path
from tiers.wire.protocol import pack_key_digests
from tiers.stores.nvme.ledger import Entry, Ledger, Victim
from tiers.stores.base import (Buffers, EvictionListener, FillPages, PageKey, PageStore, PageTooLarge, StoreError,
                               StoreFull, StoreIOError, StoreStats, total_size)
from tiers.plugins import StoreKind
from tiers.stores.kind_options import KIND_OPTIONS

log = logging.getLogger("hicache.nvme")
N_STRIPES = 64
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A read that fails for want of a resource says nothing about the page on disk: a miss, the page kept
# (forgetting it lost an acknowledged page to a moment without descriptors or memory).
_TRANSIENT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EBUSY,
                     errno.ENOBUFS)


class NvmeStore(PageStore):
    """Chunk files under a directory; capacity counts on-disk bytes (header + payload)."""

    parallel_io = True
    batched = True  # a put's pages go to disk as one batch chunk file with one flush (tiers/stores/nvme/batch.py)
    fills_in_parts = True  # tiers/stores/nvme/batch_writes.py
    persistent = True  # the index is rebuilt from the chunk files at start
    keeps_checksums = True  # in the chunk header (tiers/stores/nvme/chunkfile.py FLAG_PAGE_SUM)
    answers_digests = True  # the ledger is keyed by key_digest

    def __init__(self, path: str, capacity: int, policy: str = "lru", max_page_bytes: int = 64 << 20,
                 fsync: bool = True, compression: str = "none", compression_level: int = 1,
                 direct_io: bool = True, direct_writes: bool = False, io_threads: int = 4, name: str = "nvme",
                 index_snapshot: bool = True,
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
        self._ledger = Ledger(self.root, capacity, policy, quotas)
        self._snapshots = index_snapshot
        self._stripes = [threading.Lock() for _ in range(N_STRIPES)]
        self._dirsync = DirSyncer()
        self._warn_once = RateLimitedLog(log, interval=math.inf)  # each kind once per store
        self._rlog = RateLimitedLog(log)
        # Hears of each evicted chunk before its file is removed: the daemon may demote it further.
        self._evictions = evictions
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
        self._readers = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-read")
        self._writers = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-write")
        self._batches = BatchWrites(BatchTarget(
            name, self.root, capacity, max_page_bytes, fsync, self._ledger, self._codec, self._writers, self._dirsync,
            direct=lambda: self._direct, discard=self._discard_many, replaced=self._replaced))
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
                   index_snapshot=opt["index_snapshot"], name=tier.name, quotas=quotas,
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
        self._dirs = LeafDirs()
        self._build = IndexBuild(self.root, self._ledger, self.name, self._dirs, self._discard, self._unlink_stale)
        started = time.perf_counter()
        loaded = snapshot.load(self.root, self._ledger, self._dirs) if self._snapshots else None
        if loaded is not None:
            self._ledger.extra.update(rebuild_seconds=time.perf_counter() - started, rebuild_files=loaded,
                                      snapshot_loaded=1.0)
            self._build.done.set()
            log.info("%s: index of %d chunks loaded from the snapshot of the last clean shutdown in %.2f s",
                     self.name, loaded, time.perf_counter() - started)
            for victim in self._ledger.evict_bytes(self._ledger.used - self.capacity, full_disk=False) \
                    if self._ledger.used > self.capacity else ():
                self._discard(*victim)  # capacity lowered since
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

    # ------------------------------------------------------------- helpers
    def _stripe(self, digest: int) -> threading.Lock:
        return self._stripes[digest % N_STRIPES]

    def _discard(self, digest: int, entry: Entry, evicted: bool = False) -> None:
        """Delete the file (or batch record) of a chunk already out of the index, unless the key was re-added
        into the same file."""
        if evicted and self._evictions is not None:
            self._notify_evict(entry)
        if entry.file:  # its own record, whatever came since: a newer version lies elsewhere
            self._give_back(entry)
            return
        with self._stripe(digest):
            if digest not in self._ledger:  # else a newer version was renamed over the file already
                cf.unlink_quietly(entry.path)

    def _give_back(self, entry: Entry) -> None:
        """A batch record's blocks back to the file system; the file goes with its last record."""
        self._give_back_many([entry])

    def _give_back_many(self, entries: List[Entry]) -> None:
        """Batch records' blocks back, each file opened once and adjacent records punched as one range (the
        victims of a batch are mostly the oldest records of one file); a file goes with its last record."""
        by_file: dict = {}
        for entry in entries:
            by_file.setdefault(entry.path, []).append((entry.block, -(-entry.disk_size // cf.ALIGN)))
        for path, ranges in by_file.items():
            try:
                if batch.punch_ranges(path, ranges) is False:
                    cf.unlink_quietly(path)
            except OSError as exc:
                self._rlog.warning("punch", "%s: giving back pages of %s: %s", self.name, path, exc.strerror)

    def _discard_many(self, victims: List[Victim], evicted: bool = False) -> None:
        """_discard for many chunks: the batch records among them given back together."""
        records = []
        for digest, entry in victims:
            if not entry.file:
                self._discard(digest, entry, evicted)
                continue
            if evicted and self._evictions is not None:
                self._notify_evict(entry)
            records.append(entry)
        if records:
            self._give_back_many(records)

    def _unlink_stale(self, digest: int, entry: Entry) -> None:
        """A chunk the rebuild found after its page was deleted, evicted or cleared: gone, unless re-added."""
        self._discard(digest, entry)

    def _notify_evict(self, entry: Entry) -> None:
        try:
            hdr = cf.read_header(entry.path, _block(entry))  # the index keeps no key text: the header names the page
            key = (hdr.namespace, hdr.key)
            buf = bytearray(hdr.raw_len)
            hdr = cf.read_chunk(entry.path, *key, [memoryview(buf)], hdr.raw_len, self._codec.decode, False,
                                _block(entry))
        except (OSError, cf.CorruptChunk, cf.SizeMismatch):
            return  # nothing sound to hand on
        self._evictions.page_evicted(key, [memoryview(buf)], entry.reads, hdr.page_sum)

    def _forget(self, digest: int, entry: Entry, ino: Optional[int], why: str) -> None:
        """Drop a chunk that cannot be served; unlink its file if it is still the one that was read."""
        removed = False
        if entry.file:  # a record of a batch chunk: its blocks go back, the other records stay
            dropped = self._ledger.drop(digest, entry, corrupt=ino is not None)
            if dropped:
                self._give_back(entry)
                self._rlog.warning("corrupt" if ino is not None else "lost", "%s: dropped a page of %s: %s",
                                   self.name, entry.path, why)
            return
        with self._stripe(digest):
            if ino is not None:
                try:
                    if os.stat(entry.path).st_ino == ino:
                        removed = cf.unlink_quietly(entry.path)
                except FileNotFoundError:
                    pass
            dropped = self._ledger.drop(digest, entry, corrupt=removed)
        if removed:
            self._rlog.warning("corrupt", "%s: removed %s: %s", self.name, entry.path, why)
        elif dropped:  # not a race with an eviction or overwrite: the file went behind our back
            self._rlog.warning("lost", "%s: forgot %s: %s", self.name, entry.path, why)

    # ------------------------------------------------------------ writing
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        src = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
        size = total_size(src)
        if size == 0 or size > self.max_page_bytes:
            raise PageTooLarge(f"page of {size} bytes not accepted (max {self.max_page_bytes})")
        namespace, name = key
        digest, ns_hash = key_digest(namespace, name), namespace_hash(namespace)
        encoded = self._codec.encode(src, size)  # CPU work before the reservation: its size is exact
        payload = src if encoded is None else [memoryview(encoded)]
        stored = total_size(payload)
        disk = cf.HEADER_SIZE + stored
        if disk > self.capacity:
            raise PageTooLarge(f"chunk of {disk} bytes exceeds capacity {self.capacity}")
        path = chunk_path(self.root, ns_hash, digest)
        payload_sum = cf.payload_hash(payload)
        # The writer's checksum is checked where it costs nothing (a raw payload's checksum is the page's):
        # bytes that changed on their way here are refused, never stored under the writer's sum.
        if checksum and checksum != (payload_sum if encoded is None else cf.payload_hash(src)):
            self._ledger.count("checksum_refused")
            raise StoreIOError(f"{self.name}: the page's bytes do not match the writer's checksum")
        header = cf.pack_header(cf.header_block("write"), namespace, name, 0 if encoded is None else
                                self._codec.codec_id, size, stored, payload_sum, checksum)
        try:
            for victim in self._ledger.reserve(disk, ns_hash, namespace):
                self._discard(*victim, evicted=True)
        except StoreFull as exc:
            raise StoreFull(f"{self.name}: {exc}") from None
        try:
            tmp = self._write_temp(path, [header, *payload], encoded is None, disk)
            self._rename_commit(digest, tmp, path, (ns_hash, namespace, disk, size, max(1, int(time.monotonic()))),
                                key_digest(namespace, parent) if parent else None)
        except BaseException:
            self._ledger.release(disk, ns_hash)
            raise
        if self.fsync:
            try:
                self._dirsync.sync(os.path.dirname(path))
            except OSError as exc:
                raise StoreIOError(f"{self.name}: fsync of {os.path.dirname(path)}: {exc.strerror}") from None
        self._ledger.wrote(size, stored)

    def _write_temp(self, path: str, views: List[memoryview], raw: bool, disk: int) -> str:
        """Write views to a fresh temp file next to path; one eviction-and-retry on a full disk."""
        wanted = self._direct and self._direct_writes and raw
        direct = wanted and cf.is_aligned(views)
        if wanted and not direct:
            self._ledger.count("unaligned_writes")  # e.g. pages that came as ZeroMQ frames
            self._warn_once.warning("unaligned", "%s: page buffers not %d-byte aligned; buffered I/O for such pages",
                            self.name, cf.ALIGN)
        for attempt in (0, 1):
            tmp = temp_path(path)
            try:
                self._ensure_dir(os.path.dirname(path))
                cf.write_file(tmp, views, self.fsync, direct)
                return tmp
            except OSError as exc:
                if exc.errno == errno.EINVAL and direct:
                    self._warn_once.warning("einval", "%s: O_DIRECT write refused (%s); buffered I/O from now on",
                                    self.name, exc.strerror)
                    self._direct = False
                    return self._write_temp(path, views, raw, disk)
                if exc.errno == errno.ENOENT and not attempt:  # fan-out directory removed behind our back
                    self._dirs.discard(os.path.dirname(path))
                    continue
                if exc.errno not in _FULL_ERRNOS:
                    raise StoreIOError(f"{self.name}: writing {tmp}: {exc.strerror}") from None
                if attempt:
                    raise StoreFull(f"{self.name}: no space left on device after eviction") from None
                self._warn_once.warning("enospc", "%s: device full below the configured capacity; evicting", self.name)
                if disk > self._reclaimable():  # evicting everything would not make room: refuse now
                    raise StoreFull(f"{self.name}: chunk of {disk} bytes exceeds the space of the device") from None
                victims = self._ledger.evict_bytes(disk)
                if not victims:
                    raise StoreFull(f"{self.name}: no space left on device") from None
                for victim in victims:
                    self._discard(*victim, evicted=True)
        raise StoreFull(f"{self.name}: no space left on device")  # not reached: the loop returns or raises

    def _reclaimable(self) -> int:
        """Free bytes on the device plus the bytes our chunks occupy."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return self.capacity
        return st.f_bavail * st.f_frsize + self._ledger.used

    def _ensure_dir(self, leaf: str) -> None:
        if leaf in self._dirs:
            return
        os.makedirs(leaf, mode=0o700, exist_ok=True)
        if self.fsync:  # the new directory entries must survive a crash with the files in them
            cf.fsync_dir(os.path.dirname(leaf))
            cf.fsync_dir(self.root)
        self._dirs.add(leaf)

    def _rename_commit(self, digest: int, tmp: str, path: str, chunk: Tuple[int, str, int, int, int],
                       parent: Optional[int]) -> None:
        """Rename the written chunk into place and index it: chunk is (ns_hash, namespace, disk bytes, page
        bytes, stamp), as Ledger.commit takes them."""
        with self._stripe(digest):
            try:
                os.rename(tmp, path)
            except OSError as exc:
                cf.unlink_quietly(tmp)
                cls = StoreFull if exc.errno in _FULL_ERRNOS else StoreIOError
                raise cls(f"{self.name}: rename to {path}: {exc.strerror}") from None
            replaced = self._ledger.commit(digest, *chunk, parent)
        if replaced is not None and replaced.file:  # the older version lay in a batch chunk
            self._give_back(replaced)

    # ------------------------------------------------------------ reading
    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        dst = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
        size = total_size(dst)
        digest = key_digest(*key)
        entry = self._ledger.get(digest)
        if entry is None or size == 0 or (entry.raw_size is not None and entry.raw_size != size):
            self._ledger.miss()
            return None
        return self._read(key, digest, entry, dst, size)

    def get_bytes(self, key: PageKey) -> Optional[bytearray]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytearray], int]:
        digest = key_digest(*key)
        entry = self._ledger.get(digest)
        if entry is None:
            self._ledger.miss()
            return None, 0
        size = entry.raw_size
        if size is None:  # rebuilt entry of unknown page size: its header says
            try:
                size = cf.read_header(entry.path, _block(entry)).raw_len
            except (OSError, cf.CorruptChunk):
                size = 0  # _read finds the same fault, reports it and cleans up
        buf = bytearray(size)
        checksum = self._read(key, digest, entry, [memoryview(buf)], size)
        return (buf, checksum) if checksum is not None else (None, 0)

    def _read(self, key: PageKey, digest: int, entry: Entry, dst: List[memoryview], size: int) -> Optional[int]:
        """Read and verify the chunk into dst: the page's checksum (0: unknown), None on a miss."""
        direct = self._direct and cf.is_aligned(dst)
        try:
            hdr = cf.read_chunk(entry.path, key[0], key[1], dst, size, self._codec.decode, direct, _block(entry))
        except FileNotFoundError:
            self._forget(digest, entry, None, "file vanished")
            self._ledger.miss()
            return None
        except cf.SizeMismatch:
            self._ledger.miss()
            return None
        except cf.CorruptChunk as exc:
            self._forget(digest, entry, exc.ino, str(exc))
            self._ledger.miss()
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL and direct:
                self._warn_once.warning("einval-read", "%s: O_DIRECT read refused (%s); buffered I/O from now on",
                                self.name, exc.strerror)
                self._direct = False
                return self._read(key, digest, entry, dst, size)
            self._rlog.warning("read", "%s: reading %s: %s", self.name, entry.path, exc.strerror)
            if exc.errno in _TRANSIENT_ERRNOS:
                self._ledger.miss(read_error=True)
                return None
            self._forget(digest, entry, None, exc.strerror or "I/O error")
            self._ledger.miss(read_error=True)
            return None
        if self._ledger.hit(digest, entry, key[0], hdr.raw_len, time.monotonic(), TOUCH_INTERVAL):
            try:
                os.utime(entry.path)  # the mtime is the recency a restart rebuilds from
            except OSError:
                pass
        return hdr.page_sum

    # ---------------------------------------------------------- the rest
    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        return [b != 0 for b in self._ledger.held([key_digest(ns, k) for ns, k in keys])]

    def held(self, namespace: str, keys: List[str]) -> bytes:
        return self._ledger.held_packed(pack_key_digests(namespace, keys))

    def held_digests(self, namespace: str, digests: bytes) -> bytes:
        return self._ledger.held_packed(digests)

    def _remove(self, digests: Iterable[int]) -> int:
        victims: List[Victim] = self._ledger.pop_many(digests)
        self._discard_many(victims)  # a batch file's records punched together (one call a file, not a page)
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
        self._discard_many(victims, evicted=True)
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

    def _replaced(self, digest: int, replaced: Entry) -> None:
        """The older version of a page now in a batch chunk goes: its record, or its own file (unless the page
        was written back into that file meanwhile)."""
        if replaced.file:
            self._give_back(replaced)
            return
        with self._stripe(digest):
            entry = self._ledger.get(digest)
            if entry is None or entry.file:
                cf.unlink_quietly(replaced.path)

    def get_many_into_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                                deadline: Optional[float] = None, hold=None) -> List[Optional[int]]:
        """Each page's checksum (0: unknown), None for a miss; nothing moves into the buffers once this
        returns.  Adjacent records of one batch file are read with one preadv a run, several runs and pages
        at once (tiers/stores/nvme/batch_reads.py)."""
        return self._reads.get_many(keys, pages, deadline)

    def stats(self) -> StoreStats:
        snap = self._ledger.snapshot()
        snap.extra.update(direct_io=float(self._direct), direct_writes=float(self._direct and self._direct_writes),
                          fsync=float(self.fsync), dir_syncs=self._dirsync.syncs)
        return snap

    def close(self) -> None:
        """Save the index for the next start (when it is whole) and release the directory lock; every
        acknowledged chunk is already in its file."""
        self._build.stop()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        if self._snapshots and self._build.done.is_set() and self._lock_fd is not None:
            try:
                rows = snapshot.save(self.root, self._ledger, self._dirs)
                if rows is not None:
                    log.info("%s: index of %d chunks saved for the next start", self.name, rows)
            except OSError as exc:  # the next start scans instead
                log.warning("%s: could not save the index snapshot: %s", self.name, exc)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _block(entry: Entry) -> Optional[int]:
    """Where a chunk's record starts in its batch chunk; None for a file of its own."""
    return entry.block if entry.file else None


# The nvme kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS["nvme"]).
KIND = StoreKind("nvme", NvmeStore.from_config, description="a put's pages in one checksummed file, fsync'd")
