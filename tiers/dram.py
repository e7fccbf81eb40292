"""The DRAM tier: pages in one shared-memory arena, bounded, evicting by policy.

The arena is a memfd of ``capacity`` bytes cut into fixed blocks; a page takes
ceil(size / block_size) blocks, not necessarily contiguous, so any freed page
makes room for any new one and the byte bound is exact.  Blocks are handed out
lowest-first, so a fresh arena gives contiguous runs and one memcpy a page.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from itertools import repeat
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from tiers.buffers import as_bytes_view, block_extents, populate, scatter_copy
from tiers.policies import make_policy
from tiers.store import Buffers, PageKey, PageStore, PageTooLarge, StoreFull, StoreStats, total_size

log = logging.getLogger("hicache.dram")
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


@dataclass
class _Entry:
    extents: List[Tuple[int, int]]  # (offset, length) in the arena
    size: int
    blocks: List[int]
    reads: int = 0


class DramStore(PageStore):
    """Pages in a memfd arena of fixed-size blocks."""

    def __init__(self, capacity: int, policy: str = "lru", block_size: int = 64 << 10,
                 max_page_bytes: int = 64 << 20, name: str = "dram", prefault: bool = True):
        if block_size <= 0 or capacity < block_size:
            raise ValueError("capacity must hold at least one block")
        self.block_size = block_size
        self.n_blocks = capacity // block_size
        self.capacity = self.n_blocks * block_size
        self.max_page_bytes = max_page_bytes
        self._fd = os.memfd_create(f"hicache-{name}", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.capacity)  # sparse: memory is used only when written
        self._map = mmap.mmap(self._fd, self.capacity)
        self._arena = memoryview(self._map)
        if prefault:
            self._prefault()
        self._free = list(range(self.n_blocks - 1, -1, -1))  # a stack, lowest block on top
        self._index: Dict[PageKey, _Entry] = {}
        self._policy = make_policy(policy)
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=self.capacity)
        # Called with (key, page views, reads) before an evicted page's blocks are
        # reused: the write-back router demotes it to the next tier here.
        self.on_evict: Optional[Callable[[PageKey, List[memoryview], int], None]] = None

    def _prefault(self) -> None:
        """Fault the whole arena in now: a first touch costs ~10x a warm copy (0.5 vs 3-7 GB/s here)."""
        started = time.perf_counter()
        try:
            self._map.madvise(_MADV_HUGEPAGE)  # where shmem THP is enabled; harmless elsewhere
        except (OSError, ValueError):
            pass
        if not populate(self._map):
            step = mmap.PAGESIZE
            for offset in range(0, self.capacity, step):
                self._map[offset] = 0
        log.info("prefaulted %d MiB of arena in %.2fs", self.capacity >> 20, time.perf_counter() - started)

    # ------------------------------------------------------------- helpers
    def _views(self, entry: _Entry) -> List[memoryview]:
        return [self._arena[off:off + n] for off, n in entry.extents]

    def _release_locked(self, key: PageKey) -> Optional[_Entry]:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._free.extend(reversed(entry.blocks))
            self._stats.used_bytes -= entry.size
        return entry

    def _evict_one_locked(self) -> bool:
        victim = self._policy.pop_victim()
        if victim is None:
            return False
        entry = self._index[victim]
        if self.on_evict is not None:
            self.on_evict(victim, self._views(entry), entry.reads)
        self._release_locked(victim)
        self._stats.evictions += 1
        return True

    def _allocate_locked(self, size: int) -> Tuple[List[int], List[Tuple[int, int]]]:
        needed = -(-size // self.block_size)
        while len(self._free) < needed:
            if not self._evict_one_locked():
                raise StoreFull("arena full")
        blocks = [self._free.pop() for _ in range(needed)]
        return blocks, block_extents(blocks, self.block_size, size)

    # ----------------------------------------------------------- interface
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        src = [as_bytes_view(b) for b in buffers]
        size = total_size(src)
        if size > self.max_page_bytes or size > self.capacity or size == 0:
            raise PageTooLarge(f"page of {size} bytes not accepted (max {min(self.max_page_bytes, self.capacity)})")
        with self._lock:
            if self._release_locked(key) is not None:
                self._policy.remove(key)
            blocks, extents = self._allocate_locked(size)
            entry = _Entry(extents=extents, size=size, blocks=blocks)
            try:
                scatter_copy(self._views(entry), src)
            except BaseException:
                self._free.extend(reversed(blocks))
                raise
            self._index[key] = entry
            self._policy.insert(key, (key[0], parent) if parent else None)
            self._stats.used_bytes += size
            self._stats.inserts += 1
            self._stats.bytes_written += size

    def _lookup_for_read_locked(self, key: PageKey) -> Optional[_Entry]:
        entry = self._index.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        entry.reads += 1
        self._policy.touch(key)
        self._stats.hits += 1
        self._stats.bytes_read += entry.size
        return entry

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        dst = [as_bytes_view(b) for b in buffers]
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.size != total_size(dst):
                self._stats.misses += 1
                return False
            self._lookup_for_read_locked(key)
            scatter_copy(dst, self._views(entry))
            return True

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        with self._lock:
            entry = self._lookup_for_read_locked(key)
            if entry is None:
                return None
            return b"".join(self._views(entry))

    def peek(self, key: PageKey) -> Optional[bytes]:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else b"".join(self._views(entry))

    def read_count(self, key: PageKey) -> int:
        """How many times key was read since it was stored (0 when absent)."""
        with self._lock:
            entry = self._index.get(key)
            return entry.reads if entry else 0

    def held(self, namespace: str, keys: List[str]) -> bytes:
        # One C-level pass: a lookup of 1,024 keys is on the engine's prefetch path.
        return bytes(map(self._index.__contains__, zip(repeat(namespace), keys)))

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        index = self._index
        return [k in index for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if self._release_locked(key) is not None:
                    self._policy.remove(key)
                    removed += 1
        return removed

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            doomed = [k for k in self._index if namespace is None or k[0] == namespace]
            for key in doomed:
                self._release_locked(key)
                self._policy.remove(key)
            return len(doomed)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        pages = freed = 0
        with self._lock:
            if namespace is None:
                while freed < nbytes and len(self._policy):
                    before = self._stats.used_bytes
                    self._evict_one_locked()
                    pages, freed = pages + 1, freed + before - self._stats.used_bytes
                return pages, freed
            # One namespace: walk the policy's order, putting other tenants' keys back.
            skipped = []
            while freed < nbytes:
                victim = self._policy.pop_victim()
                if victim is None:
                    break
                if victim[0] != namespace:
                    skipped.append(victim)
                    continue
                entry = self._index[victim]
                if self.on_evict is not None:
                    self.on_evict(victim, self._views(entry), entry.reads)
                self._release_locked(victim)
                self._stats.evictions += 1
                pages, freed = pages + 1, freed + entry.size
            for key in skipped:  # they lose their recency rank: an operator action, rare
                self._policy.insert(key)
            return pages, freed

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items() if k != "extra"})
            snap.pages = len(self._index)
            snap.extra = {"block_size": self.block_size, "free_blocks": len(self._free)}
            return snap

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._arena.release()
            self._map.close()
            os.close(self._fd)
