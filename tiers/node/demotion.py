"""Write-back and selective pages: what must still reach the next tier, and the link that takes it there.

A page written with mode ``back`` is dirty until it has been copied to the
next tier down; one written with mode ``selective`` goes down only if it was
read at least ``min_reads`` times.  Dirty pages are demoted when the store
evicts them, when the dirty set grows past its bound (oldest first, in the
background) and on graceful shutdown, always through the DemotionQueue's own
thread (a slow party is reached through a bounded queue, never from inside a
lock).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from tiers.node.buffers import scatter_copy
from tiers.wire.client import Deadlines, TierClient
from tiers.ops.logs import RateLimitedLog
from tiers.stores.base import EvictionListener, PageKey, PageStore
from tiers.wire.security import CurveSettings

log = logging.getLogger("hicache.demotion")
_warn = RateLimitedLog(log)

MODES = ("through", "back", "selective")


class DirtySet:
    """Pages not yet written below, oldest first: key -> (mode, min_reads)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pages: "OrderedDict[PageKey, Tuple[str, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: PageKey, mode: str, min_reads: int) -> None:
        with self._lock:
            self._pages.pop(key, None)
            if mode != "through":
                self._pages[key] = (mode, min_reads)

    def pop(self, key: PageKey) -> Optional[Tuple[str, int]]:
        with self._lock:
            return self._pages.pop(key, None)

    def discard_namespace(self, namespace: Optional[str]) -> None:
        with self._lock:
            for key in [k for k in self._pages if namespace is None or k[0] == namespace]:
                del self._pages[key]

    def write_back_count(self) -> int:
        with self._lock:
            return sum(1 for mode, _ in self._pages.values() if mode == "back")

    def oldest_over_limit(self) -> List[PageKey]:
        """Write-back pages beyond the bound, oldest first (selective pages wait for eviction)."""
        with self._lock:
            back = [k for k, (mode, _) in self._pages.items() if mode == "back"]
        return back[:max(0, len(back) - self.limit)]

    def snapshot(self) -> List[Tuple[PageKey, str, int]]:
        with self._lock:
            return [(k, mode, n) for k, (mode, n) in self._pages.items()]

    def __len__(self) -> int:
        return len(self._pages)


def should_demote(mode: str, min_reads: int, reads: int) -> bool:
    return mode == "back" or (mode == "selective" and reads >= min_reads)


class DemotionLink:
    """Puts pages into the next tier down, one session per namespace (called from the demotion thread only)."""

    def __init__(self, name: str, endpoint: str, deadlines: Optional[Deadlines] = None,
                 curve: Optional[CurveSettings] = None):
        self.name = name
        self.endpoint = endpoint
        self.curve = curve
        self.deadlines = deadlines or Deadlines()
        self._clients: Dict[str, TierClient] = {}
        self._lock = threading.Lock()
        self.demoted = 0
        self.failed = 0

    def _client(self, namespace: str) -> TierClient:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = TierClient(self.name, self.endpoint, namespace, "demotion", self.deadlines,
                                    curve=self.curve)
                self._clients[namespace] = client
            return client

    def is_down(self, namespace: str) -> bool:
        return self._client(namespace).is_down()

    def push_many(self, namespace: str, keys: List[str], pages: Sequence[Sequence[memoryview]]) -> List[bool]:
        """Store pages of one namespace below in one call; each True once the lower tier acknowledged it."""
        nbytes = sum(v.nbytes for page in pages for v in page)
        client = self._client(namespace)
        stored = client.put_frames(keys, [list(p) for p in pages], nbytes)
        unreachable = not any(stored) and client.is_down()  # the queue tries these again later
        with self._lock:
            self.demoted += sum(stored)
            if not unreachable:
                self.failed += len(stored) - sum(stored)
        return stored

    def push(self, key: PageKey, views: Sequence[memoryview]) -> bool:
        return self.push_many(key[0], [key[1]], [views])[0]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


@dataclass
class _Pending:
    key: PageKey
    views: List[memoryview]
    nbytes: int


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
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"demote-{link.name}", daemon=True)
        self._thread.start()

    def offer(self, key: PageKey, views: Sequence[memoryview], copy: bool = False) -> bool:
        """Queue a page (never waits; copy: the views are only valid now); False, counted, when full."""
        nbytes = sum(v.nbytes for v in views)
        with self._cond:
            accepted = not self._closed and self._bytes + nbytes <= self.max_bytes
            if accepted:
                self._bytes += nbytes  # reserved before the copy, so the bound holds under races
                self._pages += 1
            else:
                self.dropped += 1
        if not accepted:
            _warn.warning("dropped", "demotion queue to %s full (%d bytes): a dirty page of %s left this tier "
                                     "without reaching the one below", self.link.name, self.max_bytes, key[0])
            return False
        if copy:
            data = bytearray(nbytes)
            scatter_copy([memoryview(data)], views)
            views = [memoryview(data)]
        with self._cond:
            self._items.append(_Pending(key, list(views), nbytes))
            self._cond.notify()
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
            if self.link.is_down(namespace):
                with self._cond:
                    if self._closed:
                        break  # stopping and the tier is down: these count as failures below
                    self._cond.wait(self.RETRY)
                continue
            try:
                stored = self.link.push_many(namespace, [i.key[1] for i in items], [i.views for i in items])
            except Exception:  # a bug here must not stop demotion for good
                log.exception("demotion to %s failed", self.link.name)
                break
            if any(stored) or not self.link.is_down(namespace):
                break  # the tier answered (refused pages are counted by the link)
            # The call found the tier down: the pages wait for it to come back.
        with self._cond:
            self._bytes -= sum(i.nbytes for i in items)
            self._pages -= len(items)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


class Demoter(EvictionListener):
    """A daemon's duty to the tier below: evicted dirty pages and dirty pages over the bound go down
    through the queue; at a graceful stop every eligible dirty page goes straight down.

    Built before the store (tiers/node/tier_factory.py) and handed to it as its
    EvictionListener, then to the daemon, which calls tick and close with the store.
    """

    def __init__(self, link: DemotionLink, max_dirty_pages: int, queue_bytes: int):
        self.dirty = DirtySet(max_dirty_pages)
        self.link = link
        self.queue = DemotionQueue(link, queue_bytes)
        self._flushing = False

    def page_evicted(self, key: PageKey, views: Sequence[memoryview], reads: int) -> None:
        """Inside the store's lock, before an evicted page's memory is reused: only queues a copy."""
        pending = self.dirty.pop(key)
        if pending is not None and should_demote(pending[0], pending[1], reads):
            self.queue.offer(key, views, copy=True)

    def tick(self, store: PageStore, submit) -> None:
        """Housekeeping: queue the dirty pages over the bound, off the loop thread (submit runs it)."""
        if not self._flushing and self.dirty.oldest_over_limit():
            self._flushing = True
            submit(self._flush_over_limit, store)

    def _flush_over_limit(self, store: PageStore) -> None:
        """Queue the oldest write-back pages beyond max_dirty_pages (copies: they stay in this tier)."""
        try:
            for key in self.dirty.oldest_over_limit():
                data = store.peek(key)
                if data is None:
                    self.dirty.pop(key)
                elif self.queue.offer(key, [memoryview(data)]):
                    self.dirty.pop(key)
                else:
                    break  # the queue is full: the lower tier is slow or down; try again next tick
        finally:
            self._flushing = False

    def close(self, store: PageStore) -> None:
        """Graceful stop: push what is queued, then every eligible dirty page of store straight down."""
        self.queue.close()
        done = total = 0
        for key, mode, min_reads in self.dirty.snapshot():
            if not should_demote(mode, min_reads, store.read_count(key)):
                continue
            data = store.peek(key)
            total += 1
            if data is not None and self.link.push(key, [memoryview(data)]):
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
        return {"demotions": self.link.demoted, "demotion_failures": self.link.failed,
                "demotion_queued_pages": pages, "demotion_queued_bytes": nbytes,
                "demotion_dropped": self.queue.dropped, "lower_tier": self.link.name}

    @staticmethod
    def idle_stats() -> dict:
        """The same figures for a daemon with no tier below."""
        return {"demotions": 0, "demotion_failures": 0, "demotion_queued_pages": 0, "demotion_queued_bytes": 0,
                "demotion_dropped": 0, "lower_tier": ""}
