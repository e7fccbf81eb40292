"""The DRAM tier: pages in one sealed shared-memory arena, bounded, evicting by policy and fair share.

Pages live in a BlockArena (tiers/shm/arena.py): ceil(size / block_size) blocks
each, not necessarily contiguous, so any freed page makes room for any new
one and the byte bound is exact.  Engines map the arena read-only and copy
leased pages out themselves (``lease_pages``); writes are reserved, copied
outside the lock under a SIGBUS guard (a truncated host pool is a refusal,
not a dead daemon), then committed.  Each namespace has its own policy; the
namespace that gives up space is chosen by tiers/stores/fairness.py.

This module reserves, commits and evicts; the namespaces' figures, quotas
and victim plan are tiers/stores/dram_tenants.py's, and reads and leases
tiers/stores/dram_reads.py's.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from tiers.shm.arena import Alloc, BlockArena, Extents
from tiers.shm.buffers import MemoryFault, as_bytes_view, scatter_copy
from tiers.shm.directory import PageDirectory
from tiers.stores.dram_evictions import DramEvictions
from tiers.stores.dram_reads import DramReads, PageEntry
from tiers.stores.dram_tenants import Tenants
from tiers.stores.fairness import bounded_top
from tiers.stores.page_index import ORDER_NONE, PageIndex
from tiers.plugins import make_policy
from tiers.stores.base import (INDEX_BYTES_PER_PAGE, Buffers, EvictionListener, PageKey, PageStore, PageTooLarge,
                               SourceGone, StoreFull, StoreStats, total_size)
from tiers.plugins import StoreKind
from tiers.wire.protocol import pack_key_digests

log = logging.getLogger("hicache.dram")


# Bytes a batch reserve evicts for in one lock hold at most where evicted pages are copied out (write-back:
# each into the demotion queue inside the lock, and every reader of the tier waits meanwhile: about a
# millisecond at this size; a batch of 128 pages of 8 MiB would have held it for ~0.1 s).  Past it the batch
# goes on in the next hold.  With nobody listening a victim costs no copy, and EVICT_AHEAD_S bounds the hold.
EVICT_AHEAD_BYTES = 8 << 20
# Seconds of evicting ahead in one lock hold at most, whatever the bytes: choosing a victim walks every
# namespace (tiers/stores/fairness.py), so with thousands of them a batch's evictions in one hold would stall
# the tier's readers for as long as those evictions page by page, each in a hold of its own, would have.
EVICT_AHEAD_S = 0.001


class DramStore(PageStore):
    """Pages in a memfd arena of fixed-size blocks."""

    parallel_io = False  # one copy at a time: two copies on two cores ran slower than one here
    keeps_checksums = True
    answers_digests = True  # self._held is keyed by key_digest

    def __init__(self, capacity: int, policy: str = "lru", block_size: int = 64 << 10,
                 max_page_bytes: int = 64 << 20, name: str = "dram", prefault: bool = True,
                 quotas: Optional[Mapping[str, int]] = None, evictions: Optional[EvictionListener] = None,
                 engine_reads: bool = True):
        self.arena = BlockArena(capacity, block_size, name, prefault)
        # Where each page lies, for engines to read hits without asking (tiers/shm/directory.py); written
        # under self._lock, before any block of a page leaves it.
        self.directory = PageDirectory(self.arena.n_blocks, block_size, name) if engine_reads else None
        self.block_size = block_size
        self.capacity = self.arena.size
        self.max_page_bytes = max_page_bytes
        # An unknown name fails here, not at the first write.
        self._room_for_batches = make_policy(policy).evicts_new_pages_last
        self._index: Dict[PageKey, PageEntry] = {}
        # Every page's key_digest, beside the index: a lookup of 1,024 keys (or of their packed digests) is one
        # native call, with no Python object a key (tiers/stores/page_index.py; the GIL is its lock).
        self._held = PageIndex(ORDER_NONE)
        self._tenants = Tenants(self.capacity, quotas, policy)
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=self.capacity)
        self._evictions = evictions
        self._evict_ahead_bytes = EVICT_AHEAD_BYTES if evictions is not None else self.capacity
        self._reads = DramReads(self._lock, self.arena, self._index, self._tenants, self._stats)
        self._evict = DramEvictions(self.arena, self._index, self._held, self.directory, self._tenants, self._stats,
                                    evictions)

    def export_arena(self) -> BlockArena:
        return self.arena

    def export_directory(self) -> Optional[PageDirectory]:
        return self.directory

    def directory_namespace(self, namespace: str) -> int:
        if self.directory is None:
            return 0
        with self._lock:
            return self.directory.namespace_id(namespace)

    def touch_reads(self, namespace: str, keys: Sequence[str], sizes: Sequence[int]) -> Tuple[int, int]:
        return self._reads.touch(namespace, keys, sizes)

    # ------------------------------------------------------------- helpers
    def _allocate_locked(self, namespace: str, size: int) -> Alloc:
        while True:
            room = self._tenants.quota_room(namespace)
            if room is None or room[0] >= size:
                break
            if not self._evict.evict_one_locked(namespace, only=room[1]):
                break  # a page larger than the quota still fits once the namespace holds nothing else
        while True:
            alloc = self.arena.take(size)
            if alloc is not None:
                return alloc
            if not self._evict.evict_one_locked(namespace, size):
                raise StoreFull("arena full (every page is being read or written)")

    # ----------------------------------------------------------- interface
    def reserve(self, key: PageKey, size: int, evict: bool = True) -> Optional[Alloc]:
        """Blocks for a page of size bytes, evicting as needed; fill them, then commit or abort.

        With evict=False: None instead of evicting (the caller commits what it holds first, so
        eviction sees pages in the order they were written, as the simulator does).
        """
        if size > self.max_page_bytes or size > self.capacity or size <= 0:
            raise PageTooLarge(f"page of {size} bytes not accepted (max {min(self.max_page_bytes, self.capacity)})")
        with self._lock:
            if not evict:
                room = self._tenants.quota_room(key[0])
                if room is not None and room[0] < size and room[2]:  # a page over the quota fits an empty holder
                    return None
                return self.arena.take(size)
            return self._allocate_locked(key[0], size)

    def commit(self, key: PageKey, alloc: Alloc, parent: Optional[str] = None, checksum: int = 0) -> None:
        self.commit_many(key[0], [key[1]], [alloc], [parent], [checksum])

    def reserve_many(self, namespace: str, keys: Sequence[str], sizes: Sequence[int],
                     evict: bool = False) -> List[Alloc]:
        """reserve for a batch's pages in turn under one lock hold: the Allocs of the leading pages that fit.

        Without evict, or when the policy cannot make room for a batch ahead of inserting it
        (EvictionPolicy.evicts_new_pages_last), only pages that fit without evicting; the caller then
        reserves the next page alone, evicting, once these are committed.  Nor does it evict once a page
        held already (or one twice in the batch) is among those reserved: committing it frees its old
        blocks, and page by page the pages after it would have found them free; nor for more than
        EVICT_AHEAD_BYTES of pages where evicted pages are copied out, or EVICT_AHEAD_S, in one call (one lock
        hold).
        """
        largest = min(self.max_page_bytes, self.capacity)
        sizes = sizes[:next((i for i, size in enumerate(sizes) if not 0 < size <= largest), len(sizes))]
        evict = evict and self._room_for_batches
        with self._lock:
            room = self._tenants.quota_room(namespace)
            # What fits as it is, taken at once; then page by page, evicting.
            out = self.arena.take_many(sizes if room is None else _within(sizes, room[0]))
            pending = sum(alloc.size for alloc in out)
            index = self._index
            seen = set(keys[:len(out)])  # a key twice in a batch replaces its own first copy when committed
            replaces = len(seen) < len(out) or any((namespace, key) in index for key in seen)
            until = time.perf_counter() + EVICT_AHEAD_S
            if room is None and evict and not replaces:  # the usual full tier: victims released together
                return out + self._evict.reserve_evicting_locked(namespace, keys[len(out):], sizes[len(out):],
                                                                 pending, seen, until, self._evict_ahead_bytes)
            for key, size in zip(keys[len(out):], sizes[len(out):]):
                while room is not None and pending + size > room[0]:
                    if not (evict and room[2] and not replaces
                            and self._evict.evict_one_locked(namespace, only=room[1])):
                        return out
                    room = self._tenants.quota_room(namespace)
                alloc = self.arena.take(size)
                while (alloc is None and evict and not replaces and pending < self._evict_ahead_bytes
                       and time.perf_counter() < until and self._evict.evict_one_locked(namespace, size,
                                                                                         pending=pending)):
                    alloc = self.arena.take(size)
                if alloc is None:
                    return out
                out.append(alloc)
                pending += size
                replaces = replaces or key in seen or (namespace, key) in index
                seen.add(key)
        return out

    def commit_many(self, namespace: str, keys: Sequence[str], allocs: Sequence[Alloc],
                    parents: Sequence[Optional[str]], checksums: Sequence[int]) -> None:
        """commit for each page of a batch of one namespace, under one lock hold."""
        # The batch's digests in one native call, outside the lock; held in one more, inside it.
        digests = pack_key_digests(namespace, keys)
        sizes = np.fromiter((alloc.size for alloc in allocs), dtype="<u4", count=len(allocs)).tobytes()
        with self._lock:
            tenant = self._tenants.tenant(namespace)
            index, policy, added = self._index, tenant.policy, 0
            for key, alloc, parent, checksum in zip(keys, allocs, parents, checksums):
                page = (namespace, key)
                if page in index:  # written again (or twice in this batch): the new copy replaces the old
                    self._evict.release_keys_locked([page])
                index[page] = PageEntry(alloc, checksum=checksum)
                policy.insert(page, (namespace, parent) if parent else None)
                added += alloc.size
            self._held.insert_packed(digests, sizes)  # a key twice in the batch: held once, its last size
            if self.directory is not None:  # the pages' bytes are all in their blocks: engines may read them
                self.directory.publish(namespace, digests, [alloc.size for alloc in allocs], checksums,
                                       [alloc.extents for alloc in allocs])
            self._tenants.committed(namespace, tenant, added)
            self._stats.used_bytes += added
            self._stats.inserts += len(allocs)
            self._stats.bytes_written += added

    def abort(self, alloc: Alloc) -> None:
        self.arena.give(alloc)

    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        src = [as_bytes_view(b) for b in buffers]
        size = total_size(src)
        alloc = self.reserve(key, size)
        try:
            scatter_copy(self.arena.views(alloc), src)
        except MemoryFault as exc:
            self.abort(alloc)
            raise SourceGone(str(exc)) from None
        except BaseException:
            self.abort(alloc)
            raise
        self.commit(key, alloc, parent, checksum)

    def lease_pages(self, keys: Sequence[PageKey], sizes: Sequence[int], owner: int, expiry: float,
                    max_bytes: int) -> Tuple[Optional[int], List[Optional[Extents]], List[int]]:
        """Pin the leading pages held with the expected sizes, up to max_bytes, for an engine to copy out."""
        return self._reads.lease_pages(keys, sizes, owner, expiry, max_bytes)

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        return self._reads.get_into(key, buffers)

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        return self._reads.get_bytes(key)

    def peek(self, key: PageKey) -> Optional[bytes]:
        return self.peek_with_sum(key)[0]

    def peek_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        return self._reads.peek(key)

    def pin_page(self, key: PageKey, owner: int) -> Optional[Tuple[int, Extents, int]]:
        return self._reads.pin_page(key, owner)

    def read_count(self, key: PageKey) -> int:
        """How many times key was read since it was stored (0 when absent)."""
        return self._reads.read_count(key)

    def held(self, namespace: str, keys: List[str]) -> bytes:
        return self._held.contains_packed(pack_key_digests(namespace, keys))

    def held_digests(self, namespace: str, digests: bytes) -> bytes:
        return self._held.contains_packed(digests)

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        index = self._index
        return [k in index for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        with self._lock:
            return self._evict.release_keys_locked(list(keys))

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            return self._evict.release_keys_locked([k for k in self._index if namespace is None or k[0] == namespace])

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        pages = freed = 0
        with self._lock:
            while freed < nbytes:
                before = self._stats.used_bytes
                if not self._evict.evict_one_locked(None, only=namespace):
                    break
                pages, freed = pages + 1, freed + before - self._stats.used_bytes
        return pages, freed

    def assign_tenant(self, namespace: str, tenant: str, quota: Optional[int] = None) -> None:
        with self._lock:
            self._tenants.assign(namespace, tenant, quota)

    def prune(self) -> int:
        """Forget the namespaces that hold nothing (their counters with them): a tenant opening namespace
        after namespace leaves no state behind, and eviction walks only those that hold. Called between
        requests (the daemon's housekeeping), never inside an eviction, so no choice sees one vanish."""
        with self._lock:
            pruned = self._tenants.prune()
            if self.directory is not None:  # a namespace that holds nothing gives its number up too
                for namespace in self.directory.namespaces():
                    if namespace not in self._tenants.by_name:
                        self.directory.forget_namespace(namespace)
            return pruned

    def index_bytes(self) -> int:
        """What the pages held cost outside the arena (INDEX_BYTES_PER_PAGE each, and the digests' native table);
        no lock: a racing count is off by a batch, and the memory guard asks once a second."""
        return len(self._index) * INDEX_BYTES_PER_PAGE + self._held.nbytes()

    def namespace_figures(self, namespace: str) -> Optional[dict]:
        with self._lock:
            return self._tenants.figures(namespace)

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items()
                                 if k not in ("extra", "per_namespace")})
            snap.pages = len(self._index)
            snap.extra = {"block_size": self.block_size, "free_blocks": self.arena.free_blocks(),
                          "leases": self.arena.lease_count(), "pinned_pages": self.arena.pinned_allocations(),
                          "leases_expired": self.arena.leases_expired, "namespaces": len(self._tenants.by_name),
                          "directory_bytes": self.directory.size if self.directory is not None else 0}
            snap.per_namespace = bounded_top(self._tenants.per_namespace())
            return snap

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._tenants.clear()
            self.arena.close()
            if self.directory is not None:
                self.directory.close()


def _build(tier, quotas=None, evictions: Optional[EvictionListener] = None) -> DramStore:
    return DramStore(tier.capacity, tier.policy, block_size=tier.options["block_size"],
                     max_page_bytes=tier.max_page_bytes, name=tier.name, prefault=tier.options["prefault"],
                     quotas=quotas, evictions=evictions, engine_reads=tier.options["engine_reads"])


# The dram kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS["dram"]).
KIND = StoreKind("dram", _build, description="pages in a sealed memfd arena of fixed blocks")


def _within(sizes: Sequence[int], room: int) -> Sequence[int]:
    """The leading sizes that add up to at most room."""
    for i, size in enumerate(sizes):
        room -= size
        if room < 0:
            return sizes[:i]
    return sizes
