"""A tier that shares its memory with the engines: pages in a BlockArena they map read-only.

The smallest store that exports an arena (docs/WRITING_A_TIER.md, "Shared
memory"): the daemon writes a page in three steps, the copy out of the
engine's host pool outside this store's lock (``reserve``, its guarded copy,
``commit`` or ``abort``), and a read leases the page's blocks for the
engine to copy out of its own mapping (``lease_pages``): no byte of a read
passes through the daemon.  A page evicted, deleted or overwritten while it
is leased keeps its blocks until the lease ends (the arena parks them), so
an engine never copies another page's bytes.  The index is a dict and the
order any installed policy; one lock, since the daemon calls a store without
``parallel_io`` from one thread at a time.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from tiers.config_values import parse_size
from tiers.plugins import StoreKind, make_policy
from tiers.shm.arena import Alloc, BlockArena
from tiers.shm.buffers import as_bytes_view, scatter_copy
from tiers.stores.base import (Buffers, EvictionListener, PageKey, PageStore, PageTooLarge, StoreFull, StoreStats,
                               total_size)


@dataclass
class _Page:
    alloc: Alloc
    checksum: int
    reads: int = 0


class ArenaStore(PageStore):
    keeps_checksums = True

    def __init__(self, capacity: int, policy: str = "lru", max_page_bytes: int = 64 << 20,
                 evictions: Optional[EvictionListener] = None, block_size: int = 64 << 10, name: str = "memarena"):
        self.capacity, self.max_page_bytes = capacity, min(max_page_bytes, capacity)
        self.arena = BlockArena(capacity, block_size, f"hicache-{name}", prefault=False)
        self.policy = make_policy(policy)
        self._evictions = evictions
        self._lock = threading.Lock()
        self._pages: Dict[PageKey, _Page] = {}
        self._stats = StoreStats(capacity_bytes=capacity)
        self._leased = 0  # pages handed to engines by lease (their copy out of the arena)
        self._copied_in = 0  # pages put as buffers (frames), not reserved, copied by the daemon and committed

    def export_arena(self) -> BlockArena:
        return self.arena

    # ------------------------------------------------- writes, in three steps
    def reserve(self, key: PageKey, size: int, evict: bool = True) -> Optional[Alloc]:
        if not 0 < size <= self.max_page_bytes:
            raise PageTooLarge(f"{size} bytes is more than this tier takes")
        with self._lock:
            while True:
                alloc = self.arena.take(size)
                if alloc is not None or not evict:
                    return alloc
                if not self._evict_one_locked():
                    raise StoreFull("every block is being written or read")

    def commit(self, key: PageKey, alloc: Alloc, parent: Optional[str] = None, checksum: int = 0) -> None:
        with self._lock:
            if key in self._pages:
                self._drop_locked(key)
            self._pages[key] = _Page(alloc, checksum)
            self.policy.insert(key)
            self._stats.used_bytes += alloc.size
            self._stats.inserts += 1
            self._stats.bytes_written += alloc.size

    def abort(self, alloc: Alloc) -> None:
        self.arena.give(alloc)

    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        alloc = self.reserve(key, total_size(buffers))
        scatter_copy(self.arena.views(alloc), [as_bytes_view(b) for b in buffers])
        self.commit(key, alloc, parent, checksum)
        with self._lock:
            self._copied_in += 1

    # ---------------------------------------------------------------- reads
    def lease_pages(self, keys: Sequence[PageKey], sizes: Sequence[int], owner: int, expiry: float,
                    max_bytes: int) -> Tuple[Optional[int], List[Optional[list]], List[int]]:
        """Pin the pages held with the expected sizes, up to max_bytes, for the engine to copy out."""
        found: List[Optional[list]] = []
        sums: List[int] = []
        allocs: List[Alloc] = []
        leased = 0
        with self._lock:
            for key, size in zip(keys, sizes):
                page = self._pages.get(key)
                if page is None or page.alloc.size != size or leased + size > max_bytes:
                    found.append(None)
                    sums.append(0)
                    self._stats.misses += 1
                    continue
                self._hit_locked(key, page)
                found.append(page.alloc.extents)
                sums.append(page.checksum)
                allocs.append(page.alloc)
                leased += size
            self._leased += len(allocs)
            lease = self.arena.lease(owner, allocs, expiry) if allocs else None
        return lease, found, sums

    def pin_page(self, key: PageKey, owner: int) -> Optional[Tuple[int, list, int]]:
        with self._lock:
            page = self._pages.get(key)
            if page is None:
                return None
            return self.arena.lease(owner, [page.alloc], float("inf")), page.alloc.extents, page.checksum

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        with self._lock:  # copied under the lock: the blocks are not reused meanwhile
            page = self._pages.get(key)
            if page is None or page.alloc.size != total_size(buffers):
                self._stats.misses += 1
                return None
            self._hit_locked(key, page)
            scatter_copy([as_bytes_view(b) for b in buffers], self.arena.views(page.alloc))
            return page.checksum

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self._lock:
            page = self._pages.get(key)
            if page is None:
                self._stats.misses += 1
                return None, 0
            self._hit_locked(key, page)
            return b"".join(self.arena.views(page.alloc)), page.checksum

    def peek_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self._lock:
            page = self._pages.get(key)
            return (None, 0) if page is None else (b"".join(self.arena.views(page.alloc)), page.checksum)

    def read_count(self, key: PageKey) -> int:
        with self._lock:
            page = self._pages.get(key)
            return page.reads if page is not None else 0

    # ------------------------------------------------------------ the rest
    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        with self._lock:
            return [k in self._pages for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        with self._lock:
            present = [k for k in keys if k in self._pages]
            for key in present:
                self._drop_locked(key)
            return len(present)

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            doomed = [k for k in self._pages if namespace is None or k[0] == namespace]
            for key in doomed:
                self._drop_locked(key)
            return len(doomed)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        pages = freed = 0
        with self._lock:
            while freed < nbytes and self._pages:
                before = self._stats.used_bytes
                if not self._evict_one_locked():
                    break
                pages, freed = pages + 1, freed + before - self._stats.used_bytes
        return pages, freed

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{**self._stats.__dict__, "extra": {}, "per_namespace": {}})
            snap.pages = len(self._pages)
            snap.extra = {"free_blocks": self.arena.free_blocks(), "leases": self.arena.lease_count(),
                          "pages_leased": self._leased, "pages_copied_in": self._copied_in}
            return snap

    def close(self) -> None:
        with self._lock:
            self._pages.clear()
        self.arena.close()

    # ------------------------------------------------------------- helpers
    def _hit_locked(self, key: PageKey, page: _Page) -> None:
        page.reads += 1
        self.policy.touch(key)
        self._stats.hits += 1
        self._stats.bytes_read += page.alloc.size

    def _drop_locked(self, key: PageKey) -> _Page:
        page = self._pages.pop(key)
        self.policy.remove(key)
        self.arena.give(page.alloc)  # parked while leased: a reader never sees the next page's bytes
        self._stats.used_bytes -= page.alloc.size
        return page

    def _evict_one_locked(self) -> bool:
        victim = self.policy.pop_victim()
        if victim is None:
            return False
        page = self._pages.pop(victim)
        if self._evictions is not None:  # handed on (copied) before its blocks are reused
            self._evictions.page_evicted(victim, self.arena.views(page.alloc), page.reads, page.checksum)
        self.arena.give(page.alloc)
        self._stats.used_bytes -= page.alloc.size
        self._stats.evictions += 1
        return True


def _build(tier, quotas=None, evictions: Optional[EvictionListener] = None) -> ArenaStore:
    return ArenaStore(tier.capacity, tier.policy, tier.max_page_bytes, evictions, tier.options["block_size"],
                      tier.name)


# What tiers/plugins.py loads for kind = "memarena".
KIND = StoreKind("memarena", _build,
                 options={"block_size": (parse_size, "64KiB", "arena allocation unit; a page spans whole blocks")},
                 description="pages in an arena the engines map read-only (an example plug-in that shares memory)")
