"""The DRAM tier's evictions: victims chosen page by page, released a batch at a time.

A full tier evicts for every put.  Releasing each victim alone (its digest
hashed, withdrawn from the page directory, its blocks given back, the
namespace's figures changed: one native call and one lock hold each) made a
128-page put into a full tier cost 17 us a page against 2.7 into an empty
one, under the store's lock that every reader of the tier waits on
(docs/PERFORMANCE.md, session 41).  Here a batch's victims are chosen exactly
as inserting its pages one by one would choose them (the same policy pops,
the same fairness plan, each page's own bytes pending), counting the blocks
each will free; then all of them are released together: the listener hears
each (write-back demotion), the directory withdraws each namespace's pages in
one call, the arena takes every block back in one hold, and the pages' blocks
are taken in one more.  No lock of its own: the store (tiers/stores/dram.py)
calls it under its lock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from tiers.shm.arena import Alloc, BlockArena
from tiers.shm.directory import PageDirectory
from tiers.stores.base import EvictionListener, PageKey, StoreStats
from tiers.stores.dram_reads import PageEntry
from tiers.stores.dram_tenants import Tenants
from tiers.stores.page_index import PageIndex
from tiers.wire.protocol import pack_key_digests

Victim = Tuple[PageKey, PageEntry]


@dataclass
class DramEvictions:
    """Choosing and releasing the pages of one DramStore, under its lock."""

    arena: BlockArena
    index: Dict[PageKey, PageEntry]
    held: PageIndex  # every page's digest (the store's native lookup table)
    directory: Optional[PageDirectory]
    tenants: Tenants
    stats: StoreStats
    listener: Optional[EvictionListener]

    def choose_locked(self, writer: Optional[str], need: int = 0, only: Optional[str] = None, pending: int = 0,
                      given: Optional[Dict[str, int]] = None) -> Optional[Victim]:
        """The next victim, popped from its namespace's policy and counted, not yet released (None: nothing to
        evict).  pending: bytes the writer has reserved for pages of its batch not committed yet (they count
        as its own, as they would once committed page by page); given: bytes each namespace gave to victims
        chosen before this one and not yet released."""
        tenants = self.tenants
        own = tenants.get(writer) if writer is not None else None
        own_bytes = own.bytes - (given or {}).get(writer, 0) if own is not None else 0
        over = own is not None and tenants.fair.over_quota(writer, own_bytes + pending + need)
        plan, namespace, grown = None, only, pending if own is not None else 0
        if only is None:
            plan = tenants.plan_for(writer, over, grown)
            namespace = plan.next()
        tenant = tenants.get(namespace) if namespace is not None else None
        victim = tenant.policy.pop_victim() if tenant is not None else None
        if victim is None:
            return None
        entry = self.index[victim]
        if plan is not None:  # the usage changed only as the plan knows
            plan.gave(namespace, entry.size)
            tenants.keep_plan(writer, over, plan, grown)
        tenant.evictions += 1
        self.stats.evictions += 1
        return victim, entry

    def evict_one_locked(self, writer: Optional[str], need: int = 0, only: Optional[str] = None,
                         pending: int = 0) -> bool:
        """Choose a victim and release it at once; False when there was none."""
        victim = self.choose_locked(writer, need, only, pending)
        if victim is None:
            return False
        self.release_locked([victim], evicted=True, planned=only is None)
        return True

    def reserve_evicting_locked(self, namespace: str, keys: Sequence[str], sizes: Sequence[int], pending: int,
                                seen: Set[str], until: float, max_pending: int) -> List[Alloc]:
        """Blocks for the leading pages of keys that fit once victims are evicted for them, chosen page by page
        and released together; evicting stops (what still fits is taken) at a page held already or twice in
        the batch (committing it frees its old blocks), past max_pending reserved bytes, or at until."""
        arena, index = self.arena, self.index
        arena.expire()  # as a failed take would: leases past their expiry free what they parked
        avail = arena.free_blocks()
        victims: List[Victim] = []
        chosen: Set[PageKey] = set()
        given: Dict[str, int] = {}
        planned: List[int] = []
        replaces = False
        for key, size in zip(keys, sizes):
            needed = arena.blocks_for(size)
            while avail < needed and not replaces and pending < max_pending and time.perf_counter() < until:
                victim = self.choose_locked(namespace, size, pending=pending, given=given)
                if victim is None:
                    break
                victims.append(victim)
                chosen.add(victim[0])
                given[victim[0][0]] = given.get(victim[0][0], 0) + victim[1].size
                if not arena.pinned(victim[1].alloc):  # a leased page's blocks wait for its readers
                    avail += len(victim[1].alloc.blocks)
            if avail < needed:
                break
            avail -= needed
            planned.append(size)
            pending += size
            page = (namespace, key)
            replaces = replaces or key in seen or (page in index and page not in chosen)
            seen.add(key)
        self.release_locked(victims, evicted=True, planned=True)
        return arena.take_many(planned)

    def release_locked(self, victims: Sequence[Victim], evicted: bool = False, planned: bool = False) -> None:
        """Pages out of the tier, together: heard by the listener (evicted ones), withdrawn from the directory
        before any of their blocks can be reused, their blocks given back (parked while leased), and taken
        off the index, their policies and their namespaces' figures (planned: victims the writer's kept
        fairness plan chose)."""
        if not victims:
            return
        if evicted and self.listener is not None:
            for key, entry in victims:
                # Inside the lock: the listener copies the page into the demotion queue (bounded memory,
                # tiers/node/demotion.py) and never waits on a peer; the blocks are free for the writer at once
                # (pinning them instead made a writer of a full arena evict more pages, or fail).
                self.listener.page_evicted(key, self.arena.views(entry.alloc), entry.reads, entry.checksum)
        by_namespace: Dict[str, List[Victim]] = {}
        for victim in victims:
            by_namespace.setdefault(victim[0][0], []).append(victim)
        for namespace, pages in by_namespace.items():
            digests = pack_key_digests(namespace, [key[1] for key, _entry in pages])
            if self.directory is not None:  # engines stop finding them before their blocks can be reused
                self.directory.withdraw(namespace, digests)
            self.held.remove_packed(digests)
        self.arena.give_many([entry.alloc for _key, entry in victims])
        index, freed = self.index, 0
        for key, entry in victims:
            del index[key]
            freed += entry.size
        self.stats.used_bytes -= freed
        for namespace, pages in by_namespace.items():
            self.tenants.released_many(namespace, [key for key, _entry in pages],
                                       sum(entry.size for _key, entry in pages), planned)

    def release_keys_locked(self, keys: Sequence[PageKey]) -> int:
        """The pages of keys the tier holds, released (deletes, clears, overwrites); how many."""
        index = self.index
        victims = [(key, index[key]) for key in dict.fromkeys(keys) if key in index]
        self.release_locked(victims)
        return len(victims)
