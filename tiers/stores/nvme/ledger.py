"""The NVMe tier's bookkeeping: the index of chunks, byte counts and counters, under one lock, no I/O
(but for raising the usage ceiling's small file, outside the lock: tiers/stores/nvme/ceiling.py).

The store owns sizes and the policy only says what to evict (the cachetools
split).  Capacity counts on-disk bytes: committed chunks plus reservations
of writes in flight.  A write reserves before it touches the disk (evicting
as needed) and then commits or releases; the victims it gets back are already
out of the index and their bytes already freed, so the caller deletes their
files before writing its own and the disk never holds more than capacity.
A delete's or clear's bytes stay counted (as ``dead``, beside the kept dead
batch files of tiers/stores/nvme/recycle.py) until their files leave the
disk, and a reservation counts itself before it evicts.

The index is native (tiers/stores/page_index.py): a 48-byte row and a 4-byte
slot a chunk, the LRU or FIFO order in the rows; a chunk's path is worked
out from its digest and namespace hash, never stored.  Any other policy
orders the digests itself (a Python EvictionPolicy a namespace).

Each namespace's bytes, quota and fair share are tiers/stores/nvme/tenants.py's;
what the serving side did during a rebuild is kept in build_log.py; the index
is filled at a start by ledger_rebuild.py (a scan) or snapshot.py.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from tiers.stores.page_index import ORDER_NONE, PageIndex, Row, order_for
from tiers.plugins import make_policy
from tiers.stores.base import StoreFull, StoreStats
from tiers.stores.nvme.batch import batch_path
from tiers.stores.nvme.build_log import BuildLog
from tiers.stores.nvme.ceiling import UsageCeiling
from tiers.stores.nvme.dead_bytes import DeadBytes
from tiers.stores.nvme.entry import Entry, Victim
from tiers.stores.nvme.layout import chunk_path
from tiers.stores.nvme.tenants import Tenants


RESERVE_HOLD_BYTES = 8 << 20  # records a batch reserves (and evicts for) in one hold of the lock at most
CEILING_TRIES = 8  # raises of the usage ceiling a reservation tries while other writers take what it raised
# Seconds a reservation waits at most, past every live page and kept file, for the files of a delete or clear
# to leave the disk (their bytes are counted until they do: Ledger.pop_many); past it, it takes the room.
HELD_WAIT_S = 1.0


class Ledger:
    """Chunks by digest, their order and byte counts; every method takes the lock.

    Its parts (index, tenants, build) are open to the modules that fill the
    index at a start (tiers/stores/nvme/ledger_rebuild.py, snapshot.py) under
    the same lock.
    """

    def __init__(self, root: str, capacity: int, policy: str, quotas: Optional[Dict[str, int]] = None,
                 ceiling: Optional[UsageCeiling] = None):
        self.root = root
        self.capacity = capacity
        self.lock = threading.Lock()
        make_policy(policy)  # an unknown name fails here
        self._order = order_for(policy)
        self.index = PageIndex(self._order)
        self.tenants = Tenants(capacity, quotas, policy, native_order=self.native_order)
        self.used = 0
        self.reserved = 0
        self.dead_bytes = DeadBytes(self.lock)  # on disk, in no index entry: counted beside used
        # The bound a restart will assume for the chunks on disk (tiers/stores/nvme/ceiling.py), and the bytes
        # of chunks a rebuild's scan has not counted yet (at most the last run's ceiling less what it scanned):
        # writes get room only beside both, so the disk never holds more than capacity, rebuild or not.
        self.ceiling = ceiling or UsageCeiling(None, capacity)
        self.unscanned = 0
        self.stats = StoreStats(capacity_bytes=capacity)
        self.build: Optional[BuildLog] = None  # set while the index is rebuilt behind the serving store
        self.extra: Dict[str, float] = {"corrupt_removed": 0, "read_errors": 0, "enospc_retries": 0,
                                        "raw_bytes_in": 0, "stored_bytes_in": 0, "unaligned_writes": 0,
                                        "checksum_refused": 0}

    @property
    def dead(self) -> int:
        """Bytes on disk in no index entry (tiers/stores/nvme/dead_bytes.py)."""
        return self.dead_bytes.count

    @property
    def native_order(self) -> bool:
        """True when the index keeps the eviction order (a rebuild then needs no reordering outside the lock)."""
        return self._order != ORDER_NONE

    @property
    def order_code(self) -> int:
        return self._order

    def assign_tenant(self, ns_hash: int, tenant: str, quota: Optional[int] = None) -> None:
        """The namespace of ns_hash counts toward tenant's fair share (tiers/stores/fairness.py), and toward its
        quota (bytes on disk all its namespaces hold together) when one is given."""
        with self.lock:
            self.tenants.assign(ns_hash, tenant, quota)

    def reset(self) -> None:
        """Empty again (a snapshot that was not sound)."""
        with self.lock:
            self.index = PageIndex(self._order)
            self.tenants.clear()
            self.used = 0

    def settle_ceiling(self, slack_steps: int = 0) -> None:
        """The usage ceiling down to what is held and in flight, a step above, once everything on disk is
        counted (a snapshot loaded, a scan ended, a clean close; a clear, delete or operator's eviction: then
        only when it is slack_steps or more above, so a stream of deletes is not a stream of fsyncs).
        Nothing is lowered while a rebuild's scan still runs."""
        with self.lock:
            if self.build is not None:
                return
            lowered = self.ceiling.lower(self.used + self.reserved + self.dead, slack_steps)
        if lowered:
            self.ceiling.persist()

    def path_of(self, ns_hash: int, digest: int, file: int) -> str:
        """The file a page lies in: its own, or a batch chunk."""
        return batch_path(self.root, file) if file else chunk_path(self.root, ns_hash, digest)

    def cleared(self, ns_hash: Optional[int]) -> None:
        """A namespace (None: all) was cleared: chunks of it the scan has not reached yet are stale."""
        with self.lock:
            if self.build is not None:
                self.build.cleared.add(ns_hash)

    def _entry(self, digest: int, row: Row) -> Entry:
        ns_hash = self.tenants.numbered[row.tenant].ns_hash
        return Entry(self.path_of(ns_hash, digest, row.file), ns_hash, row.size, row.raw or None, row.reads,
                     row.gen, row.stamp, row.file, row.block)

    def get(self, digest: int) -> Optional[Entry]:
        values = self.index.get(digest)  # one call under the GIL: a whole row or none, no lock needed
        return None if values is None else self._entry(digest, Row(*values))

    def __contains__(self, digest: int) -> bool:
        return digest in self.index

    def held(self, digests: List[int]) -> bytes:
        """One byte a digest, 1 where indexed (one native call)."""
        return self.index.contains_many(digests)

    def held_packed(self, digests: bytes) -> bytes:
        """held of packed digests (16 bytes each, tiers/wire/protocol.py pack_key_digests)."""
        return self.index.contains_packed(digests)

    def pop_victim_locked(self, writer: Optional[int], need: int = 0, only: Optional[int] = None) -> Optional[Victim]:
        """The next victim: of namespace only, or of the namespace tiers/stores/fairness.py chooses for writer."""
        plan = None  # the plan this victim was chosen by
        if only is None:
            plan = self.tenants.plan_for(writer, need)
            only = plan.next()
        tenant = self.tenants.get(only) if only is not None else None
        if tenant is None:
            return None
        if tenant.policy is None:
            popped = self.index.pop_victim(tenant.number)
            if popped is None:
                return None
            digest, values = popped
        else:
            digest = tenant.policy.pop_victim()
            if digest is None:
                return None
            values = self.index.remove(digest)
        entry = self._entry(digest, Row(*values))
        if self.build is not None:
            self.build.removed(digest, entry.ns_hash)
        self.used -= entry.disk_size
        tenant.bytes -= entry.disk_size
        self.tenants.held_changed(tenant.ns_hash, -entry.disk_size, tenant)
        if plan is not None:  # the usage changed only as the plan knows
            plan.gave(only, entry.disk_size)
        else:
            self.tenants.usage_changed()
        tenant.evictions += 1
        self.stats.evictions += 1
        return digest, entry

    def reserve(self, nbytes: int, ns_hash: Optional[int] = None, namespace: Optional[str] = None) -> List[Victim]:
        """Claim nbytes for a page of namespace, evicting as needed (StoreFull when writes in flight fill it)."""
        self.raise_ceiling(nbytes)
        with self.lock:
            if self.reserved + nbytes > self.room_locked():
                raise StoreFull(self._full_locked())
            return self._reserve_locked(nbytes, ns_hash, namespace)

    def reserve_many(self, sizes: Sequence[int], ns_hash: int, namespace: str,
                     spare: int = 0) -> Tuple[List[Victim], List[bool]]:
        """reserve for each of sizes (pages of one namespace): the victims, and which got room (the others
        are StoreFull: writes in flight fill the tier).  Up to RESERVE_HOLD_BYTES of claims a lock hold (every
        lookup waits on it), evicting what claims page by page would, the oldest first.  spare: bytes of a
        kept file the pages go into, counted as dead until now: the claims take them over first (the file is
        counted throughout); what no claim took (some were refused) is still dead."""
        victims: List[Victim] = []
        got: List[bool] = []
        first = 0
        while first < len(sizes):
            last, total = first + 1, sizes[first]
            while last < len(sizes) and total + sizes[last] <= RESERVE_HOLD_BYTES:
                total += sizes[last]
                last += 1
            self.raise_ceiling(total)
            with self.lock:
                room = self.room_locked()
                if self.reserved + total <= room:
                    spare = self.dead_bytes.take_spare_locked(spare, total)
                    victims += self._reserve_locked(total, ns_hash, namespace)
                    got += [True] * (last - first)
                else:
                    for nbytes in sizes[first:last]:
                        got.append(self.reserved + nbytes <= room)
                        if got[-1]:
                            spare = self.dead_bytes.take_spare_locked(spare, nbytes)
                            victims += self._reserve_locked(nbytes, ns_hash, namespace)
            first = last
        return victims, got

    def keep_dead(self, nbytes: int, held: int = 0) -> bool:
        """nbytes of a dead file kept on disk in place of held bytes of it already counted as dead (its records
        removed by a delete or clear: pop_many), if they fit beside what is held and in flight; False: nothing
        changes (held stays counted until the caller frees it)."""
        with self.lock:
            if self.used + self.reserved + self.dead - held + nbytes > self.room_locked():
                return False
            self.dead_bytes.count += nbytes - held
            return True

    def room_locked(self) -> int:
        """Bytes the indexed chunks and the writes in flight may take together: the capacity, or the ceiling
        on disk if lower, less what the scan has not counted yet."""
        return min(self.capacity, self.ceiling.value) - self.unscanned

    def _full_locked(self) -> str:
        if self.unscanned:
            return (f"{self.unscanned} bytes of chunks not counted yet by the index rebuild and {self.reserved} "
                    f"of writes in flight fill the capacity of {self.capacity}")
        return f"{self.reserved} bytes of writes in flight, capacity {self.capacity}"

    def raise_ceiling(self, nbytes: int) -> None:
        """Before reserving nbytes: the usage ceiling raised past what the disk may then hold (outside the
        lock: it writes a file), again while other writers take what was raised, a few times at most.  A
        writer that reserves between the last raise and its lock, or a raise that could not be written,
        leaves the reservation to evict within the ceiling as it stands (the disk stays under it)."""
        for _ in range(CEILING_TRIES):
            if not self.ceiling.ensure(self.used + self.reserved + self.dead + self.unscanned + nbytes):
                return
            ceiling = self.ceiling.value
            if self.used + self.reserved + self.dead + self.unscanned + nbytes <= ceiling or ceiling >= self.capacity:
                return

    def _reserve_locked(self, nbytes: int, ns_hash: Optional[int], namespace: Optional[str]) -> List[Victim]:
        # Counted first: the victims popped below are on disk until the caller removes them, and their room is
        # this reservation's even while the loop waits with the lock let go.
        self.reserved += nbytes
        victims = []
        if ns_hash is not None:
            tenant = self.tenants.tenant(ns_hash, self.index, namespace)
            limit = self.tenants.quota(namespace) if namespace is not None else None
            while limit is not None and tenant.bytes + tenant.reserved + nbytes > limit:
                victim = self.pop_victim_locked(ns_hash, only=ns_hash)
                if victim is None:
                    break
                victims.append(victim)
            self._within_group_quota_locked(ns_hash, nbytes, victims)
        room = self.room_locked()
        waited_until = None
        while self.used + self.reserved + self.dead > room:
            if self.dead_bytes.give_up_locked(1):  # a kept dead file goes before any live page
                continue
            victim = self.pop_victim_locked(ns_hash, nbytes)
            if victim is not None:
                victims.append(victim)
                continue
            # Only bytes on their way off the disk remain (a delete's or clear's files, a kept file another put
            # is about to write over): wait for them, a while at most (the wait lets go of the lock).
            now = time.monotonic()
            waited_until = waited_until or now + HELD_WAIT_S
            if not self.dead or now >= waited_until:
                break
            self.dead_bytes.wait_locked(waited_until - now)
        if ns_hash is not None:
            self.tenants.by_hash[ns_hash].reserved += nbytes
            self.tenants.held_changed(ns_hash, nbytes)
        return victims

    def _within_group_quota_locked(self, ns_hash: int, nbytes: int, victims: List[Victim]) -> None:
        """Evict from the largest namespace of ns_hash's tenant until its quota takes nbytes more (a chunk
        larger than the quota still fits once the tenant holds nothing else)."""
        for giver in self.tenants.group_givers(ns_hash, nbytes):
            victim = self.pop_victim_locked(ns_hash, only=giver) if giver is not None else None
            if victim is None:
                return
            victims.append(victim)

    def release(self, nbytes: int, ns_hash: Optional[int] = None) -> None:
        """Give back a reservation whose write failed."""
        with self.lock:
            self.reserved -= nbytes
            if ns_hash is not None and ns_hash in self.tenants.by_hash:
                self.tenants.by_hash[ns_hash].reserved -= nbytes
                self.tenants.held_changed(ns_hash, -nbytes)

    def evict_bytes(self, nbytes: int, ns_hash: Optional[int] = None, full_disk: bool = True) -> List[Victim]:
        """Evict at least nbytes of chunks (of one namespace when given): the device is fuller than our
        count says (full_disk), or an operator asked."""
        with self.lock:
            victims, freed = [], 0
            while freed < nbytes:
                victim = self.pop_victim_locked(None, only=ns_hash)
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
        replaced = self.commit_many(ns_hash, namespace, stamp, file, [(digest, disk_size, raw_size, parent, block)])
        return replaced[0][1] if replaced else None

    def commit_many(self, ns_hash: int, namespace: str, stamp: int, file: int,
                    pages: Sequence[Tuple[int, int, int, Optional[int], int]]) -> List[Victim]:
        """commit for each (digest, disk_size, raw_size, parent, block) of one batch chunk file under one lock
        hold; the versions replaced, as (digest, entry)."""
        replaced: List[Victim] = []
        with self.lock:
            tenant = self.tenants.tenant(ns_hash, self.index, namespace)
            index, build, policy, total = self.index, self.build, tenant.policy, 0
            for digest, disk_size, raw_size, parent, block in pages:  # the byte counts once a batch, below
                old = index.remove(digest)
                if old is not None:
                    row = Row(*old)
                    replaced.append((digest, self._entry(digest, row)))
                    self._forget_locked(digest, row)
                index.insert(digest, tenant.number, disk_size, raw=raw_size, stamp=stamp, file=file, block=block)
                if build is not None:
                    build.committed(digest, tenant.ns_hash)
                if policy is not None:
                    policy.insert(digest, parent)
                total += disk_size
            self.reserved -= total
            tenant.reserved -= total
            self.used += total
            tenant.bytes += total
            self.tenants.held_changed(tenant.ns_hash, 0, tenant)  # held + reserved as before: only the order
            self.tenants.grew(tenant.ns_hash, total)
        return replaced

    def _forget_locked(self, digest: int, row: Row) -> None:
        """Bytes and order of a row already out of the index."""
        tenant = self.tenants.numbered[row.tenant]
        if self.build is not None:
            self.build.removed(digest, tenant.ns_hash)
        self.used -= row.size
        tenant.bytes -= row.size
        self.tenants.held_changed(tenant.ns_hash, -row.size, tenant)
        self.tenants.usage_changed()
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
            values = self.index.remove(digest, entry.gen)
            if values is None:
                return False
            self._forget_locked(digest, Row(*values))
            return True

    def pop_many(self, digests: Iterable[int], held: bool = False) -> List[Victim]:
        """Take digests out of the index (delete, clear); returns what was present.  held: their bytes stay
        counted, as dead, until the caller's removal frees them (Removal.discard_many): a writer reserving
        meanwhile gets no room their files still take."""
        with self.lock:
            out = []
            for digest in digests:
                if self.build is not None:  # also one the scan has not reached: it must not come back
                    self.build.gone.add(digest)
                values = self.index.remove(digest)
                if values is not None:
                    row = Row(*values)
                    out.append((digest, self._entry(digest, row)))
                    self._forget_locked(digest, row)
                    if held:
                        self.dead_bytes.count += row.size
            return out

    def digests(self, ns_hash: Optional[int] = None) -> List[int]:
        """Every digest (of one namespace hash)."""
        with self.lock:
            if ns_hash is None:
                return self.index.digests()
            tenant = self.tenants.get(ns_hash)
            return self.index.digests(tenant.number) if tenant is not None else []

    def hit(self, digest: int, entry: Entry, namespace: str, raw_size: int, now: float, every: float) -> bool:
        """Count a verified read of entry's version; True when the file's mtime should be refreshed (never
        since it was indexed, or every seconds ago or more)."""
        now_s = max(1, int(now))
        # Stamps are whole seconds: more than every whole seconds apart means at least every seconds passed
        # (">=" refreshed a page read 0.1 s after its write across a second's boundary: a metadata write a read).
        refresh = not entry.stamp or entry.stamp > now_s or now_s - entry.stamp > every
        with self.lock:
            reads = self.index.touch(digest, entry.gen, raw_size, now_s if refresh else 0)
            if reads >= 0:
                tenant = self.tenants.by_hash[entry.ns_hash]
                tenant.name = namespace
                if tenant.policy is not None:
                    tenant.policy.touch(digest)
                if self.build is not None:
                    self.build.journaled("touch", digest, entry.ns_hash)
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
