"""The NVMe tier's bookkeeping: index, policy, byte counts and counters, under one lock, no I/O.

The store owns sizes and the policy only says what to evict (the cachetools
split).  Capacity counts on-disk bytes: committed chunks plus reservations
of writes in flight.  A write reserves before it touches the disk (evicting
as needed) and then commits or releases; the victims it gets back are already
out of the index and their bytes already freed, so the caller deletes their
files before writing its own and the disk never holds more than capacity.

The index is native (tiers/stores/page_index.py): a 48-byte row and a 4-byte
slot a chunk, the LRU or FIFO order in the rows; a chunk's path is worked
out from its digest and namespace hash, never stored.  Any other policy
orders the digests itself (a Python EvictionPolicy a namespace).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from tiers.stores.fairness import FairShare, GroupUsage, VictimPlan, bounded_top
from tiers.stores.page_index import MAX_TENANTS, ORDER_NONE, PageIndex, Row, order_for
from tiers.policies import EvictionPolicy
from tiers.plugins import make_policy
from tiers.stores.base import StoreFull, StoreStats
from tiers.stores.nvme.index import digests_of
from tiers.stores.nvme.batch import batch_path
from tiers.stores.nvme.layout import chunk_path


PLACE_SLICE = 65536  # scanned chunks placed in order under one hold of the lock (~5 ms)


@dataclass
class Entry:
    """A chunk as its row read when asked: gen names that version (a newer write of the page is another)."""

    path: str
    ns_hash: int
    disk_size: int
    raw_size: Optional[int] = None  # None: the row keeps no page size (the chunk's header has it)
    reads: int = 0
    gen: int = 0
    stamp: int = 0  # monotonic seconds of the last mtime refresh (0: never; a scan's mtime until placed)
    file: int = 0  # the batch chunk holding the page (tiers/stores/nvme/batch.py); 0: a file of its own
    block: int = 0  # its record's first 4 KiB block there


Victim = Tuple[int, Entry]


@dataclass
class _Build:
    """What changed while the index was being rebuilt in the background (tiers/stores/nvme/rebuild.py)."""

    fresh: List[int] = field(default_factory=list)  # digests committed meanwhile, in order (Python policies)
    gone: Set[int] = field(default_factory=set)  # digests deleted, evicted or dropped meanwhile
    cleared: Set[Optional[int]] = field(default_factory=set)  # namespace hashes cleared (None: all)
    # Once a Python policy's eviction order is being built outside the lock: what the serving store did
    # since, in order, replayed onto it under the lock at the end ("fresh" | "gone" | "touch", digest, ns hash).
    journal: Optional[List[Tuple[str, int, int]]] = None


@dataclass
class _Tenant:
    """One namespace (known by its hash; by name once a page of it was written or read) and its policy."""

    number: int  # the tenant of its rows in the index
    ns_hash: int
    policy: Optional[EvictionPolicy]  # None: the index keeps the order (LRU, FIFO)
    name: Optional[str] = None
    bytes: int = 0
    reserved: int = 0  # writes in flight: a quota counts them too
    hits: int = 0
    evictions: int = 0


class Ledger:
    """Chunks by digest, their order and byte counts; every method takes the lock."""

    def __init__(self, root: str, capacity: int, policy: str, quotas: Optional[Dict[str, int]] = None):
        self.root = root
        self.capacity = capacity
        self.lock = threading.Lock()
        self._policy_name = policy
        make_policy(policy)  # an unknown name fails here
        self._order = order_for(policy)
        self._index = PageIndex(self._order)
        self._tenants: Dict[int, _Tenant] = {}  # by namespace hash: each namespace evicts by its own order
        self._numbered: Dict[int, _Tenant] = {}  # the same, by their number in the index
        self._fair = FairShare(capacity, quotas)
        # Fairness's plan of victims for the last writer (tiers/stores/fairness.py VictimPlan), good while the
        # usage changed only by its own victims: (usage version, writer, over quota, plan).  A put that evicts
        # page after page walks the namespaces once, not once a page.
        self._victim_plan: Optional[Tuple[int, Optional[int], bool, VictimPlan]] = None
        self._usage_version = 0
        # Each quota'd group's bytes held and reserved, and its namespaces by bytes held, kept current.
        self._groups = GroupUsage()
        self.used = 0
        self.reserved = 0
        self.stats = StoreStats(capacity_bytes=capacity)
        self._build: Optional[_Build] = None  # set while the index is rebuilt behind the serving store
        self.extra: Dict[str, float] = {"corrupt_removed": 0, "read_errors": 0, "enospc_retries": 0,
                                        "raw_bytes_in": 0, "stored_bytes_in": 0, "unaligned_writes": 0,
                                        "checksum_refused": 0}

    @property
    def native_order(self) -> bool:
        """True when the index keeps the eviction order (a rebuild then needs no reordering outside the lock)."""
        return self._order != ORDER_NONE

    # ------------------------------------------------------------ snapshot
    @property
    def order_code(self) -> int:
        return self._order

    def assign_tenant(self, ns_hash: int, tenant: str, quota: Optional[int] = None) -> None:
        """The namespace of ns_hash counts toward tenant's fair share (tiers/stores/fairness.py), and toward its
        quota (bytes on disk all its namespaces hold together) when one is given."""
        with self.lock:
            self._fair.assign(ns_hash, ("tenant", tenant), quota)
            self._usage_version += 1
            self._groups.clear()

    def tenant_table(self) -> List[Tuple[int, Optional[str]]]:
        """(namespace hash, name) of each tenant number, in number order (tiers/stores/nvme/snapshot.py)."""
        with self.lock:
            return [(self._numbered[n].ns_hash, self._numbered[n].name) for n in range(len(self._numbered))]

    def save_rows(self, fd: int) -> Tuple[int, int]:
        with self.lock:
            return self._index.save(fd)

    def load_rows(self, fd: int, offset: int, rows: int, checksum: int,
                  tenants: List[Tuple[int, Optional[str]]]) -> int:
        """Fill this empty ledger from a snapshot's rows at offset of fd (ValueError when they are not sound)."""
        with self.lock:
            if len(self._index) or self._tenants:
                raise ValueError("load into an empty ledger only")
            for ns_hash, name in tenants:
                self._tenant_locked(ns_hash, name)
            if len(self._tenants) != len(tenants):
                raise ValueError("a namespace hash listed twice")
            os.lseek(fd, offset, os.SEEK_SET)
            loaded = self._index.load(fd, rows, checksum)
            for number, (count, nbytes) in self._index.totals().items():
                if number >= len(tenants):
                    raise ValueError("a row of a namespace the snapshot does not list")
                self._numbered[number].bytes = nbytes
                self.used += nbytes
            self._usage_version += 1
            self._groups.clear()
            return loaded

    def reset(self) -> None:
        """Empty again (a snapshot that was not sound)."""
        with self.lock:
            self._index = PageIndex(self._order)
            self._tenants.clear()
            self._numbered.clear()
            self._groups.clear()
            self.used = 0

    # ------------------------------------------------- background rebuild
    def start_build(self) -> None:
        with self.lock:
            self._build = _Build()

    def path_of(self, ns_hash: int, digest: int, file: int) -> str:
        """The file a page lies in: its own, or a batch chunk."""
        return batch_path(self.root, file) if file else chunk_path(self.root, ns_hash, digest)

    def add_scanned(self, records: np.ndarray) -> List[Victim]:
        """Index chunks the scan found (tiers/stores/nvme/index.py RECORD), unless the serving store decided
        about them meanwhile: a digest written since wins; one deleted, evicted or of a cleared namespace is
        stale ((digest, path) returned, for the caller to unlink).  They go to the cold end of their
        namespace's order, placed by mtime at the end of the scan (place_scanned)."""
        stale: List[Victim] = []
        with self.lock:
            build = self._build
            if build.gone or build.cleared:  # rare: something was deleted or cleared during the scan
                keep = np.ones(len(records), dtype=bool)
                for i, (digest, ns_hash) in enumerate(zip(digests_of(records), records["ns"].tolist())):
                    if digest not in self._index and (digest in build.gone or ns_hash in build.cleared
                                                      or None in build.cleared):
                        keep[i] = False
                        file, block = int(records["file"][i]), int(records["block"][i])
                        stale.append((digest, Entry(self.path_of(ns_hash, digest, file), ns_hash,
                                                    int(records["size"][i]), file=file, block=block)))
                records = records[keep]
            tenants = {ns: self._tenant_locked(ns).number for ns in np.unique(records["ns"]).tolist()}
            for number, nbytes in self._index.insert_scanned(records.tobytes(), tenants).items():
                self._numbered[number].bytes += nbytes
                self.used += nbytes
            self._usage_version += 1
            self._groups.clear()
        return stale

    def reserve_rows(self, rows: int) -> None:
        """Room for rows chunks in the index without growing it (a scan's estimate)."""
        with self.lock:
            self._index.reserve(max(0, rows))

    def place_scanned(self) -> List[Victim]:
        """The scan ended (native orders): the scanned chunks no one touched since go behind everything
        else, oldest mtime first (ties in scan order); the build ends and capacity is enforced.  In
        batches of a quarter of the index, oldest first (their sorted keys take 2 bytes a chunk, not 8:
        the peak RAM of a rebuild is the index's), each sorted without the GIL or the lock and placed a
        slice at a time: nothing waits for more than one slice or one pass over the rows."""
        index = self._index
        index.start_placing()
        bounds = index.scanned_bounds(max(PLACE_SLICE, len(index) // 4))
        for lo, hi in zip([0] + bounds, bounds + [None]):
            order = index.scanned_order(lo, hi)
            for start in range(0, len(order) // 8, PLACE_SLICE):
                with self.lock:
                    index.place_rows(order, start, start + PLACE_SLICE)
                time.sleep(0)  # the serving threads' turn
            del order
        with self.lock:
            self._build = None
            return self._enforce_capacity_locked()

    def begin_reorder(self) -> List[int]:
        """The scan ended (Python policies): from now on what the store does is journaled for finish_build
        to replay.  Returns the digests committed during the scan, in order (they go after every scanned one)."""
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
            self._index.place_scanned()  # their stamps back to "never refreshed"
            build, self._build = self._build, None
            for op, digest, ns_hash in build.journal or ():
                policy = policies.get(ns_hash)
                if policy is None:
                    policy = policies[ns_hash] = make_policy(self._policy_name)
                if op == "touch":
                    policy.touch(digest)
                    continue
                policy.remove(digest)
                if op == "fresh" and digest in self._index:
                    policy.insert(digest)
            for ns_hash, tenant in self._tenants.items():
                tenant.policy = policies.get(ns_hash) or make_policy(self._policy_name)
            return self._enforce_capacity_locked()

    def _enforce_capacity_locked(self) -> List[Victim]:
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
            number = len(self._numbered)
            if number >= MAX_TENANTS:  # reuse the number of a namespace that holds nothing
                number = next((t.number for t in self._numbered.values() if not t.bytes and not t.reserved
                               and not self._pages_locked(t)), None)
                if number is None:
                    raise StoreFull(f"{MAX_TENANTS} namespaces hold chunks here; no room for another")
                del self._tenants[self._numbered[number].ns_hash]
            tenant = _Tenant(number, ns_hash, None if self.native_order else make_policy(self._policy_name))
            self._tenants[ns_hash] = self._numbered[number] = tenant
        if name is not None:
            tenant.name = name
        return tenant

    def _pages_locked(self, tenant: _Tenant) -> int:
        return self._index.count(tenant.number) if tenant.policy is None else len(tenant.policy)

    def _entry(self, digest: int, row: Row) -> Entry:
        ns_hash = self._numbered[row.tenant].ns_hash
        return Entry(self.path_of(ns_hash, digest, row.file), ns_hash, row.size, row.raw or None, row.reads,
                     row.gen, row.stamp, row.file, row.block)

    def get(self, digest: int) -> Optional[Entry]:
        values = self._index.get(digest)  # one call under the GIL: a whole row or none, no lock needed
        return None if values is None else self._entry(digest, Row(*values))

    def __contains__(self, digest: int) -> bool:
        return digest in self._index

    def held(self, digests: List[int]) -> bytes:
        """One byte a digest, 1 where indexed (one native call)."""
        return self._index.contains_many(digests)

    def held_packed(self, digests: bytes) -> bytes:
        """held of packed digests (16 bytes each, tiers/wire/protocol.py pack_key_digests)."""
        return self._index.contains_packed(digests)

    def _pop_victim_locked(self, writer: Optional[int], need: int = 0, only: Optional[int] = None) -> Optional[Victim]:
        """The next victim: of namespace only, or of the namespace tiers/stores/fairness.py chooses for writer."""
        plan = None  # the plan this victim was chosen by
        if only is None:
            own = self._tenants.get(writer) if writer is not None else None
            over = own is not None and own.name is not None and self._fair.over_quota(own.name, own.bytes + need)
            kept = self._victim_plan
            if kept is not None and kept[:3] == (self._usage_version, writer, over):
                plan = kept[3]
            else:
                plan = VictimPlan(self._fair, writer, {h: t.bytes for h, t in self._tenants.items()}, over)
                self._victim_plan = (self._usage_version, writer, over, plan)
            only = plan.next()
        tenant = self._tenants.get(only) if only is not None else None
        if tenant is None:
            return None
        if tenant.policy is None:
            popped = self._index.pop_victim(tenant.number)
            if popped is None:
                return None
            digest, values = popped
        else:
            digest = tenant.policy.pop_victim()
            if digest is None:
                return None
            values = self._index.remove(digest)
        entry = self._entry(digest, Row(*values))
        if self._build is not None:
            self._build.gone.add(digest)
            self._journal_locked("gone", digest, entry.ns_hash)
        self.used -= entry.disk_size
        tenant.bytes -= entry.disk_size
        self._held_changed_locked(tenant.ns_hash, -entry.disk_size, tenant)
        if plan is not None:  # the usage changed only as the plan knows
            plan.gave(only, entry.disk_size)
        else:
            self._usage_version += 1
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
                self._within_group_quota_locked(ns_hash, nbytes, victims)
            while self.used + self.reserved + nbytes > self.capacity:
                victim = self._pop_victim_locked(ns_hash, nbytes)
                if victim is None:  # cannot happen while used counts only indexed chunks
                    break
                victims.append(victim)
            self.reserved += nbytes
            if ns_hash is not None:
                self._tenants[ns_hash].reserved += nbytes
                self._held_changed_locked(ns_hash, nbytes)
            return victims

    def _within_group_quota_locked(self, ns_hash: int, nbytes: int, victims: List[Victim]) -> None:
        """Evict from the largest namespace of ns_hash's tenant until its quota takes nbytes more (a chunk
        larger than the quota still fits once the tenant holds nothing else)."""
        limit, members = self._fair.group_quota(ns_hash)
        while limit is not None:
            group = self._fair.group(ns_hash)
            if self._groups.total(group, members, self._held_and_reserved) + nbytes <= limit:
                return
            giver = self._groups.largest(group, members, self._held)
            victim = self._pop_victim_locked(ns_hash, only=giver) if giver is not None else None
            if victim is None:
                return
            victims.append(victim)

    def release(self, nbytes: int, ns_hash: Optional[int] = None) -> None:
        """Give back a reservation whose write failed."""
        with self.lock:
            self.reserved -= nbytes
            if ns_hash is not None and ns_hash in self._tenants:
                self._tenants[ns_hash].reserved -= nbytes
                self._held_changed_locked(ns_hash, -nbytes)

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

    def commit(self, digest: int, ns_hash: int, namespace: str, disk_size: int, raw_size: int, stamp: int,
               parent: Optional[int], file: int = 0, block: int = 0) -> Optional[Entry]:
        """A reserved write is on disk under its final name (its own file, or a record of batch chunk file):
        index it, replacing any older version; the version replaced (the caller gives back its record when
        it lies in a batch chunk, or its file when the new one does), or None."""
        with self.lock:
            return self._commit_locked(self._tenant_locked(ns_hash, namespace), digest, disk_size, raw_size,
                                       stamp, parent, file, block)

    def commit_many(self, ns_hash: int, namespace: str, stamp: int, file: int,
                    pages: Sequence[Tuple[int, int, int, Optional[int], int]]) -> List[Victim]:
        """commit for each (digest, disk_size, raw_size, parent, block) of one batch chunk file under one lock
        hold; the versions replaced, as (digest, entry)."""
        replaced: List[Victim] = []
        with self.lock:
            tenant = self._tenant_locked(ns_hash, namespace)
            for digest, disk_size, raw_size, parent, block in pages:
                old = self._commit_locked(tenant, digest, disk_size, raw_size, stamp, parent, file, block)
                if old is not None:
                    replaced.append((digest, old))
        return replaced

    def _commit_locked(self, tenant: _Tenant, digest: int, disk_size: int, raw_size: int, stamp: int,
                       parent: Optional[int], file: int, block: int) -> Optional[Entry]:
        self.reserved -= disk_size
        tenant.reserved -= disk_size
        old = self._index.remove(digest)
        replaced = None
        if old is not None:
            row = Row(*old)
            replaced = self._entry(digest, row)
            self._forget_locked(digest, row)
        self._index.insert(digest, tenant.number, disk_size, raw=raw_size, stamp=stamp, file=file, block=block)
        if self._build is not None:
            self._build.fresh.append(digest)
            self._journal_locked("fresh", digest, tenant.ns_hash)
        self.used += disk_size
        tenant.bytes += disk_size
        self._held_changed_locked(tenant.ns_hash, 0, tenant)  # held + reserved as before: only the order
        kept = self._victim_plan
        if kept is not None and kept[:2] == (self._usage_version, tenant.ns_hash):
            kept[3].grew(tenant.ns_hash, disk_size)  # the writer's own pages: its plan stays good
        else:
            self._usage_version += 1
        if tenant.policy is not None:
            tenant.policy.insert(digest, parent)
        return replaced

    def _held_changed_locked(self, ns_hash: int, delta: int, tenant: Optional[_Tenant] = None) -> None:
        """A namespace's bytes held plus reserved moved by delta (tenant, when its bytes held changed)."""
        if self._groups:
            self._groups.changed(self._fair.group(ns_hash), delta, None if tenant is None else ns_hash,
                                 0 if tenant is None else tenant.bytes, len(self._tenants))

    def _held(self, ns_hash: int) -> int:
        tenant = self._tenants.get(ns_hash)
        return tenant.bytes if tenant is not None else 0

    def _held_and_reserved(self, ns_hash: int) -> int:
        tenant = self._tenants.get(ns_hash)
        return tenant.bytes + tenant.reserved if tenant is not None else 0

    def _forget_locked(self, digest: int, row: Row) -> None:
        """Bytes and order of a row already out of the index."""
        tenant = self._numbered[row.tenant]
        if self._build is not None:
            self._build.gone.add(digest)
            self._journal_locked("gone", digest, tenant.ns_hash)
        self.used -= row.size
        tenant.bytes -= row.size
        self._held_changed_locked(tenant.ns_hash, -row.size, tenant)
        self._usage_version += 1
        if tenant.policy is not None:
            tenant.policy.remove(digest)

    def count(self, name: str) -> None:
        """One more of an event counted in extra."""
        with self.lock:
            self.extra[name] += 1

    def wrote(self, raw: int, stored: int, pages: int = 1) -> None:
        """pages more written: raw bytes of them, stored on disk (compressed or not)."""
        with self.lock:
            self.stats.inserts += pages
            self.stats.bytes_written += raw
            self.extra["raw_bytes_in"] += raw
            self.extra["stored_bytes_in"] += stored

    def drop(self, digest: int, entry: Entry, corrupt: bool = False) -> bool:
        """Forget digest if it still maps to entry's version (a newer one is left alone); True if it did."""
        with self.lock:
            if corrupt:
                self.extra["corrupt_removed"] += 1
            values = self._index.remove(digest, entry.gen)
            if values is None:
                return False
            self._forget_locked(digest, Row(*values))
            return True

    def pop_many(self, digests: Iterable[int]) -> List[Victim]:
        """Take digests out of the index (delete, clear); returns what was present."""
        with self.lock:
            out = []
            for digest in digests:
                if self._build is not None:  # also one the scan has not reached: it must not come back
                    self._build.gone.add(digest)
                values = self._index.remove(digest)
                if values is not None:
                    row = Row(*values)
                    out.append((digest, self._entry(digest, row)))
                    self._forget_locked(digest, row)
            return out

    def digests(self, ns_hash: Optional[int] = None) -> List[int]:
        """Every digest (of one namespace hash)."""
        with self.lock:
            if ns_hash is None:
                return self._index.digests()
            tenant = self._tenants.get(ns_hash)
            return self._index.digests(tenant.number) if tenant is not None else []

    def hit(self, digest: int, entry: Entry, namespace: str, raw_size: int, now: float, every: float) -> bool:
        """Count a verified read of entry's version; True when the file's mtime should be refreshed (never
        since it was indexed, or every seconds ago or more)."""
        now_s = max(1, int(now))
        # Stamps are whole seconds: more than every whole seconds apart means at least every seconds passed
        # (">=" refreshed a page read 0.1 s after its write across a second's boundary: a metadata write a read).
        refresh = not entry.stamp or entry.stamp > now_s or now_s - entry.stamp > every
        with self.lock:
            reads = self._index.touch(digest, entry.gen, raw_size, now_s if refresh else 0)
            if reads >= 0:
                tenant = self._tenants[entry.ns_hash]
                tenant.name = namespace
                if tenant.policy is not None:
                    tenant.policy.touch(digest)
                self._journal_locked("touch", digest, entry.ns_hash)
                tenant.hits += 1
            self.stats.hits += 1
            self.stats.bytes_read += raw_size
        return refresh and reads >= 0

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
            index_bytes = self._index.nbytes()
            snap.used_bytes = self.used
            extra = dict(self.extra)
            extra["reserved_bytes"] = self.reserved
            extra["index_building"] = float(self._build is not None)  # 1 while the restart scan runs
            extra["index_bytes"] = index_bytes  # the native index's rows and slots (tiers/stores/page_index.py)
            active = sum(1 for t in self._tenants.values() if t.bytes)
            per_ns = {(t.name or f"#{h:x}"): {"bytes": t.bytes, "pages": self._pages_locked(t), "hits": t.hits,
                                              "evictions": t.evictions, "fair_share": int(self._fair.share(active)),
                                              "quota": (self._fair.quota(t.name) or 0) if t.name else 0}
                      for h, t in self._tenants.items() if t.bytes or t.hits or t.evictions}
        snap.per_namespace = bounded_top(per_ns)
        raw, stored = extra.pop("raw_bytes_in"), extra.pop("stored_bytes_in")
        extra["compression_ratio"] = raw / stored if stored else 1.0  # of pages written since start
        snap.extra = extra
        return snap
