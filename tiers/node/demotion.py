"""Write-back and selective pages: what must still reach the next tier, and the link that takes it there.

A page written with mode ``back`` is dirty until it has been copied to the
next tier down; one written with mode ``selective`` goes down only if it was
read at least ``min_reads`` times.  Dirty pages are demoted when the store
evicts them, when the dirty set grows past its bound (oldest first, in the
background) and on graceful shutdown, always through the DemotionQueue's own
thread (a slow party is reached through a bounded queue, never from inside a
lock).

When the upper store keeps its pages in an arena (DRAM), a dirty page that
goes down while still stored (over the dirty bound, or at a graceful stop)
goes through shared memory: its blocks are pinned by a lease (no copy), the
lower daemon maps the arena read-only as it maps an engine's host pool and
the NVMe tier writes the page with O_DIRECT straight out of that mapping
when its runs are 4 KiB-aligned (else through its own aligned staging
blocks); the lease ends when the call returns (bytes reused after a lower
daemon gave up reach its disk under the old sum: a read misses them).  A dirty page evicted before that is copied at eviction (its
blocks go to the writer at once: pinning them made a writer of a full arena
evict more pages) and sent as ZeroMQ frames, as are all pages to tcp://
tiers: a copy more, and unaligned (buffered I/O below).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from tiers.shm.buffers import scatter_copy
from tiers.node.dirty import DirtySet, should_demote
from tiers.wire import protocol as P
from tiers.wire.client import Deadlines, TierClient
from tiers.node.sessions import ADMIN_NAMESPACE
from tiers.logs import RateLimitedLog
from tiers.stores.base import EvictionListener, PageKey, PageStore
from tiers.wire.security import CurveSettings

log = logging.getLogger("hicache.demotion")
_warn = RateLimitedLog(log)

DEMOTION_OWNER = -1  # owner of the leases pinning pages on their way down (engine sessions are positive)


class DemotionLink:
    """Puts pages into the next tier down (called from the demotion thread only).

    One _admin session carries every namespace's pages, each put naming its namespace: one connection and
    one arena attach whatever the number of namespaces above (one client a namespace ran a daemon holding
    pages of ~1,000 namespaces out of descriptors, and out of the lower tier's attach slots past 256).
    The daemon below must take this daemon's account as an admin: its own operator, or a tenant with
    ``admin`` (tiers/node/tenants.py)."""

    def __init__(self, name: str, endpoint: str, deadlines: Optional[Deadlines] = None,
                 curve: Optional[CurveSettings] = None):
        self.name = name
        self.endpoint = endpoint
        self.deadlines = deadlines or Deadlines(reply_spin=0.0)  # a daemon waits without spinning (pool_client.py)
        self._client = TierClient(name, endpoint, ADMIN_NAMESPACE, "demotion", self.deadlines, curve=curve)
        self._lock = threading.Lock()
        self._arena_fd: Optional[int] = None
        self.demoted = 0
        self.failed = 0
        self.by_region = 0  # pages the lower tier copied out of our arena (the rest went as frames)

    def attach_arena(self, fd: int, size: int) -> None:
        """Offer the upper store's arena (a read-only memfd we own from now on) to the lower daemon."""
        with self._lock:
            self._arena_fd = fd
            self._client.attach_region(fd, size)

    def is_down(self) -> bool:
        return self._client.is_down()

    def push_many(self, namespace: str, keys: List[str], pages: Sequence[Sequence[memoryview]],
                  extents: Optional[Sequence[list]] = None, sums: Sequence[int] = ()) -> List[bool]:
        """Store pages of one namespace below in one call, with their checksums (the writer's: a page
        keeps its sum in every tier); each True once the lower tier acknowledged it.

        extents: each page's (offset, length) runs in the attached arena; the lower daemon then copies
        them itself (its call's deadline guards the copy as for an engine's host pool)."""
        nbytes = sum(v.nbytes for page in pages for v in page)
        client = self._client
        extra = {"ns": namespace, **({"sums": P.encode_sums(sums)} if any(sums) else {})}
        stored, by_region = [], 0
        if extents is not None and client.connect() and client.region_id is not None:
            desc, counts = P.encode_descriptors(extents)
            stored = client.put_region(keys, desc, counts, nbytes, **extra)
            by_region = sum(stored)
        if not stored or (not by_region and client.region_id is None):  # not attached, or lost it meanwhile
            stored = client.put_frames(keys, [list(p) for p in pages], nbytes, **extra)
        unreachable = not any(stored) and client.is_down()  # the queue tries these again later
        with self._lock:
            self.demoted += sum(stored)
            self.by_region += by_region
            if not unreachable:
                self.failed += len(stored) - sum(stored)
        return stored

    def push(self, key: PageKey, views: Sequence[memoryview], checksum: int = 0) -> bool:
        return self.push_many(key[0], [key[1]], [views], sums=[checksum])[0]

    def close(self) -> None:
        with self._lock:
            self._client.close()
            if self._arena_fd is not None:
                os.close(self._arena_fd)
                self._arena_fd = None


@dataclass
class _Pending:
    key: PageKey
    views: List[memoryview]
    nbytes: int
    checksum: int = 0  # the writer's, kept below
    promised: bool = False  # an acknowledged write-back page (Demoter.admit_write_back counts it until pushed)


class DemotionQueue:
    """Pages on their way down, drained by a thread of their own: a slow or frozen lower tier never
    holds a store lock or an engine's call.

    Bounded in bytes.  While the lower tier is down, queued pages wait (the
    thread retries as the tier's client comes back up); when the queue is full
    an evicted dirty page is dropped from this tier without reaching the one
    below: counted as ``demotion_dropped``, logged, never silent.  The top
    tier keeps serving as a cache meanwhile.  A page the lower tier answers
    and refuses (full, too large) counts as a demotion failure.
    """

    RETRY = 0.1  # seconds between looks at a lower tier that is down

    def __init__(self, link: DemotionLink, max_bytes: int, batch_pages: int = 32):
        self.link = link
        self.max_bytes = max_bytes
        self.batch_pages = batch_pages
        self._items: Deque[_Pending] = deque()
        self._bytes = 0
        self._pages = 0  # queued or being pushed
        self.promised = 0  # acknowledged write-back pages among them
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.arena = None  # the upper store's BlockArena, when it shares one (Demoter.write_down pins in it)
        self._thread = threading.Thread(target=self._run, name=f"demote-{link.name}", daemon=True)
        self._thread.start()

    def _admit(self, key: PageKey, nbytes: int, promised: bool = False) -> bool:
        """Count a page in (reserved before the copy or pin, so the bound holds under races); False, counted,
        when full. A promised page (an acknowledged write-back one) is taken whatever the bytes: their number
        is bounded by max_dirty_pages (Demoter.admit_write_back), and dropping one would break the promise."""
        with self._cond:
            accepted = promised or (not self._closed and self._bytes + nbytes <= self.max_bytes)
            if accepted:
                self._bytes += nbytes
                self._pages += 1
                self.promised += promised
            else:
                self.dropped += 1
        if not accepted:
            _warn.warning("dropped", "demotion queue to %s full (%d bytes): a dirty page of %s left this tier "
                                     "without reaching the one below", self.link.name, self.max_bytes, key[0])
        return accepted

    def _append(self, item: _Pending) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def offer(self, key: PageKey, views: Sequence[memoryview], copy: bool = False, checksum: int = 0,
              promised: bool = False) -> bool:
        """Queue a page (never waits; copy: the views are only valid now); False, counted, when full (never
        for a promised page: see _admit)."""
        nbytes = sum(v.nbytes for v in views)
        if not self._admit(key, nbytes, promised):
            return False
        if copy:
            data = bytearray(nbytes)
            scatter_copy([memoryview(data)], views)
            views = [memoryview(data)]
        self._append(_Pending(key, list(views), nbytes, checksum=checksum, promised=promised))
        return True

    def queued(self) -> Tuple[int, int]:
        """(pages, bytes) queued or being pushed."""
        with self._cond:
            return self._pages, self._bytes

    def _take(self) -> List[_Pending]:
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            batch = []
            while self._items and len(batch) < self.batch_pages:
                batch.append(self._items.popleft())
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return  # closed and drained
            by_ns: Dict[str, List[_Pending]] = {}
            for item in batch:
                by_ns.setdefault(item.key[0], []).append(item)
            for namespace, items in by_ns.items():
                self._push(namespace, items)

    def _push(self, namespace: str, items: List[_Pending]) -> None:
        """Push until the lower tier answers (or the queue closes while it is down)."""
        while True:
            if self.link.is_down():
                with self._cond:
                    if self._closed:
                        break  # stopping and the tier is down: these count as failures below
                    self._cond.wait(self.RETRY)
                continue
            try:
                stored = self.link.push_many(namespace, [i.key[1] for i in items], [i.views for i in items],
                                             None, [i.checksum for i in items])
            except Exception:  # a bug here must not stop demotion for good
                log.exception("demotion to %s failed", self.link.name)
                break
            if any(stored) or not self.link.is_down():
                break  # the tier answered (refused pages are counted by the link)
            # The call found the tier down: the pages wait for it to come back.
        with self._cond:
            self._bytes -= sum(i.nbytes for i in items)
            self._pages -= len(items)
            self.promised -= sum(i.promised for i in items)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


class Demoter(EvictionListener):
    """A daemon's duty to the tier below: evicted dirty pages go down through the queue; write-back pages
    past max_dirty_pages go straight down before the put that made them so is answered (admit_write_back);
    at a graceful stop every eligible dirty page goes straight down.

    Built before the store (tiers/ops/tier_factory.py) and handed to it as its
    EvictionListener, then to the daemon, which calls admit_write_back and close with the store.
    """

    def __init__(self, link: DemotionLink, max_dirty_pages: int, queue_bytes: int):
        self.dirty = DirtySet(max_dirty_pages)
        self.link = link
        self.queue = DemotionQueue(link, queue_bytes)
        self._admission = threading.Lock()  # one write-back put at a time weighs the bound
        self.written_down = 0  # write-back pages a put wrote below before it was acknowledged
        self.refused = 0  # write-back pages not acknowledged: the bound was reached and the tier below failed

    def share_arena(self, arena) -> None:
        """The store keeps its pages in arena (a BlockArena): pages go down by (offset, length) in it."""
        self.queue.arena = arena
        self.link.attach_arena(arena.export_fd(), arena.size)

    def page_evicted(self, key: PageKey, views: Sequence[memoryview], reads: int, checksum: int = 0) -> None:
        """Inside the store's lock, before an evicted page's memory is reused: only queues a copy."""
        pending = self.dirty.pop(key)
        if pending is not None and should_demote(pending[0], pending[1], reads):
            self.queue.offer(key, views, copy=True, checksum=checksum, promised=pending[0] == "back")

    def unsafe_pages(self) -> int:
        """Acknowledged write-back pages not yet acknowledged by the tier below: what a crash now would lose."""
        return self.dirty.write_back_count() + self.queue.promised

    def admit_write_back(self, store: PageStore, namespace: str, keys: Sequence[str], stored: List[bool],
                         min_reads: int) -> List[bool]:
        """The write-back pages of a put, stored here; which may be acknowledged.

        write_back promises that a crash loses at most max_dirty_pages acknowledged pages: when this put
        would take the pages not yet below past that, the oldest go down now, from this worker thread,
        before the put is answered (a lower tier that cannot take them leaves the newest of this put
        unacknowledged: stored here, not promised)."""
        out = list(stored)
        with self._admission:
            new = [(namespace, k) for k, ok in zip(keys, stored) if ok]
            for key in new:
                self.dirty.add(key, "back", min_reads)
            over = self.unsafe_pages() - self.dirty.limit
            if over > 0:
                oldest = self.dirty.oldest_write_back(over)
                for key, ok in zip(oldest, self.write_down(store, oldest)):
                    if ok:
                        self.dirty.pop(key)
                        self.written_down += 1
            over = self.unsafe_pages() - self.dirty.limit
            if over > 0:  # the tier below failed: the newest of this put are not promised
                unpromised = {k for k in new[-over:]}
                for key in unpromised:
                    self.dirty.pop(key)
                self.refused += len(unpromised)
                out = [ok and (namespace, k) not in unpromised for k, ok in zip(keys, stored)]
        return out

    def write_down(self, store: PageStore, keys: Sequence[PageKey]) -> List[bool]:
        """Write stored pages to the tier below now, a call a namespace; True where it acknowledged."""
        done = {}
        by_ns: Dict[str, List[PageKey]] = {}
        for key in keys:
            by_ns.setdefault(key[0], []).append(key)
        arena = self.queue.arena
        for namespace, group in by_ns.items():
            # From the shared arena where every page of the group can be pinned; else each page's bytes.
            pins = [store.pin_page(key, DEMOTION_OWNER) if arena is not None else None for key in group]
            try:
                if arena is not None and all(p is not None for p in pins):
                    stored = self.link.push_many(namespace, [k[1] for k in group],
                                                 [arena.extent_views(p[1]) for p in pins], [p[1] for p in pins],
                                                 [p[2] for p in pins])
                else:
                    stored = []
                    for key in group:
                        data, checksum = store.peek_with_sum(key)
                        stored.append(data is not None and self.link.push(key, [memoryview(data)], checksum))
            finally:
                for pin in pins:
                    if pin is not None:
                        arena.release(pin[0], DEMOTION_OWNER)
            done.update(zip(group, stored))
        return [done.get(key, False) for key in keys]

    def close(self, store: PageStore) -> None:
        """Graceful stop: push what is queued, then every eligible dirty page of store straight down."""
        self.queue.close()
        done = total = 0
        for key, mode, min_reads in self.dirty.snapshot():
            if not should_demote(mode, min_reads, store.read_count(key)):
                continue
            total += 1
            if self.write_down(store, [key])[0]:
                self.dirty.pop(key)
                done += 1
        if total:
            log.info("flushed %d of %d dirty pages to %s", done, total, self.link.name)
        self.link.close()

    def discard(self) -> None:
        """Stop without a store (its build failed): nothing was dirty yet."""
        self.queue.close()
        self.link.close()

    def stats(self) -> dict:
        pages, nbytes = self.queue.queued()
        return {"demotions": self.link.demoted, "demotions_by_region": self.link.by_region,
                "demotion_failures": self.link.failed,
                "demotion_queued_pages": pages, "demotion_queued_bytes": nbytes,
                "demotion_dropped": self.queue.dropped, "lower_tier": self.link.name,
                "write_back_unsafe_pages": self.unsafe_pages(), "write_back_written_down": self.written_down,
                "write_back_refused": self.refused}

    @staticmethod
    def idle_stats() -> dict:
        """The same figures for a daemon with no tier below."""
        return {"demotions": 0, "demotions_by_region": 0, "demotion_failures": 0, "demotion_queued_pages": 0, "demotion_queued_bytes": 0,
                "demotion_dropped": 0, "lower_tier": "", "write_back_unsafe_pages": 0, "write_back_written_down": 0,
                "write_back_refused": 0}
