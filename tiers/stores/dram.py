"""The DRAM tier: pages in one sealed shared-memory arena, bounded, evicting by policy and fair share.

Pages live in a BlockArena (tiers/shm/arena.py): ceil(size / block_size) blocks
each, not necessarily contiguous, so any freed page makes room for any new
one and the byte bound is exact.  Engines map the arena read-only and copy
leased pages out themselves (``lease_pages``); writes are reserved, copied
outside the lock under a SIGBUS guard (a truncated host pool is a refusal,
not a dead daemon), then committed.  Each namespace has its own policy; the
namespace that gives up space is chosen by tiers/stores/fairness.py.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from tiers.shm.arena import Alloc, BlockArena, Extents
from tiers.shm.buffers import MemoryFault, as_bytes_view, scatter_copy
from tiers.stores.fairness import FairShare, GroupUsage, VictimPlan, bounded_top
from tiers.stores.page_index import ORDER_NONE, PageIndex
from tiers.policies import EvictionPolicy
from tiers.plugins import make_policy
from tiers.stores.base import (Buffers, EvictionListener, PageKey, PageStore, PageTooLarge, SourceGone, StoreFull,
                               StoreStats, total_size)
from tiers.plugins import StoreKind
from tiers.wire.protocol import key_digest, pack_key_digests

log = logging.getLogger("hicache.dram")


# Bytes a batch reserve evicts for in one lock hold at most: under write-back each evicted page is copied
# into the demotion queue inside the lock, and every reader of the tier waits meanwhile (about a millisecond
# at this size; a batch of 128 pages of 8 MiB would have held it for ~0.1 s).  Past it the batch goes on in
# the next hold.
EVICT_AHEAD_BYTES = 8 << 20
# Seconds of evicting ahead in one lock hold at most, whatever the bytes: choosing a victim walks every
# namespace (tiers/stores/fairness.py), so with thousands of them a batch's evictions in one hold would stall
# the tier's readers for as long as those evictions page by page, each in a hold of its own, would have.
EVICT_AHEAD_S = 0.001


@dataclass(slots=True)
class _Entry:
    alloc: Alloc
    reads: int = 0
    checksum: int = 0  # the writer's xxh3_64 of the page (0: unknown), returned with every read

    @property
    def size(self) -> int:
        return self.alloc.size


@dataclass
class _Tenant:
    """One namespace's policy and figures."""

    policy: EvictionPolicy
    bytes: int = 0
    hits: int = 0
    evictions: int = 0


class DramStore(PageStore):
    """Pages in a memfd arena of fixed-size blocks."""

    parallel_io = False  # one copy at a time: two copies on two cores ran slower than one here
    keeps_checksums = True
    answers_digests = True  # self._held is keyed by key_digest

    def __init__(self, capacity: int, policy: str = "lru", block_size: int = 64 << 10,
                 max_page_bytes: int = 64 << 20, name: str = "dram", prefault: bool = True,
                 quotas: Optional[Mapping[str, int]] = None, evictions: Optional[EvictionListener] = None):
        self.arena = BlockArena(capacity, block_size, name, prefault)
        self.block_size = block_size
        self.capacity = self.arena.size
        self.max_page_bytes = max_page_bytes
        self._policy_name = policy
        # An unknown name fails here, not at the first write.
        self._room_for_batches = make_policy(policy).evicts_new_pages_last
        self._index: Dict[PageKey, _Entry] = {}
        # Every page's key_digest, beside the index: a lookup of 1,024 keys (or of their packed digests) is one
        # native call, with no Python object a key (tiers/stores/page_index.py; the GIL is its lock).
        self._held = PageIndex(ORDER_NONE)
        self._tenants: Dict[str, _Tenant] = {}
        self._fair = FairShare(self.capacity, quotas)
        # Fairness's plan of victims for the last writer (tiers/stores/fairness.py VictimPlan), good while the
        # usage changed only by its victims and the writer's own batch: (usage version, writer, over quota,
        # plan, the writer's pending bytes it knows of).  Evicting page after page walks the namespaces once.
        self._victim_plan = None
        self._usage_version = 0
        self._groups = GroupUsage()  # each quota'd group's bytes and its namespaces by bytes, kept current
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=self.capacity)
        self._evictions = evictions

    def export_arena(self) -> BlockArena:
        return self.arena

    # ------------------------------------------------------------- helpers
    def _tenant(self, namespace: str) -> _Tenant:
        tenant = self._tenants.get(namespace)
        if tenant is None:
            tenant = self._tenants[namespace] = _Tenant(make_policy(self._policy_name))
        return tenant

    def _release_locked(self, key: PageKey) -> Optional[_Entry]:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.arena.give(entry.alloc)  # parked while a reader's lease holds them
            self._stats.used_bytes -= entry.size
            tenant = self._tenants[key[0]]
            self._held.remove(key_digest(*key))
            tenant.bytes -= entry.size
            tenant.policy.remove(key)
            self._usage_version += 1
            self._bytes_changed_locked(key[0], tenant, -entry.size)
        return entry

    def _evict_one_locked(self, writer: Optional[str], need: int = 0, only: Optional[str] = None,
                          pending: int = 0) -> bool:
        """pending: bytes the writer has reserved for pages of its batch not committed yet (they count as
        its own, as they would once committed page by page)."""
        own = self._tenants.get(writer) if writer is not None else None
        over = own is not None and self._fair.over_quota(writer, own.bytes + pending + need)
        plan, namespace, grown = None, only, pending if own is not None else 0
        if only is None:
            kept = self._victim_plan
            if kept is not None and kept[:3] == (self._usage_version, writer, over):
                plan = kept[3]
                if grown != kept[4]:
                    plan.grew(writer, grown - kept[4])
            else:
                held = {ns: t.bytes for ns, t in self._tenants.items()}
                if grown:
                    held[writer] += grown
                plan = VictimPlan(self._fair, writer, held, over)
            namespace = plan.next()
        tenant = self._tenants.get(namespace) if namespace is not None else None
        victim = tenant.policy.pop_victim() if tenant is not None else None
        if victim is None:
            return False
        entry = self._index[victim]
        if self._evictions is not None:
            # Runs inside the lock: the listener copies the page into the demotion queue (bounded memory,
            # tiers/node/demotion.py) and never waits on a peer; the blocks are free for the writer at once
            # (pinning them instead made a writer of a full arena evict more pages, or fail).
            self._evictions.page_evicted(victim, self.arena.views(entry.alloc), entry.reads, entry.checksum)
        self._release_locked(victim)
        if plan is not None:  # the usage changed only as the plan knows
            plan.gave(namespace, entry.size)
            self._victim_plan = (self._usage_version, writer, over, plan, grown)
        tenant.evictions += 1
        self._stats.evictions += 1
        return True

    def _quota_room_locked(self, namespace: str) -> Optional[Tuple[int, str, int]]:
        """(bytes namespace may still add, the namespace that gives way when it adds more, what that quota's
        holder holds) under the tighter of its [quotas] entry and its tenant's quota; None: no quota."""
        room = None
        tenant = self._tenants.get(namespace)
        own = tenant.bytes if tenant is not None else 0
        limit = self._fair.quota(namespace)
        if limit is not None:
            room = (limit - own, namespace, own)
        group_limit, members = self._fair.group_quota(namespace)
        if group_limit is not None:
            group = self._fair.group(namespace)
            total = self._groups.total(group, members, self._bytes_of)
            if room is None or group_limit - total < room[0]:
                # The tenant's largest namespace gives way (of equals, the smallest name): a tenant's newest
                # namespace does not evict its own pages while older ones hold more.
                giver = self._groups.largest(group, members, self._bytes_of) or namespace
                room = (group_limit - total, giver, total)
        return room

    def _bytes_of(self, namespace: str) -> int:
        tenant = self._tenants.get(namespace)
        return tenant.bytes if tenant is not None else 0

    def _bytes_changed_locked(self, namespace: str, tenant: _Tenant, delta: int) -> None:
        if self._groups:
            self._groups.changed(self._fair.group(namespace), delta, namespace, tenant.bytes, len(self._tenants))

    def _allocate_locked(self, namespace: str, size: int) -> Alloc:
        while True:
            room = self._quota_room_locked(namespace)
            if room is None or room[0] >= size:
                break
            if not self._evict_one_locked(namespace, only=room[1]):
                break  # a page larger than the quota still fits once the namespace holds nothing else
        while True:
            alloc = self.arena.take(size)
            if alloc is not None:
                return alloc
            if not self._evict_one_locked(namespace, size):
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
                room = self._quota_room_locked(key[0])
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
        EVICT_AHEAD_BYTES of pages or EVICT_AHEAD_S in one call (one lock hold).
        """
        largest = min(self.max_page_bytes, self.capacity)
        sizes = sizes[:next((i for i, size in enumerate(sizes) if not 0 < size <= largest), len(sizes))]
        evict = evict and self._room_for_batches
        with self._lock:
            room = self._quota_room_locked(namespace)
            # What fits as it is, taken at once; then page by page, evicting.
            out = self.arena.take_many(sizes if room is None else _within(sizes, room[0]))
            pending = sum(alloc.size for alloc in out)
            index = self._index
            seen = set(keys[:len(out)])  # a key twice in a batch replaces its own first copy when committed
            replaces = len(seen) < len(out) or any((namespace, key) in index for key in seen)
            until = time.perf_counter() + EVICT_AHEAD_S
            for key, size in zip(keys[len(out):], sizes[len(out):]):
                while room is not None and pending + size > room[0]:
                    if not (evict and room[2] and not replaces and self._evict_one_locked(namespace, only=room[1])):
                        return out
                    room = self._quota_room_locked(namespace)
                alloc = self.arena.take(size)
                while (alloc is None and evict and not replaces and pending < EVICT_AHEAD_BYTES
                       and time.perf_counter() < until and self._evict_one_locked(namespace, size, pending=pending)):
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
        with self._lock:
            tenant = self._tenant(namespace)
            index, held, policy, added = self._index, self._held, tenant.policy, 0
            for key, alloc, parent, checksum in zip(keys, allocs, parents, checksums):
                page = (namespace, key)
                if page in index:
                    self._release_locked(page)
                index[page] = _Entry(alloc, checksum=checksum)
                held.insert(key_digest(namespace, key), 0, alloc.size)
                policy.insert(page, (namespace, parent) if parent else None)
                added += alloc.size
            tenant.bytes += added
            self._bytes_changed_locked(namespace, tenant, added)
            kept = self._victim_plan
            if kept is not None and kept[:2] == (self._usage_version, namespace):
                # The writer's batch, counted by its plan as pending, is its own now: the plan stays good.
                self._victim_plan = kept[:4] + (kept[4] - added,)
            else:
                self._usage_version += 1
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

    def _lookup_for_read_locked(self, key: PageKey, size: Optional[int] = None) -> Optional[_Entry]:
        entry = self._index.get(key)
        if entry is None or (size is not None and entry.size != size):
            self._stats.misses += 1
            return None
        entry.reads += 1
        tenant = self._tenants[key[0]]
        tenant.policy.touch(key)
        tenant.hits += 1
        self._stats.hits += 1
        self._stats.bytes_read += entry.size
        return entry

    def lease_pages(self, keys: Sequence[PageKey], sizes: Sequence[int], owner: int, expiry: float,
                    max_bytes: int) -> Tuple[Optional[int], List[Optional[Extents]], List[int]]:
        """Pin the leading pages held with the expected sizes, up to max_bytes, for an engine to copy out."""
        found: List[Optional[Extents]] = []
        sums: List[int] = []
        allocs: List[Alloc] = []
        leased = hits = 0
        index, tenants = self._index, self._tenants
        namespace, tenant = None, None
        with self._lock:
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
            stats = self._stats
            stats.hits += hits
            stats.misses += len(found) - hits
            stats.bytes_read += leased
            lease = self.arena.lease(owner, allocs, expiry) if allocs else None
        return lease, found, sums

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        dst = [as_bytes_view(b) for b in buffers]
        size = total_size(dst)
        with self._lock:
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

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self._lock:
            entry = self._lookup_for_read_locked(key)
            if entry is None:
                return None, 0
            return b"".join(self.arena.views(entry.alloc)), entry.checksum

    def peek(self, key: PageKey) -> Optional[bytes]:
        return self.peek_with_sum(key)[0]

    def peek_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        with self._lock:
            entry = self._index.get(key)
            return (None, 0) if entry is None else (b"".join(self.arena.views(entry.alloc)), entry.checksum)

    def pin_page(self, key: PageKey, owner: int) -> Optional[Tuple[int, Extents, int]]:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            return self.arena.lease(owner, [entry.alloc], float("inf")), entry.alloc.extents, entry.checksum

    def read_count(self, key: PageKey) -> int:
        """How many times key was read since it was stored (0 when absent)."""
        with self._lock:
            entry = self._index.get(key)
            return entry.reads if entry else 0

    def held(self, namespace: str, keys: List[str]) -> bytes:
        return self._held.contains_packed(pack_key_digests(namespace, keys))

    def held_digests(self, namespace: str, digests: bytes) -> bytes:
        return self._held.contains_packed(digests)

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        index = self._index
        return [k in index for k in keys]

    def delete(self, keys: Iterable[PageKey]) -> int:
        with self._lock:
            return sum(1 for key in keys if self._release_locked(key) is not None)

    def clear(self, namespace: Optional[str] = None) -> int:
        with self._lock:
            doomed = [k for k in self._index if namespace is None or k[0] == namespace]
            for key in doomed:
                self._release_locked(key)
            return len(doomed)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        pages = freed = 0
        with self._lock:
            while freed < nbytes:
                before = self._stats.used_bytes
                if not self._evict_one_locked(None, only=namespace):
                    break
                pages, freed = pages + 1, freed + before - self._stats.used_bytes
        return pages, freed

    def assign_tenant(self, namespace: str, tenant: str, quota: Optional[int] = None) -> None:
        with self._lock:
            self._fair.assign(namespace, ("tenant", tenant), quota)
            self._usage_version += 1
            self._groups.clear()

    def prune(self) -> int:
        """Forget the namespaces that hold nothing (their counters with them): a tenant opening namespace
        after namespace leaves no state behind, and eviction walks only those that hold. Called between
        requests (the daemon's housekeeping), never inside an eviction, so no choice sees one vanish."""
        with self._lock:
            empty = [ns for ns, t in self._tenants.items() if not t.bytes and not len(t.policy)]
            for ns in empty:
                del self._tenants[ns]
            self._usage_version += 1
            self._groups.clear()
            return len(empty)

    def stats(self) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items()
                                 if k not in ("extra", "per_namespace")})
            snap.pages = len(self._index)
            snap.extra = {"block_size": self.block_size, "free_blocks": self.arena.free_blocks(),
                          "leases": self.arena.lease_count(), "pinned_pages": self.arena.pinned_allocations(),
                          "leases_expired": self.arena.leases_expired, "namespaces": len(self._tenants)}
            # Counted once, not once a namespace: with thousands of namespaces that sum made stats quadratic
            # (seconds under the store lock).
            fair_share = int(self._fair.share(len(self._fair.groups_held({ns: t.bytes for ns, t in self._tenants.items()}))))
            per_ns = {ns: {"bytes": t.bytes, "pages": len(t.policy), "hits": t.hits, "evictions": t.evictions,
                           "fair_share": fair_share, "quota": self._fair.quota(ns) or 0}
                      for ns, t in self._tenants.items() if t.bytes or t.hits or t.evictions}
            snap.per_namespace = bounded_top(per_ns)
            return snap

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._tenants.clear()
            self._usage_version += 1
            self._groups.clear()
            self.arena.close()


def _build(tier, quotas=None, evictions: Optional[EvictionListener] = None) -> DramStore:
    return DramStore(tier.capacity, tier.policy, block_size=tier.options["block_size"],
                     max_page_bytes=tier.max_page_bytes, name=tier.name, prefault=tier.options["prefault"],
                     quotas=quotas, evictions=evictions)


# The dram kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS["dram"]).
KIND = StoreKind("dram", _build, description="pages in a sealed memfd arena of fixed blocks")


def _within(sizes: Sequence[int], room: int) -> Sequence[int]:
    """The leading sizes that add up to at most room."""
    for i, size in enumerate(sizes):
        room -= size
        if room < 0:
            return sizes[:i]
    return sizes
