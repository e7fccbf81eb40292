"""A pool daemon's arena: pages written and read one-sided by remote engines.

The arena is the node's fixed-block arena (tiers/shm/arena.py, as in the DRAM
tier) of ``capacity`` bytes, registered with the Transfer Engine; its own read
leases are not used here: a pool pins pages for remote sessions instead.  A remote writer
``allocate``s (blocks reserved under a write lease, invisible to lookups),
transfers, then ``commit``s; a reader ``locate``s (pages pinned under a read
lease), transfers, then ``release``s.  Eviction follows the shared policies
and never takes a pinned page; a page deleted or overwritten while pinned
gives its blocks back only when its last pin goes.  Leases end by themselves
at their expiry, so a client that vanished mid-transfer pins nothing for long.
"""
from __future__ import annotations

import heapq
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from tiers.shm.arena import Alloc, BlockArena
from tiers.shm.buffers import address_of, as_bytes_view, scatter_copy
from tiers.plugins import make_policy
from tiers.stores.base import (INDEX_BYTES_PER_PAGE, Buffers, PageKey, PageStore, PageTooLarge, StoreError, StoreFull,
                               StoreStats, total_size)

Extents = List[Tuple[int, int]]


@dataclass
class _Page:
    alloc: Optional[Alloc]  # its blocks and (offset, length) extents in the arena; None once freed
    size: int
    pins: int = 0
    doomed: bool = False  # removed from the index while pinned: free at the last unpin
    checksum: int = 0  # the writer's xxh3_64 of the page (0: unknown), returned by locate


@dataclass
class _Lease:
    session: int
    write: bool
    expires: float
    pages: Dict[PageKey, _Page] = field(default_factory=dict)
    parents: Dict[PageKey, Optional[str]] = field(default_factory=dict)


class PoolStore(PageStore):
    """Pages in a registered arena of fixed blocks, with write and read leases."""

    keeps_checksums = True

    def __init__(self, capacity: int, policy: str = "lru", block_size: int = 1 << 20,
                 max_page_bytes: int = 64 << 20, max_lease: float = 30.0, prefault: bool = False):
        # Sparse until written; prefaulted in the background (page tables built then, not as
        # faults under the first remote writes) without holding the interpreter.
        self.blocks = BlockArena(capacity, block_size, "pool", prefault=prefault, background=True)
        self.block_size = block_size
        self.capacity = self.blocks.size
        self.max_page_bytes = min(max_page_bytes, self.capacity)
        self.max_lease = max_lease
        self.base = address_of(self.blocks.view)
        self._index: Dict[PageKey, _Page] = {}
        self._leases: Dict[int, _Lease] = {}
        self._expiry: List[Tuple[float, int]] = []  # heap of (expires, lease id)
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=self.capacity)
        self._reserved_bytes = 0

    # ------------------------------------------------------------- blocks
    def _take_blocks_locked(self, size: int) -> Alloc:
        while True:
            alloc = self.blocks.take(size)
            if alloc is not None:
                return alloc
            if not self._evict_one_locked():
                raise StoreFull(f"pool full: {self.blocks.free_blocks()} free blocks, "
                                f"{self.blocks.blocks_for(size)} needed, the rest pinned or reserved")

    def _free_page_locked(self, page: _Page) -> None:
        if page.pins:
            page.doomed = True  # a reader is still transferring: free at its release
            return
        if page.alloc is not None:
            self.blocks.give(page.alloc)
            page.alloc = None

    def _drop_locked(self, key: PageKey) -> bool:
        page = self._index.pop(key, None)
        if page is None:
            return False
        self._policy.remove(key)
        self._stats.used_bytes -= page.size
        self._free_page_locked(page)
        return True

    def _evict_one_locked(self) -> bool:
        skipped = []
        victim = None
        while True:
            key = self._policy.pop_victim()
            if key is None:
                break
            if self._index[key].pins == 0:
                victim = key
                break
            skipped.append(key)
        for key in skipped:  # pinned pages stay; they lose their rank (rare: only mid-transfer)
            self._policy.insert(key)
        if victim is None:
            return False
        page = self._index.pop(victim)
        self._stats.used_bytes -= page.size
        self._stats.evictions += 1
        self._free_page_locked(page)
        return True

    def addresses(self, extents: Extents) -> Extents:
        """Arena offsets -> absolute addresses (what remote engines write to)."""
        return [(self.base + off, n) for off, n in extents]

    # ------------------------------------------------------------- leases
    def _new_lease_locked(self, session: int, write: bool, ttl: float) -> Tuple[int, _Lease]:
        lease_id = secrets.randbits(62)
        lease = _Lease(session, write, time.monotonic() + min(max(ttl, 0.01), self.max_lease))
        self._leases[lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires, lease_id))
        return lease_id, lease

    def _end_lease_locked(self, lease: _Lease) -> int:
        for page in lease.pages.values():
            if lease.write:
                self._reserved_bytes -= page.size
                self._free_page_locked(page)
            else:
                page.pins -= 1
                if page.pins == 0 and page.doomed:
                    self._free_page_locked(page)
        n = len(lease.pages)
        lease.pages.clear()
        return n

    def expire_leases(self, now: Optional[float] = None) -> int:
        """End every lease past its expiry; returns how many."""
        now = time.monotonic() if now is None else now
        ended = 0
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _t, lease_id = heapq.heappop(self._expiry)
                lease = self._leases.pop(lease_id, None)
                if lease is not None:
                    self._end_lease_locked(lease)
                    ended += 1
        return ended

    def allocate(self, session: int, keys: List[PageKey], sizes: List[int], parents: List[Optional[str]],
                 ttl: float, sums: Optional[List[int]] = None) -> Tuple[int, List[Optional[Extents]],
                                                                        Optional[Tuple[str, str]]]:
        """Reserve room for each page (kept with its checksum once committed): (lease, address extents or
        None per key, first refusal)."""
        self.expire_leases()
        out: List[Optional[Extents]] = []
        refusal = None
        with self._lock:
            lease_id, lease = self._new_lease_locked(session, True, ttl)
            for key, size, parent, checksum in zip(keys, sizes, parents, sums or [0] * len(keys)):
                if size > self.max_page_bytes or key in lease.pages:
                    why = (("too_large", f"page of {size} bytes over {self.max_page_bytes}")
                           if size > self.max_page_bytes else ("bad_request", "a key twice in one alloc"))
                    refusal = refusal or why
                    out.append(None)
                    continue
                try:
                    alloc = self._take_blocks_locked(size)
                except StoreError as exc:
                    refusal = refusal or (exc.code, str(exc))
                    out.append(None)
                    continue
                lease.pages[key] = _Page(alloc, size, checksum=checksum)
                lease.parents[key] = parent
                self._reserved_bytes += size
                out.append(self.addresses(alloc.extents))
            if not lease.pages:
                del self._leases[lease_id]
        return lease_id, out, refusal

    def commit(self, session: int, lease_id: int, keys: List[PageKey]) -> List[bool]:
        """Make the named pages of a write lease visible; the rest of the lease is freed."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session != session or not lease.write:
                return [False] * len(keys)
            del self._leases[lease_id]
            done = []
            for key in keys:
                page = lease.pages.pop(key, None)
                if page is None:
                    done.append(False)
                    continue
                self._reserved_bytes -= page.size
                self._drop_locked(key)
                self._index[key] = page
                parent = lease.parents.get(key)
                self._policy.insert(key, (key[0], parent) if parent else None)
                self._stats.used_bytes += page.size
                self._stats.inserts += 1
                self._stats.bytes_written += page.size
                done.append(True)
            self._end_lease_locked(lease)  # pages not committed
            return done

    def locate(self, session: int, keys: List[PageKey],
               ttl: float) -> Tuple[int, List[Optional[Tuple[int, Extents, int]]]]:
        """Pin each held page: (lease, (size, address extents, checksum) or None per key)."""
        self.expire_leases()
        out: List[Optional[Tuple[int, Extents, int]]] = []
        # Every read's batch passes here page by page: names bound once, counters added once (a third of a
        # 128-page locate went to attribute lookups).
        index, touch, base = self._index, self._policy.touch, self.base
        hits = misses = nbytes = 0
        with self._lock:
            lease_id, lease = self._new_lease_locked(session, False, ttl)
            pinned = lease.pages
            for key in keys:
                page = index.get(key)
                if page is None or key in pinned:
                    misses += page is None
                    out.append(None)
                    continue
                page.pins += 1
                pinned[key] = page
                touch(key)
                hits += 1
                nbytes += page.size
                out.append((page.size, [(base + off, n) for off, n in page.alloc.extents], page.checksum))
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.bytes_read += nbytes
            if not pinned:
                del self._leases[lease_id]
        return lease_id, out

    def release(self, session: int, lease_id: int) -> int:
        """End a lease early (pins dropped, reservations freed); returns its pages."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session != session:
                return 0
            del self._leases[lease_id]
            return self._end_lease_locked(lease)

    # --------------------------------------------- PageStore (frames path)
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        src = [as_bytes_view(b) for b in buffers]
        size = total_size(src)
        if size == 0 or size > self.max_page_bytes:
            raise PageTooLarge(f"page of {size} bytes not accepted (max {self.max_page_bytes})")
        with self._lock:
            self._drop_locked(key)
            page = _Page(self._take_blocks_locked(size), size, checksum=checksum)
            scatter_copy(self.blocks.views(page.alloc), src)
            self._index[key] = page
            self._policy.insert(key, (key[0], parent) if parent else None)
            self._stats.used_bytes += size
            self._stats.inserts += 1
            self._stats.bytes_written += size

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        dst = [as_bytes_view(b) for b in buffers]
        with self._lock:
            page = self._index.get(key)
            if page is None or page.size != total_size(dst):
                self._stats.misses += 1
                return None
            self._policy.touch(key)
            self._stats.hits += 1
            self._stats.bytes_read += page.size
            scatter_copy(dst, self.blocks.views(page.alloc))
            return page.checksum

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self._lock:
            page = self._index.get(key)
            if page is None:
                self._stats.misses += 1
                return None, 0
            self._policy.touch(key)
            self._stats.hits += 1
            self._stats.bytes_read += page.size
            return b"".join(self.blocks.views(page.alloc)), page.checksum

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        index = self._index
        return [k in index for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        with self._lock:
            return sum(self._drop_locked(key) for key in keys)

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            doomed = [k for k in self._index if namespace is None or k[0] == namespace]
            for key in doomed:
                self._drop_locked(key)
            return len(doomed)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        pages = freed = 0
        with self._lock:
            if namespace is None:
                while freed < nbytes:
                    before = self._stats.used_bytes
                    if not self._evict_one_locked():
                        break
                    pages, freed = pages + 1, freed + before - self._stats.used_bytes
                return pages, freed
            victims = [k for k, p in self._index.items() if k[0] == namespace and p.pins == 0]
            for key in victims:  # an operator's tool: index order, not the policy's
                if freed >= nbytes:
                    break
                freed += self._index[key].size
                self._drop_locked(key)
                self._stats.evictions += 1
                pages += 1
            return pages, freed

    def index_bytes(self) -> int:
        """What the pages held cost outside the arena (the memory guard's allowance for them); no lock: a racing
        count is off by a page, and the guard asks once a second."""
        return len(self._index) * INDEX_BYTES_PER_PAGE

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items() if k != "extra"})
            snap.pages = len(self._index)
            snap.extra = {"block_size": self.block_size, "free_blocks": self.blocks.free_blocks(),
                          "reserved_bytes": self._reserved_bytes, "leases": len(self._leases),
                          "store_prefaulted": float(self.blocks.prefaulted.is_set())}
            return snap

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._leases.clear()
            self.blocks.close()
