"""The DRAM tier's reads: pages leased for engines to copy out of the arena themselves, or copied here.

A read counts as a hit and touches its page in its namespace's policy under
the store's lock; the bytes are copied outside it, the page's blocks held by
a lease meanwhile (tiers/shm/arena.py), so an eviction parks them instead of
handing them to a writer.  PageEntry is what the index holds a page by.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from tiers.shm.arena import Alloc, BlockArena, Extents
from tiers.shm.buffers import as_bytes_view, scatter_copy
from tiers.stores.base import Buffers, PageKey, StoreStats, total_size
from tiers.stores.dram_tenants import Tenants


@dataclass(slots=True)
class PageEntry:
    """A page the tier holds: its blocks, reads since stored, and checksum."""

    alloc: Alloc
    reads: int = 0
    checksum: int = 0  # the writer's xxh3_64 of the page (0: unknown), returned with every read

    @property
    def size(self) -> int:
        return self.alloc.size


@dataclass
class DramReads:
    """Reads of the pages of one DramStore, under its lock."""

    lock: threading.Lock
    arena: BlockArena
    index: Dict[PageKey, PageEntry]
    tenants: Tenants
    stats: StoreStats  # the store's counters: hits, misses, bytes read

    def _lookup_for_read_locked(self, key: PageKey, size: Optional[int] = None) -> Optional[PageEntry]:
        entry = self.index.get(key)
        if entry is None or (size is not None and entry.size != size):
            self.stats.misses += 1
            return None
        entry.reads += 1
        tenant = self.tenants.by_name[key[0]]
        tenant.policy.touch(key)
        tenant.hits += 1
        self.stats.hits += 1
        self.stats.bytes_read += entry.size
        return entry

    def lease_pages(self, keys: Sequence[PageKey], sizes: Sequence[int], owner: int, expiry: float,
                    max_bytes: int) -> Tuple[Optional[int], List[Optional[Extents]], List[int]]:
        """Pin the leading pages held with the expected sizes, up to max_bytes, for an engine to copy out."""
        found: List[Optional[Extents]] = []
        sums: List[int] = []
        allocs: List[Alloc] = []
        leased = hits = 0
        index, tenants = self.index, self.tenants.by_name
        namespace, tenant = None, None
        with self.lock:
            for key, size in zip(keys, sizes):
                entry = index.get(key)
                if entry is None or entry.alloc.size != size or leased + size > max_bytes:
                    found.append(None)
                    sums.append(0)
                    continue
                if key[0] != namespace:  # a batch is one namespace's: its tenant is looked up once
                    namespace, tenant = key[0], tenants[key[0]]
                entry.reads += 1
                tenant.policy.touch(key)
                tenant.hits += 1
                hits += 1
                found.append(entry.alloc.extents)
                sums.append(entry.checksum)
                allocs.append(entry.alloc)
                leased += size
            stats = self.stats
            stats.hits += hits
            stats.misses += len(found) - hits
            stats.bytes_read += leased
            lease = self.arena.lease(owner, allocs, expiry) if allocs else None
        return lease, found, sums

    def touch(self, namespace: str, keys: Sequence[str], sizes: Sequence[int]) -> Tuple[int, int]:
        """Pages an engine read through the page directory (tiers/shm/directory.py): counted as the leased
        reads they replaced (hits, reads, recency), after the fact; (pages still held at those sizes, their
        bytes)."""
        touched = nbytes = 0
        with self.lock:
            tenant = self.tenants.by_name.get(namespace)
            if tenant is None:
                return 0, 0
            for key, size in zip(keys, sizes):
                page = (namespace, key)
                entry = self.index.get(page)
                if entry is None or entry.alloc.size != size:
                    continue
                entry.reads += 1
                tenant.policy.touch(page)
                touched += 1
                nbytes += size
            tenant.hits += touched
            self.stats.hits += touched
            self.stats.bytes_read += nbytes
        return touched, nbytes

    def get_into(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        """The page copied into buffers: its checksum, None on a miss."""
        dst = [as_bytes_view(b) for b in buffers]
        size = total_size(dst)
        with self.lock:
            entry = self._lookup_for_read_locked(key, size)
            if entry is None:
                return None
            alloc, checksum = entry.alloc, entry.checksum
            lease = self.arena.lease(0, [alloc], float("inf"))  # held only for this copy
        try:
            scatter_copy(dst, self.arena.views(alloc))
        finally:
            self.arena.release(lease, 0)
        return checksum

    def get_bytes(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self.lock:
            entry = self._lookup_for_read_locked(key)
            if entry is None:
                return None, 0
            return b"".join(self.arena.views(entry.alloc)), entry.checksum

    def peek(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        """The page and its checksum, not counted as a read."""
        with self.lock:
            entry = self.index.get(key)
            return (None, 0) if entry is None else (b"".join(self.arena.views(entry.alloc)), entry.checksum)

    def pin_page(self, key: PageKey, owner: int) -> Optional[Tuple[int, Extents, int]]:
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                return None
            return self.arena.lease(owner, [entry.alloc], float("inf")), entry.alloc.extents, entry.checksum

    def read_count(self, key: PageKey) -> int:
        """How many times key was read since it was stored (0 when absent)."""
        with self.lock:
            entry = self.index.get(key)
            return entry.reads if entry else 0
