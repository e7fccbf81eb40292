"""Page transfers of a tier daemon: put and get batches, owned by TierDaemon (tiers/node/daemon.py).

Two rules make a frozen or slow daemon harmless to the engine:
- The daemon never writes into an engine's memory.  A read either returns
  the bytes as frames, or leases arena blocks holding the pages and lets the
  engine copy them out itself (tiers/shm/arena.py).  Stores without an arena of
  their own (NVMe, remote) read into staging blocks of the daemon's arena.
- The daemon reads an engine's host pool only through the SIGBUS-guarded
  copy, straight into the DRAM arena or into staging blocks, and keeps a page
  only if that copy ended before the request's deadline (the engine may
  reuse its memory after that).  Stores then work on daemon-owned memory,
  except where the kernel or a NIC reads the host pool for them, so that a
  truncated memfd fails a call instead of signalling the daemon: NVMe's
  O_DIRECT writes of aligned pages (_put_in_place) and the remote tier's
  transfers of pages that are one piece of memory each (_put_from_region).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Tuple

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.shm.arena import Alloc, BlockArena
from tiers.shm.buffers import MemoryFault, address_of
from tiers.shm.page_runs import PageRuns, copy_pages
from tiers.shm.checksums import page_sums
from tiers.logs import RateLimitedLog
from tiers.stores.base import FillFailed, PageStore, StoreError

# A put whose every run starts and ends on this boundary is written out of the host pool in place: the
# alignment O_DIRECT asks of memory on the devices we run on (tiers/stores/nvme/chunkfile.py ALIGN).
IN_PLACE_ALIGN = 4096

log = logging.getLogger("hicache.daemon")
_warn = RateLimitedLog(log)

Refusal = Optional[Tuple[str, str]]
_SUM_REFUSAL = ("checksum", "a page's bytes did not match its checksum")


class PageTransfers:
    """The page work behind a put (its reads: tiers/node/reads.py)."""

    def __init__(self, name: str, store: PageStore, arena: BlockArena, pool: ThreadPoolExecutor,
                 page_workers: int, max_page_bytes: int):
        self.name = name
        self.store = store
        self.arena = arena
        self.stages = store.export_arena() is None  # pages pass through staging blocks of our own arena
        self.arena_base = address_of(arena.view)
        self._pool = pool
        self._page_pool = ThreadPoolExecutor(max_workers=max(2, page_workers), thread_name_prefix=f"{name}-page")
        self.max_page_bytes = max_page_bytes
        self.staging_full = 0  # pages of a put told busy: no staging blocks left
        self.source_gone = 0
        self.sum_refused = 0  # pages of a checked put whose bytes did not match their checksum
        self.in_place_puts = 0  # puts written straight out of a host pool (_put_in_place)
        self.region_puts = 0  # puts a store sent straight out of a host pool (_put_from_region)

    # ------------------------------------------------------------------ puts
    def page_sources(self, msg: M.Put, frames, keys: list, regions) -> "Sources":
        """Where each page's bytes are: frames we own, or runs of an engine's host pool."""
        region_id = msg.region
        if region_id is None:
            pages = _frame_pages(msg.frames_per_page, keys, frames)
            return Sources(pages, [sum(v.nbytes for v in p) for p in pages], None)
        if regions is None:
            raise P.ProtocolError("bad_request", "this daemon takes no shared-memory regions")
        region = regions.get(region_id, msg.s)
        runs = PageRuns(*P.decode_descriptor_arrays(msg.desc, msg.regions_per_page, len(keys),
                                                    region.size))
        return Sources(None, runs.sizes(), runs, region.view, region.base)

    def put_pages(self, ns: str, keys: list, sources: "Sources", parents: list, deadline: Optional[float],
                  sums: List[int], checked: bool = False, hashed: bool = False) -> Tuple[List[bool], Refusal]:
        """Store each page with its checksum (0: unknown); (stored flags, first refusal).

        checked: hash each page once it is in our memory and refuse those that do not match their
        checksum (a promotion copies a page out of a host pool some time after the engine read it:
        the engine may have reused the slot by then).  hashed (the put carried no sums): each page's
        sum is taken as it is copied into our memory, in the same pass, and set in sums."""
        if max(sources.sizes, default=0) > self.max_page_bytes:
            raise P.ProtocolError("too_large", f"page over {self.max_page_bytes} bytes")
        check = self._check_sums if checked else None
        hashed = hashed and not checked
        if (sources.runs is not None and self.stages and check is None and sources.runs.whole_pages()
                and self.store.sends_from(sources.region_view)):
            return self._put_from_region(ns, keys, sources, parents, deadline, sums, hashed)
        if sources.runs is not None and self.stages:
            return self._put_staged(ns, keys, sources, parents, deadline, sums, check, hashed)
        if sources.runs is not None:
            return self._put_into_arena(ns, keys, sources, parents, deadline, sums, check, hashed)
        if hashed:
            sums[:] = page_sums(sources.views)
        if check is not None:
            good = check(list(range(len(keys))), [sources.views[i] for i in range(len(keys))], sums)
            return _outcomes(self.each(len(keys), lambda i: self._put_owned(ns, keys[i], sources.views[i],
                                                                             parents[i], sums[i])
                                        if good[i] else (False, _SUM_REFUSAL)))
        return _outcomes(self.each(len(keys), lambda i: self._put_owned(ns, keys[i], sources.views[i], parents[i],
                                                                         sums[i])))

    def _check_sums(self, idx: List[int], pages: List[List[memoryview]], sums: List[int],
                    got: Optional[List[int]] = None) -> List[bool]:
        """Per position of idx: does pages[j] (page idx[j]'s bytes in our memory, or got[j], their sum as
        taken while copying them) match sums[idx[j]] (0, unknown, matches nothing: a checked put must carry
        every sum)."""
        good = [s == sums[i] and s != 0 for i, s in zip(idx, page_sums(pages) if got is None else got)]
        bad = len(good) - sum(good)
        if bad:
            self.sum_refused += bad
            _warn.warning("sum-refused", "tier %s: %d page(s) of a checked put (a promotion) did not match their "
                                         "checksum (the engine reused the slot first); refused", self.name, bad)
        return good

    def _put_into_arena(self, ns, keys, sources: "Sources", parents, deadline,
                        sums: List[int], check=None, hashed: bool = False) -> Tuple[List[bool], Refusal]:
        """A store that keeps pages in its arena: reserve, guarded copy out of the host pool, commit.

        The batch's pages are reserved, copied (one C call a half, without the GIL) and committed as one
        group, each step taking the store's lock once; the store makes room for them ahead where its policy
        evicts exactly what inserting page by page would (LRU, FIFO).  Elsewhere a page that must evict is
        reserved alone once the group before it is committed (so eviction sees the pages in the order they
        were written, as the trace simulator does).
        """
        n = len(keys)
        stored = [False] * n
        group: List[Tuple[int, Alloc]] = []
        failed: Refusal = None
        store = self.store

        def flush() -> Refusal:
            refusal = self._copy_group(sources, group, deadline, sums if hashed else None)
            good = [True] * len(group)
            if refusal is None and check is not None:
                good = check([i for i, _a in group], [self.arena.extent_views(a.extents) for _i, a in group], sums)
                refusal = None if all(good) else _SUM_REFUSAL
            kept = [(i, alloc) for (i, alloc), ok in zip(group, good)
                    if refusal is None or (refusal is _SUM_REFUSAL and ok)]
            if len(kept) < len(group):
                for (i, alloc), ok in zip(group, good):
                    if not (refusal is _SUM_REFUSAL and ok):
                        store.abort(alloc)
            if kept:
                store.commit_many(ns, [keys[i] for i, _a in kept], [alloc for _i, alloc in kept],
                                  [parents[i] if isinstance(parents[i], str) else None for i, _a in kept],
                                  [sums[i] for i, _a in kept])
                for i, _alloc in kept:
                    stored[i] = True
            group.clear()
            return refusal

        i = 0
        while i < n:
            if _late(deadline):
                failed = ("deadline", "deadline passed during the batch")
                break
            try:
                allocs = store.reserve_many(ns, keys[i:], sources.sizes[i:], evict=True)
            except StoreError:
                allocs = []  # the page at i is refused below, with its reason
            group.extend(zip(range(i, i + len(allocs)), allocs))
            i += len(allocs)
            if i == n:
                break
            try:  # page i does not fit without evicting (or is refused): what is reserved goes first
                refusal = flush() if group else None
                if refusal is not None:
                    failed = refusal
                    break
                group.append((i, store.reserve((ns, keys[i]), sources.sizes[i])))
            except StoreError as exc:
                failed = failed or (exc.code, str(exc))
            i += 1
        if group:
            if failed is not None and failed[0] == "deadline":
                for _i, alloc in group:
                    store.abort(alloc)
            else:
                failed = flush() or failed
        return stored, failed

    def _copy_group(self, sources: "Sources", group: List[Tuple[int, Alloc]], deadline: Optional[float],
                    sums: Optional[List[int]] = None) -> Refusal:
        """One guarded copy of a group of pages out of a host pool into their blocks; why not, when the
        pool went away under it or it ended after the deadline.  sums, when given, gets each copied
        page's checksum at its position (hashed right after its copy, in the cache)."""
        if _late(deadline):
            return ("deadline", "deadline passed during the batch")
        # From the host pool (offsets from its base) into the arena (absolute addresses), one C call a half.
        dst = PageRuns.of_lists([alloc.extents for _i, alloc in group], self.arena_base)
        try:
            taken = copy_pages(dst, sources.runs.take([i for i, _alloc in group]), sources.region_base,
                               summed=sums is not None)
        except MemoryFault:
            return self._source_gone()
        if sums is not None:
            for (i, _alloc), checksum in zip(group, taken):
                sums[i] = checksum
        # Bytes copied after the engine gave up may be torn (it reuses its buffers at once).
        return ("deadline", "deadline passed during the copy") if _late(deadline) else None

    def _source_gone(self) -> Tuple[str, str]:
        """A host pool that shrank under a copy or an in-place hash: counted, said, and the pages' refusal."""
        self.source_gone += 1
        _warn.warning("gone", "tier %s: a host pool shrank under a put (the engine truncated its memfd); "
                              "pages refused", self.name)
        return ("bad_request", "the host pool went away under the copy")

    def _put_owned(self, ns, key, page, parent, checksum: int) -> Tuple[bool, Refusal]:
        """Pages in daemon-owned memory (frames): the store takes them as they are."""
        try:
            self.store.put_with_sum((ns, key), page, parent if isinstance(parent, str) else None, checksum)
        except StoreError as exc:
            return False, (exc.code, str(exc))
        return True, None

    def _put_staged(self, ns, keys, sources: "Sources", parents, deadline,
                    sums: List[int], check=None, hashed: bool = False) -> Tuple[List[bool], Refusal]:
        """Stores without an arena: copy the batch into staging first (one guarded C call, as
        _put_into_arena does), then hand the store our own memory."""
        if (self.store.batched and self.store.fills_in_parts and check is None
                and sources.runs.aligned(sources.region_base, IN_PLACE_ALIGN)):
            return self._put_in_place(ns, keys, sources, parents, deadline, sums, hashed)
        # One lock hold for the batch's staging: the leading pages that fit (the rest are told busy).
        group: List[Tuple[int, Alloc]] = list(enumerate(self.arena.take_many(sources.sizes)))
        refusal: Refusal = None
        if len(group) < len(sources.sizes):
            self.staging_full += len(sources.sizes) - len(group)
            refusal = ("busy", "staging arena full; try again")
        if group and self.store.batched and self.store.fills_in_parts and check is None:
            return self._put_staged_filled(ns, keys, sources, parents, deadline, sums, group, refusal, hashed)
        # A checked or hashed put: each page hashed as it is copied (in C, while in the cache), not after;
        # a batched store gets these sums too (page_sums) and need not hash the bytes again.
        copied: Optional[List[int]] = [0] * len(keys) if hashed or check is not None else None
        failed = self._copy_group(sources, group, deadline, copied) if group else None
        if failed is not None:
            self.arena.give_many([alloc for _i, alloc in group])
            return [False] * len(keys), failed
        views: List[Optional[List[memoryview]]] = [None] * len(keys)
        for i, alloc in group:
            views[i] = self.arena.views(alloc)
            if hashed:
                sums[i] = copied[i]
        if check is not None:
            idx = [i for i, _alloc in group]
            for i, ok in zip(idx, check(idx, [views[i] for i in idx], sums, [copied[i] for i in idx])):
                if not ok:
                    views[i] = None
                    refusal = refusal or _SUM_REFUSAL
        try:
            if self.store.batched:
                idx = [i for i, _alloc in group if views[i] is not None]
                out = self.store.put_many_with_sums([(ns, keys[i]) for i in idx], [views[i] for i in idx],
                                                    [parents[i] for i in idx], deadline, [sums[i] for i in idx],
                                                    None if copied is None else [copied[i] for i in idx])
                results = _results(len(keys), idx, out)
            else:
                results = self.each(len(keys), lambda i: self._put_owned(ns, keys[i], views[i], parents[i], sums[i])
                                     if views[i] is not None else (False, None))
        finally:
            self.arena.give_many([alloc for _i, alloc in group])
        stored, first = _outcomes(results)
        return stored, refusal or first

    def _put_staged_filled(self, ns, keys, sources: "Sources", parents, deadline, sums: List[int],
                           group: List[Tuple[int, Alloc]], refusal: Refusal,
                           hashed: bool = False) -> Tuple[List[bool], Refusal]:
        """A batched store fills its parts from the host pool as it writes them (put_many_filled): each
        part's guarded copy, hashed as it goes, overlaps the device writing the part before.  hashed (the
        put carried no sums): those taken while copying are the pages' sums, set in sums."""
        def fill(positions: List[int]) -> List[int]:
            part = [group[p] for p in positions]
            copied = [0] * len(keys)
            failed = self._copy_group(sources, part, deadline, copied)
            if failed is not None:
                raise FillFailed(*failed)
            if hashed:
                for i, _alloc in part:
                    sums[i] = copied[i]
            return [copied[i] for i, _alloc in part]
        checksums = None if hashed else [sums[i] for i, _a in group]
        try:
            out = self.store.put_many_filled([(ns, keys[i]) for i, _a in group],
                                             [self.arena.views(alloc) for _i, alloc in group],
                                             [parents[i] for i, _a in group], deadline, checksums, fill)
        finally:
            self.arena.give_many([alloc for _i, alloc in group])
        stored, first = _outcomes(_results(len(keys), [i for i, _alloc in group], out))
        return stored, refusal or first

    def _put_in_place(self, ns, keys, sources: "Sources", parents, deadline, sums: List[int],
                      hashed: bool) -> Tuple[List[bool], Refusal]:
        """A batched store that fills in parts writes straight out of the host pool when every run is
        4 KiB-aligned (O_DIRECT takes the engine's memory as it is): no staging copy, only a guarded hash of
        each part, in place, before the device reads it.  Bytes the engine changes after that hash reach the
        disk under the sum of the old ones: a read finds the mismatch and misses, never serves them.  The
        mapping stays while its views live (tiers/node/regions.py); the store is done with them on return."""
        def fill(positions: List[int]) -> List[int]:
            got = self._sums_in_place(sources, sources.runs.take(positions), deadline)
            if hashed:
                for p, checksum in zip(positions, got):
                    sums[p] = checksum
            return got
        self.in_place_puts += 1
        out = self.store.put_many_filled([(ns, key) for key in keys], sources.views, parents, deadline,
                                         None if hashed else list(sums), fill, aligned=True)
        return _outcomes(_results(len(keys), list(range(len(keys))), out))

    def _put_from_region(self, ns, keys, sources: "Sources", parents, deadline, sums: List[int],
                         hashed: bool) -> Tuple[List[bool], Refusal]:
        """A store that sends pages itself (``PageStore.sends_from``: the remote tier) is handed the host pool's
        pages as they are when each is one piece of memory (MLA pools, ``page_unified``): no staging copy of
        the batch, only, when hashed, a guarded hash of each page in place first.  Pages split into K and V
        regions are staged instead: sent in place they doubled the transfers (256 of 128 KiB instead of 128 of
        256 KiB, 18.8 against 15.4 ms on the wire, docs/PERFORMANCE.md session 40), where staged neighbours
        merge.  Bytes the engine changes after the hash reach the pool under the sum of the old ones: a read
        finds the mismatch and misses, never serves them.  The store refuses what it moved after the deadline
        (the engine may have reused the memory)."""
        n = len(keys)
        if hashed:
            try:
                sums[:] = self._sums_in_place(sources, sources.runs, deadline)
            except FillFailed as exc:
                return [False] * n, (exc.code, str(exc))
        self.region_puts += 1
        out = self.store.put_many_with_sums([(ns, key) for key in keys], sources.views, parents, deadline,
                                            list(sums), list(sums) if hashed else None)
        return _outcomes(_results(n, list(range(n)), out))

    # --------------------------------------------------------------- helpers
    def _sums_in_place(self, sources: "Sources", runs: PageRuns, deadline: Optional[float]) -> List[int]:
        """Each of runs' pages hashed where it lies in the host pool (guarded); FillFailed when the deadline
        passed first or the host pool shrank under the hash."""
        if _late(deadline):
            raise FillFailed("deadline", "deadline passed during the batch")
        try:
            return runs.sums(sources.region_base)
        except MemoryFault:
            raise FillFailed(*self._source_gone()) from None

    def each(self, n: int, work: Callable[[int], object]) -> list:
        """work(i) for every page; several in flight for stores that take concurrent calls (disk)."""
        if n > 1 and self.store.parallel_io:
            return list(self._page_pool.map(work, range(n)))
        return [work(i) for i in range(n)]

    def close(self) -> None:
        self._page_pool.shutdown(wait=True)


@dataclass
class Sources:
    """The pages of a put: views of each (frames, or slices of a host pool), their sizes, and for a
    host pool their runs, offsets from region_base in this process (None for frames: memory we own)."""

    frame_views: Optional[List[List[memoryview]]]  # frames; None for a host pool (views made on demand)
    sizes: List[int]
    runs: Optional[PageRuns]
    region_view: Optional[memoryview] = None  # the host pool's mapping, for views of its pages
    region_base: int = 0

    @cached_property
    def views(self) -> List[List[memoryview]]:
        """Each page's views; for a host pool only the paths that copy page by page ask (the arena path
        copies by address and never builds them)."""
        if self.frame_views is not None:
            return self.frame_views
        view = self.region_view
        return [[view[off:off + n] for off, n in page] for page in self.runs.as_lists()]


def _late(deadline: Optional[float]) -> bool:
    return deadline is not None and time.time() > deadline


def _results(n: int, positions: List[int], out: List[Optional[StoreError]]) -> list:
    """(stored, refusal) for each of n pages from a batched store's answer for those at positions."""
    results: list = [(False, None)] * n
    for i, exc in zip(positions, out):
        results[i] = (True, None) if exc is None else (False, (exc.code, str(exc)))
    return results


def _outcomes(results) -> Tuple[List[bool], Refusal]:
    stored = [ok for ok, _why in results]
    return stored, next((why for _ok, why in results if why), None)


def _frame_pages(per_page: Optional[List[int]], keys: list, frames) -> List[List[memoryview]]:
    if per_page is None:
        per_page = [1] * len(keys)
    if len(per_page) != len(keys) or not all(n > 0 for n in per_page) or sum(per_page) != len(frames):
        raise P.ProtocolError("bad_request", f"{len(keys)} keys do not match {len(frames)} page frames")
    pages, start = [], 0
    for n in per_page:
        pages.append([f.buffer for f in frames[start:start + n]])
        start += n
    return pages

