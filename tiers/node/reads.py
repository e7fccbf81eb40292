"""The page work behind a get: leased reads (the engine copies each page out of the daemon's arena itself)
and reads as frames (engines without an attachment, tcp:// peers).

A store that keeps its pages in the arena it exports (DRAM) leases them where they lie, on the loop
thread; any other store reads them into staging blocks of the daemon's arena in the I/O pool, and those
are leased.  A lease pins its blocks until the engine's own give-up time (tiers/shm/arena.py), so no
byte lands in engine memory after the engine stopped waiting; a reader may pin at most its share
(``max_lease_bytes``).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

from tiers.wire import protocol as P
from tiers.shm.arena import Alloc, BlockArena, hold_blocks
from tiers.node.faults import CorruptReads
from tiers.node.streamed_reads import StreamedReads
from tiers.node.tenants import Tenant
from tiers.shm.directory import PageDirectory
from tiers.stores.base import PageStore

Each = Callable[[int, Callable[[int], object]], list]  # work(i) for every page, several at once where the store allows


class PageReads:
    def __init__(self, store: PageStore, arena: BlockArena, each: Each, streamed: StreamedReads,
                 lease_share: float = 0.5, corrupt_reads: Optional[CorruptReads] = None,
                 directory: Optional[PageDirectory] = None):
        self.store = store
        self.streamed = streamed  # gets answered at once, their pages copied as they are read
        self.directory = directory  # handed to engines with the arena: they read hits through it
        self.arena = arena
        self.stages = store.export_arena() is None  # pages pass through staging blocks of our own arena
        self.each = each
        self.corrupt_reads = corrupt_reads  # the test hook of tiers/node/faults.py, None in service
        # One session may pin at most this much: pinning DRAM pages costs no memory (only eviction
        # choices, for milliseconds); staging blocks are memory every tenant shares.
        # At least one whole SGLang batch (128 pages of 8 MiB) when the arena holds it.
        self.max_lease_bytes = int(arena.size if not self.stages else min(arena.size, max(arena.size * lease_share,
                                                                                         1 << 30)))
        self.staging_full = 0  # pages of a read left out: no staging blocks left

    def directory_number(self, ns: str, tenant: Tenant) -> int:
        """ns's number in the page directory, for a tenant that maps it with the arena (0: none)."""
        return self.store.directory_namespace(ns) if self.directory is not None and tenant.map_arena else 0

    def count_touched(self, ns: str, keys, sizes, max_page_bytes: int) -> Tuple[int, int]:
        """Pages a request says its engine read through the directory, counted as reads: (pages, bytes).
        Nothing where this daemon hands out no directory (restarted without one: reads it never saw)."""
        if self.directory is None:
            return 0, 0
        keys = P.check_keys(keys)
        return self.store.touch_reads(ns, keys, P.decode_sizes(sizes, len(keys), max_page_bytes))

    def lease_reads(self, ns: str, keys: list, sizes: List[int], owner: int, expiry: float,
                    max_bytes: Optional[int] = None, stream: bool = False):
        """A leased read: (reply fields, pages, bytes).  An arena store's pages are leased where they lie (on
        the loop); any other's are read into staging first (in the I/O pool: tiers/node/routes.py), or,
        streamed, read there after the reply.  The owner's pinned bytes stay within max_bytes (default: this
        tier's bound a session), counting streamed reads not ended whose lease did."""
        limit = self.max_lease_bytes if max_bytes is None else min(max_bytes, self.max_lease_bytes)
        budget = max(0, limit - self.arena.leased_bytes(owner) - self.streamed.held_past_lease(owner))
        if not self.stages:
            lease, extents, sums = self.store.lease_pages([(ns, k) for k in keys], sizes, owner, expiry, budget)
            return self._lease_reply(lease, extents, sums)
        if stream and self.streamed.enabled:  # tiers/node/routes.py answered_early: this runs on the loop
            return self.streamed.start(ns, keys, sizes, owner, expiry, self._take_staging, budget)
        return self._staged_reads(ns, keys, sizes, owner, expiry, budget)

    def _take_staging(self, sizes: List[int], budget: int) -> List[Optional[Alloc]]:
        """Staging for each page, in one lock hold, while the budget lasts (None for the rest: misses)."""
        fits, total = 0, 0
        for size in sizes:
            if size <= 0 or total + size > budget:
                break
            total += size
            fits += 1
        allocs: List[Optional[Alloc]] = list(self.arena.take_many(sizes[:fits])) if fits else []
        self.staging_full += fits - len(allocs)  # the arena ran out before the budget did
        return allocs + [None] * (len(sizes) - len(allocs))

    def _staged_reads(self, ns, keys, sizes, owner, expiry, budget) -> list:
        allocs = self._take_staging(sizes, budget)
        views = [self.arena.views(a) if a is not None else None for a in allocs]
        sums: List[Optional[int]] = [None] * len(keys)  # each page's checksum; None: not read
        if self.store.batched:
            idx = [i for i, v in enumerate(views) if v is not None]
            got = self.store.get_many_into_with_sums([(ns, keys[i]) for i in idx], [views[i] for i in idx], None,
                                                     lambda position: hold_blocks(self.arena, [allocs[idx[position]]]))
            for i, checksum in zip(idx, got):
                sums[i] = checksum
        else:
            sums = self.each(len(keys), lambda i: self.store.get_into_with_sum((ns, keys[i]), views[i])
                              if views[i] is not None and time.monotonic() < expiry else None)
        extents: List[Optional[list]] = []
        pinned: List[Alloc] = []
        for checksum, alloc in zip(sums, allocs):
            if checksum is not None and alloc is not None:
                extents.append(alloc.extents)
                pinned.append(alloc)
            else:
                extents.append(None)
        lease = self.arena.lease(owner, pinned, expiry) if pinned else None
        for alloc in allocs:  # given back now; the lease keeps the pinned ones out of use until it ends
            if alloc is not None:
                self.arena.give(alloc)
        return self._lease_reply(lease, extents, [s or 0 for s in sums])

    def _lease_reply(self, lease: Optional[int], extents: List[Optional[list]], sums: List[int]) -> list:
        if self.corrupt_reads is not None:  # the test hook: after the tier's own checks, before the engine's
            self.corrupt_reads.damage_extents(self.arena.view, extents)
        found = [e is not None for e in extents]
        desc, counts = P.encode_descriptors([e for e in extents if e is not None])
        return (dict(found=P.flags(found), lease=lease or 0, desc=desc, regions_per_page=counts,
                     sums=P.encode_sums([s for s, ok in zip(sums, found) if ok])),
                sum(found), sum(n for e in extents if e for _o, n in e))

    def frame_reads(self, ns: str, keys: list, deadline: Optional[float]) -> Tuple[List[bool], List[bytes], bytes]:
        """Pages as frames (engines without an attachment, or tcp:// peers), the engine copies them:
        (found flags, a frame a found page, their checksums as the reply's sums)."""
        def get_one(i: int):
            return (None, 0) if _late(deadline) else self.store.get_bytes_with_sum((ns, keys[i]))
        results = self.each(len(keys), get_one)
        frames = [d for d, _s in results if d is not None]
        if self.corrupt_reads is not None:  # the test hook, as for leased reads
            frames = self.corrupt_reads.damage_frames(frames)
        return ([d is not None for d, _s in results], frames,
                P.encode_sums([s for d, s in results if d is not None]))


def _late(deadline: Optional[float]) -> bool:
    return deadline is not None and time.time() > deadline
