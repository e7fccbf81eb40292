"""The NVMe tier's one-page writes: a page checked, encoded, reserved, written to a temp file, renamed into place
and indexed.

A put's pages go together into batch chunk files (tiers/stores/nvme/batch_writes.py)
where the file system can punch holes; this is the path of single puts and of
file systems that cannot.  The reservation comes before a byte is written, and
its victims' files are removed first: the disk never holds more than capacity.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Callable, List, Optional, Tuple

from tiers.logs import RateLimitedLog
from tiers.stores.base import Buffers, PageKey, PageTooLarge, StoreFull, StoreIOError, accepted_page, total_size
from tiers.stores.nvme import chunkfile as cf
from tiers.stores.nvme.batch_writes import BatchTarget
from tiers.stores.nvme.layout import LeafDirs, chunk_path, key_digest, namespace_hash, temp_path
from tiers.stores.nvme.removal import Removal

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class PageWrites:
    def __init__(self, target: BatchTarget, dirs: LeafDirs, removal: Removal, warn_once: RateLimitedLog,
                 direct_writes: bool, refuse_direct: Callable[[], None]):
        self.t = target  # what puts need of the store, the same as a batch's
        self._dirs = dirs  # leaf directories known to exist
        self._removal = removal  # evicted chunks' files and older versions' records go
        self._warn_once = warn_once  # each kind once per store
        self._direct_writes = direct_writes  # O_DIRECT for writes too (else through the page cache)
        self._refuse_direct = refuse_direct  # the device refused O_DIRECT: buffered I/O from now on

    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        t = self.t
        src, size = accepted_page(buffers, t.max_page_bytes)
        namespace, name = key
        digest, ns_hash = key_digest(namespace, name), namespace_hash(namespace)
        encoded = t.codec.encode(src, size)  # CPU work before the reservation: its size is exact
        payload = src if encoded is None else [memoryview(encoded)]
        stored = total_size(payload)
        disk = cf.HEADER_SIZE + stored
        if disk > t.capacity:
            raise PageTooLarge(f"chunk of {disk} bytes exceeds capacity {t.capacity}")
        path = chunk_path(t.root, ns_hash, digest)
        payload_sum = cf.payload_hash(payload)
        # The writer's checksum is checked where it costs nothing (a raw payload's checksum is the page's):
        # bytes that changed on their way here are refused, never stored under the writer's sum.
        if checksum and checksum != (payload_sum if encoded is None else cf.payload_hash(src)):
            t.ledger.count("checksum_refused")
            raise StoreIOError(f"{t.name}: the page's bytes do not match the writer's checksum")
        header = cf.pack_header(cf.header_block("write"), namespace, name, 0 if encoded is None else
                                t.codec.codec_id, size, stored, payload_sum, checksum)
        try:
            self._removal.discard_many(t.ledger.reserve(disk, ns_hash, namespace), evicted=True)
        except StoreFull as exc:
            raise StoreFull(f"{t.name}: {exc}") from None
        try:
            tmp = self._write_temp(path, [header, *payload], encoded is None, disk)
            self._rename_commit(digest, tmp, path, (ns_hash, namespace, disk, size, max(1, int(time.monotonic()))),
                                key_digest(namespace, parent) if parent else None)
        except BaseException:
            t.ledger.release(disk, ns_hash)
            raise
        if t.fsync:
            try:
                t.dirsync.sync(os.path.dirname(path))
            except OSError as exc:
                raise StoreIOError(f"{t.name}: fsync of {os.path.dirname(path)}: {exc.strerror}") from None
        t.ledger.wrote(size, stored)

    def _write_temp(self, path: str, views: List[memoryview], raw: bool, disk: int) -> str:
        """Write views to a fresh temp file next to path; one eviction-and-retry on a full disk."""
        t = self.t
        wanted = t.direct() and self._direct_writes and raw
        direct = wanted and cf.is_aligned(views)
        if wanted and not direct:
            t.ledger.count("unaligned_writes")  # e.g. pages that came as ZeroMQ frames
            self._warn_once.warning("unaligned", "%s: page buffers not %d-byte aligned; buffered I/O for such pages",
                                t.name, cf.ALIGN)
        for attempt in (0, 1):
            tmp = temp_path(path)
            try:
                self._ensure_dir(os.path.dirname(path))
                cf.write_file(tmp, views, t.fsync, direct)
                return tmp
            except OSError as exc:
                if exc.errno == errno.EINVAL and direct:
                    self._warn_once.warning("einval", "%s: O_DIRECT write refused (%s); buffered I/O from now on",
                                        t.name, exc.strerror)
                    self._refuse_direct()
                    return self._write_temp(path, views, raw, disk)
                if exc.errno == errno.ENOENT and not attempt:  # fan-out directory removed behind our back
                    self._dirs.discard(os.path.dirname(path))
                    continue
                if exc.errno not in _FULL_ERRNOS:
                    raise StoreIOError(f"{t.name}: writing {tmp}: {exc.strerror}") from None
                if attempt:
                    raise StoreFull(f"{t.name}: no space left on device after eviction") from None
                self._warn_once.warning("enospc", "%s: device full below the configured capacity; evicting", t.name)
                if disk > self._reclaimable():  # evicting everything would not make room: refuse now
                    raise StoreFull(f"{t.name}: chunk of {disk} bytes exceeds the space of the device") from None
                given_up = t.ledger.dead_bytes.give_up(disk)  # kept dead files first (nvme/recycle.py)
                victims = t.ledger.evict_bytes(disk - given_up) if given_up < disk else []
                if not victims:
                    if not given_up:
                        raise StoreFull(f"{t.name}: no space left on device") from None
                    t.ledger.count("enospc_retries")  # evict_bytes counts those that evicted
                self._removal.discard_many(victims, evicted=True)  # the given-up files removed first
        raise StoreFull(f"{t.name}: no space left on device")  # not reached: the loop returns or raises

    def _reclaimable(self) -> int:
        """Free bytes on the device plus the bytes our chunks occupy."""
        try:
            st = os.statvfs(self.t.root)
        except OSError:
            return self.t.capacity
        return st.f_bavail * st.f_frsize + self.t.ledger.used + self.t.ledger.dead

    def _ensure_dir(self, leaf: str) -> None:
        t = self.t
        if leaf in self._dirs:
            return
        os.makedirs(leaf, mode=0o700, exist_ok=True)
        if t.fsync:  # the new directory entries must survive a crash with the files in them
            cf.fsync_dir(os.path.dirname(leaf))
            cf.fsync_dir(t.root)
        self._dirs.add(leaf)

    def _rename_commit(self, digest: int, tmp: str, path: str, chunk: Tuple[int, str, int, int, int],
                       parent: Optional[int]) -> None:
        """Rename the written chunk into place and index it: chunk is (ns_hash, namespace, disk bytes, page
        bytes, stamp), as Ledger.commit takes them."""
        with self._removal.stripe(digest):
            try:
                os.rename(tmp, path)
            except OSError as exc:
                cf.unlink_quietly(tmp)
                cls = StoreFull if exc.errno in _FULL_ERRNOS else StoreIOError
                raise cls(f"{self.t.name}: rename to {path}: {exc.strerror}") from None
            replaced = self.t.ledger.commit(digest, *chunk, parent)
        if replaced is not None and replaced.file:  # the older version lay in a batch chunk
            self._removal.give_back(replaced)
