"""The NVMe tier's bookkeeping: index, policy, byte counts and counters, under one lock, no I/O.

The store owns sizes and the policy only says what to evict (the cachetools
split).  Capacity counts on-disk bytes: committed chunks plus reservations
of writes in flight.  A write reserves before it touches the disk (evicting
as needed) and then commits or releases; the victims it gets back are already
out of the index and their bytes already freed, so the caller deletes their
files before writing its own and the disk never holds more than capacity.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

from tiers.node.fairness import FairShare, bounded_top
from tiers.policies import EvictionPolicy, make_policy
from tiers.stores.base import PageKey, StoreFull, StoreStats


@dataclass
class Entry:
    path: str
    ns_hash: int
    disk_size: int
    page_key: Optional[PageKey] = None  # None until read (an index rebuilt from names)
    raw_size: Optional[int] = None
    reads: int = 0
    touched: float = 0.0  # monotonic time of the last mtime refresh


Victim = Tuple[int, Entry]


@dataclass
class _Build:
    """What changed while the index was being rebuilt in the background (tiers/stores/nvme/rebuild.py)."""

    fresh: List[int] = field(default_factory=list)  # digests committed meanwhile, in order
    gone: Set[int] = field(default_factory=set)  # digests deleted, evicted or dropped meanwhile
    cleared: Set[Optional[int]] = field(default_factory=set)  # namespace hashes cleared (None: all)
    # Once the new eviction order is being built outside the lock: what the serving store did since,
    # in order, replayed onto it under the lock at the end ("fresh" | "gone" | "touch", digest, ns hash).
    journal: Optional[List[Tuple[str, int, int]]] = None


@dataclass
class _Tenant:
    """One namespace (known by its hash; by name once a page of it was written or read) and its policy."""

    policy: EvictionPolicy
    name: Optional[str] = None
    bytes: int = 0
    reserved: int = 0  # writes in flight: a quota counts them too
    hits: int = 0
    evictions: int = 0


class Ledger:
    """Entries by digest, their policy and byte counts; every method takes the lock."""

    def __init__(self, capacity: int, policy: str, quotas: Optional[Dict[str, int]] = None):
        self.capacity = capacity
        self.lock = threading.Lock()
        self._index: Dict[int, Entry] = {}
        self._policy_name = policy
        make_policy(policy)  # an unknown name fails here
        self._tenants: Dict[int, _Tenant] = {}  # by namespace hash: each namespace evicts by its own policy
        self._fair = FairShare(capacity, quotas)
        self.used = 0
        self.reserved = 0
        self.stats = StoreStats(capacity_bytes=capacity)
        self._build: Optional[_Build] = None  # set while the index is rebuilt behind the serving store
        self.extra: Dict[str, float] = {"corrupt_removed": 0, "read_errors": 0, "enospc_retries": 0,
                                        "raw_bytes_in": 0, "stored_bytes_in": 0, "unaligned_writes": 0,
                                        "checksum_refused": 0}

    # ------------------------------------------------- background rebuild
    def start_build(self) -> None:
        with self.lock:
            self._build = _Build()

    def add_scanned(self, chunks: Iterable[Tuple[int, int, int, int, str]]) -> List[Tuple[int, str]]:
        """Index chunks the scan found, unless the serving store decided about them meanwhile: a digest
        written since wins; one deleted, evicted or of a cleared namespace is stale ((digest, path) returned,
        for the caller to unlink)."""
        stale = []
        with self.lock:
            build = self._build
            for _mtime, digest, ns_hash, size, path in chunks:
                if digest in self._index:
                    continue
                if digest in build.gone or ns_hash in build.cleared or None in build.cleared:
                    stale.append((digest, path))
                    continue
                self._index[digest] = Entry(path, ns_hash, size)
                tenant = self._tenant_locked(ns_hash)
                tenant.policy.insert(digest)
                tenant.bytes += size
                self.used += size
        return stale

    def begin_reorder(self) -> List[int]:
        """The scan ended: from now on what the store does is journaled for finish_build to replay.
        Returns the digests committed during the scan, in order (they go after every scanned chunk)."""
        with self.lock:
            self._build.journal = []
            return list(self._build.fresh)

    def new_policy(self) -> EvictionPolicy:
        return make_policy(self._policy_name)

    def finish_build(self, policies: Dict[int, EvictionPolicy]) -> List[Victim]:
        """Install the eviction orders built outside the lock (one a namespace hash, from begin_reorder
        on), after replaying onto them what the store did meanwhile; end the build; evict down to
        capacity.  The lock is held for the journal's length, not the index's."""
        with self.lock:
            build, self._build = self._build, None
            for op, digest, ns_hash in build.journal or ():
                policy = policies.get(ns_hash)
                if policy is None:
                    policy = policies[ns_hash] = make_policy(self._policy_name)
                if op == "touch":
                    policy.touch(digest)
                    continue
                policy.remove(digest)
                if op == "fresh" and self._index.get(digest) is not None:
                    policy.insert(digest)
            for ns_hash, tenant in self._tenants.items():
                tenant.policy = policies.get(ns_hash) or make_policy(self._policy_name)
            victims = []
            while self.used > self.capacity:  # capacity lowered since the last run, or written meanwhile
                victim = self._pop_victim_locked(None)
                if victim is None:
                    break
                victims.append(victim)
            return victims

    def _journal_locked(self, op: str, digest: int, ns_hash: int) -> None:
        if self._build is not None and self._build.journal is not None:
            self._build.journal.append((op, digest, ns_hash))

    def cleared(self, ns_hash: Optional[int]) -> None:
        """A namespace (None: all) was cleared: chunks of it the scan has not reached yet are stale."""
        with self.lock:
            if self._build is not None:
                self._build.cleared.add(ns_hash)

    def _tenant_locked(self, ns_hash: int, name: Optional[str] = None) -> _Tenant:
        tenant = self._tenants.get(ns_hash)
        if tenant is None:
            tenant = self._tenants[ns_hash] = _Tenant(make_policy(self._policy_name))
        if name is not None:
            tenant.name = name
        return tenant

    def get(self, digest: int) -> Optional[Entry]:
        return self._index.get(digest)

    def __contains__(self, digest: int) -> bool:
        return digest in self._index  # one dict lookup: atomic under the GIL, no lock needed

    def _pop_victim_locked(self, writer: Optional[int], need: int = 0, only: Optional[int] = None) -> Optional[Victim]:
        """The next victim: of namespace only, or of the namespace tiers/node/fairness.py chooses for writer."""
        if only is None:
            own = self._tenants.get(writer) if writer is not None else None
            over = own is not None and own.name is not None and self._fair.over_quota(own.name, own.bytes + need)
            only = self._fair.victim(writer, {h: t.bytes for h, t in self._tenants.items()}, over)
        tenant = self._tenants.get(only) if only is not None else None
        digest = tenant.policy.pop_victim() if tenant is not None else None
        if digest is None:
            return None
        entry = self._index.pop(digest)
        if self._build is not None:
            self._build.gone.add(digest)
            self._journal_locked("gone", digest, entry.ns_hash)
        self.used -= entry.disk_size
        tenant.bytes -= entry.disk_size
        tenant.evictions += 1
        self.stats.evictions += 1
        return digest, entry

    def reserve(self, nbytes: int, ns_hash: Optional[int] = None, namespace: Optional[str] = None) -> List[Victim]:
        """Claim nbytes for a page of namespace, evicting as needed (StoreFull when writes in flight fill it)."""
        with self.lock:
            if self.reserved + nbytes > self.capacity:
                raise StoreFull(f"{self.reserved} bytes of writes in flight, capacity {self.capacity}")
            victims = []
            if ns_hash is not None:
                tenant = self._tenant_locked(ns_hash, namespace)
                limit = self._fair.quota(namespace) if namespace is not None else None
                while limit is not None and tenant.bytes + tenant.reserved + nbytes > limit:
                    victim = self._pop_victim_locked(ns_hash, only=ns_hash)
                    if victim is None:
                        break
                    victims.append(victim)
            while self.used + self.reserved + nbytes > self.capacity:
                victim = self._pop_victim_locked(ns_hash, nbytes)
                if victim is None:  # cannot happen while used counts only indexed chunks
                    break
                victims.append(victim)
            self.reserved += nbytes
            if ns_hash is not None:
                self._tenants[ns_hash].reserved += nbytes
            return victims

    def release(self, nbytes: int, ns_hash: Optional[int] = None) -> None:
        """Give back a reservation whose write failed."""
        with self.lock:
            self.reserved -= nbytes
            if ns_hash is not None and ns_hash in self._tenants:
                self._tenants[ns_hash].reserved -= nbytes

    def evict_bytes(self, nbytes: int, ns_hash: Optional[int] = None, full_disk: bool = True) -> List[Victim]:
        """Evict at least nbytes of chunks (of one namespace when given): the device is fuller than our
        count says (full_disk), or an operator asked."""
        with self.lock:
            victims, freed = [], 0
            while freed < nbytes:
                victim = self._pop_victim_locked(None, only=ns_hash)
                if victim is None:
                    break
                victims.append(victim)
                freed += victim[1].disk_size
            if victims and full_disk:
                self.extra["enospc_retries"] += 1
            return victims

    def commit(self, digest: int, entry: Entry, parent: Optional[int]) -> None:
        """A reserved write is on disk under its final name: index it, replacing any older version."""
        with self.lock:
            self.reserved -= entry.disk_size
            self._tenant_locked(entry.ns_hash).reserved -= entry.disk_size
            old = self._index.pop(digest, None)
            if old is not None:
                self._forget_locked(digest, old)
            self._index[digest] = entry
            if self._build is not None:
                self._build.fresh.append(digest)
                self._journal_locked("fresh", digest, entry.ns_hash)
            self.used += entry.disk_size
            tenant = self._tenant_locked(entry.ns_hash, entry.page_key[0] if entry.page_key else None)
            tenant.bytes += entry.disk_size
            tenant.policy.insert(digest, parent)

    def _forget_locked(self, digest: int, entry: Entry) -> None:
        """Bytes and policy of an entry already out of the index."""
        if self._build is not None:
            self._build.gone.add(digest)
            self._journal_locked("gone", digest, entry.ns_hash)
        self.used -= entry.disk_size
        tenant = self._tenants.get(entry.ns_hash)
        if tenant is not None:
            tenant.bytes -= entry.disk_size
            tenant.policy.remove(digest)

    def count(self, name: str) -> None:
        """One more of an event counted in extra."""
        with self.lock:
            self.extra[name] += 1

    def wrote(self, raw: int, stored: int) -> None:
        with self.lock:
            self.stats.inserts += 1
            self.stats.bytes_written += raw
            self.extra["raw_bytes_in"] += raw
            self.extra["stored_bytes_in"] += stored

    def drop(self, digest: int, entry: Entry, corrupt: bool = False) -> bool:
        """Forget digest if it still maps to entry (a newer version is left alone); True if it did."""
        with self.lock:
            if corrupt:
                self.extra["corrupt_removed"] += 1
            if self._index.get(digest) is not entry:
                return False
            del self._index[digest]
            self._forget_locked(digest, entry)
            return True

    def pop_many(self, digests: Iterable[int]) -> List[Victim]:
        """Take digests out of the index (delete, clear); returns what was present."""
        with self.lock:
            out = []
            for digest in digests:
                if self._build is not None:  # also one the scan has not reached: it must not come back
                    self._build.gone.add(digest)
                entry = self._index.pop(digest, None)
                if entry is not None:
                    self._forget_locked(digest, entry)
                    out.append((digest, entry))
            return out

    def digests(self, ns_hash: Optional[int] = None) -> List[int]:
        """Every digest (of one namespace hash)."""
        with self.lock:
            return [d for d, e in self._index.items() if ns_hash is None or e.ns_hash == ns_hash]

    def hit(self, digest: int, entry: Entry, key: PageKey, raw_size: int, now: float, every: float) -> bool:
        """Count a verified read; True when the file's mtime should be refreshed."""
        with self.lock:
            if self._index.get(digest) is entry:
                entry.reads += 1
                entry.page_key, entry.raw_size = key, raw_size
                tenant = self._tenant_locked(entry.ns_hash, key[0])
                tenant.policy.touch(digest)
                self._journal_locked("touch", digest, entry.ns_hash)
                tenant.hits += 1
            self.stats.hits += 1
            self.stats.bytes_read += raw_size
            if now - entry.touched > every:
                entry.touched = now
                return True
            return False

    def miss(self, read_error: bool = False) -> bool:
        """Count a miss; returns False for the caller to return."""
        with self.lock:
            self.stats.misses += 1
            if read_error:
                self.extra["read_errors"] += 1
        return False

    def snapshot(self) -> StoreStats:
        with self.lock:
            snap = StoreStats(**{k: v for k, v in self.stats.__dict__.items() if k != "extra"})
            snap.pages = len(self._index)
            snap.used_bytes = self.used
            extra = dict(self.extra)
            extra["reserved_bytes"] = self.reserved
            extra["index_building"] = float(self._build is not None)  # 1 while the restart scan runs
            active = sum(1 for t in self._tenants.values() if t.bytes)
            per_ns = {(t.name or f"#{h:x}"): {"bytes": t.bytes, "pages": len(t.policy), "hits": t.hits,
                                              "evictions": t.evictions, "fair_share": int(self._fair.share(active)),
                                              "quota": (self._fair.quota(t.name) or 0) if t.name else 0}
                      for h, t in self._tenants.items() if t.bytes or t.hits or t.evictions}
        snap.per_namespace = bounded_top(per_ns)
        raw, stored = extra.pop("raw_bytes_in"), extra.pop("stored_bytes_in")
        extra["compression_ratio"] = raw / stored if stored else 1.0  # of pages written since start
        snap.extra = extra
        return snap
