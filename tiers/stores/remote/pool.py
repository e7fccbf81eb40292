"""A pool daemon's arena: pages written and read one-sided by remote engines.

The arena is one anonymous mapping of ``capacity`` bytes registered with the
Transfer Engine, cut into fixed blocks as in the DRAM tier.  A remote writer
``allocate``s (blocks reserved under a write lease, invisible to lookups),
transfers, then ``commit``s; a reader ``locate``s (pages pinned under a read
lease), transfers, then ``release``s.  Eviction follows the shared policies
and never takes a pinned page; a page deleted or overwritten while pinned
gives its blocks back only when its last pin goes.  Leases end by themselves
at their expiry, so a client that vanished mid-transfer pins nothing for long.
"""
from __future__ import annotations

import heapq
import mmap
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from tiers.node.buffers import as_bytes_view, block_extents, scatter_copy
from tiers.policies import make_policy
from tiers.stores.base import Buffers, PageKey, PageStore, PageTooLarge, StoreError, StoreFull, StoreStats, total_size

Extents = List[Tuple[int, int]]


@dataclass
class _Page:
    blocks: List[int]
    extents: Extents  # (offset, length) in the arena
    size: int
    pins: int = 0
    doomed: bool = False  # removed from the index while pinned: free at the last unpin


@dataclass
class _Lease:
    session: int
    write: bool
    expires: float
    pages: Dict[PageKey, _Page] = field(default_factory=dict)
    parents: Dict[PageKey, Optional[str]] = field(default_factory=dict)


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
_POPULATE_STEP = 8 << 20  # about 20 ms of faults here: the loop waits at most that long for the interpreter


def _populate(mapping: mmap.mmap) -> None:
    """Fault an arena in, a slice at a time so the daemon's loop keeps the interpreter between slices."""
    try:
        for start in range(0, len(mapping), _POPULATE_STEP):
            mapping.madvise(_MADV_POPULATE_WRITE, start, min(_POPULATE_STEP, len(mapping) - start))
    except (OSError, ValueError):
        pass  # an older kernel, or the arena closed meanwhile: pages fault in on first use


class PoolStore(PageStore):
    """Pages in a registered arena of fixed blocks, with write and read leases."""

    def __init__(self, capacity: int, policy: str = "lru", block_size: int = 1 << 20,
                 max_page_bytes: int = 64 << 20, max_lease: float = 30.0, prefault: bool = False):
        if block_size <= 0 or capacity < block_size:
            raise ValueError("capacity must hold at least one block")
        self.block_size = block_size
        self.n_blocks = capacity // block_size
        self.capacity = self.n_blocks * block_size
        self.max_page_bytes = min(max_page_bytes, self.capacity)
        self.max_lease = max_lease
        self._map = mmap.mmap(-1, self.capacity)  # anonymous: memory is used only when written
        self._arena = memoryview(self._map)
        from tiers.stores.remote.engine import address_of
        self.base = address_of(self._arena)
        self._free = list(range(self.n_blocks - 1, -1, -1))  # a stack, lowest block on top
        self._index: Dict[PageKey, _Page] = {}
        self._leases: Dict[int, _Lease] = {}
        self._expiry: List[Tuple[float, int]] = []  # heap of (expires, lease id)
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=self.capacity)
        self._reserved_bytes = 0
        if prefault:  # page tables built in the background, not as faults under the first remote writes
            threading.Thread(target=_populate, args=(self._map,), name="pool-prefault", daemon=True).start()

    # ------------------------------------------------------------- blocks
    def _take_blocks_locked(self, size: int) -> Tuple[List[int], Extents]:
        needed = -(-size // self.block_size)
        while len(self._free) < needed:
            if not self._evict_one_locked():
                raise StoreFull(f"pool full: {len(self._free)} free blocks, {needed} needed, "
                                "the rest pinned or reserved")
        blocks = [self._free.pop() for _ in range(needed)]
        return blocks, block_extents(blocks, self.block_size, size)

    def _free_page_locked(self, page: _Page) -> None:
        if page.pins:
            page.doomed = True  # a reader is still transferring: free at its release
            return
        self._free.extend(reversed(page.blocks))
        page.blocks = []

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
                 ttl: float) -> Tuple[int, List[Optional[Extents]], Optional[Tuple[str, str]]]:
        """Reserve room for each page: (lease, address extents or None per key, first refusal)."""
        self.expire_leases()
        out: List[Optional[Extents]] = []
        refusal = None
        with self._lock:
            lease_id, lease = self._new_lease_locked(session, True, ttl)
            for key, size, parent in zip(keys, sizes, parents):
                if size > self.max_page_bytes or key in lease.pages:
                    why = (("too_large", f"page of {size} bytes over {self.max_page_bytes}")
                           if size > self.max_page_bytes else ("bad_request", "a key twice in one alloc"))
                    refusal = refusal or why
                    out.append(None)
                    continue
                try:
                    blocks, extents = self._take_blocks_locked(size)
                except StoreError as exc:
                    refusal = refusal or (exc.code, str(exc))
                    out.append(None)
                    continue
                lease.pages[key] = _Page(blocks, extents, size)
                lease.parents[key] = parent
                self._reserved_bytes += size
                out.append(self.addresses(extents))
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

    def locate(self, session: int, keys: List[PageKey], ttl: float) -> Tuple[int, List[Optional[Tuple[int, Extents]]]]:
        """Pin each held page: (lease, (size, address extents) or None per key)."""
        self.expire_leases()
        out: List[Optional[Tuple[int, Extents]]] = []
        with self._lock:
            lease_id, lease = self._new_lease_locked(session, False, ttl)
            for key in keys:
                page = self._index.get(key)
                if page is None or key in lease.pages:
                    self._stats.misses += page is None
                    out.append(None)
                    continue
                page.pins += 1
                lease.pages[key] = page
                self._policy.touch(key)
                self._stats.hits += 1
                self._stats.bytes_read += page.size
                out.append((page.size, self.addresses(page.extents)))
            if not lease.pages:
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
        src = [as_bytes_view(b) for b in buffers]
        size = total_size(src)
        if size == 0 or size > self.max_page_bytes:
            raise PageTooLarge(f"page of {size} bytes not accepted (max {self.max_page_bytes})")
        with self._lock:
            self._drop_locked(key)
            blocks, extents = self._take_blocks_locked(size)
            page = _Page(blocks, extents, size)
            scatter_copy([self._arena[o:o + n] for o, n in extents], src)
            self._index[key] = page
            self._policy.insert(key, (key[0], parent) if parent else None)
            self._stats.used_bytes += size
            self._stats.inserts += 1
            self._stats.bytes_written += size

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        dst = [as_bytes_view(b) for b in buffers]
        with self._lock:
            page = self._index.get(key)
            if page is None or page.size != total_size(dst):
                self._stats.misses += 1
                return False
            self._policy.touch(key)
            self._stats.hits += 1
            self._stats.bytes_read += page.size
            scatter_copy(dst, [self._arena[o:o + n] for o, n in page.extents])
            return True

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        with self._lock:
            page = self._index.get(key)
            if page is None:
                self._stats.misses += 1
                return None
            self._policy.touch(key)
            self._stats.hits += 1
            self._stats.bytes_read += page.size
            return b"".join(self._arena[o:o + n] for o, n in page.extents)

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

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items() if k != "extra"})
            snap.pages = len(self._index)
            snap.extra = {"block_size": self.block_size, "free_blocks": len(self._free),
                          "reserved_bytes": self._reserved_bytes, "leases": len(self._leases)}
            return snap

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._leases.clear()
            try:
                self._arena.release()
                self._map.close()
            except BufferError:  # a transfer still holds a view; the process is ending anyway
                pass
