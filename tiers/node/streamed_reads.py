"""Leased reads answered at once: the engine copies each staged page as its read ends (tiers/shm/progress.py).

A get from a store that reads into staging (``streams_reads``: NVMe, remote) takes
the staging blocks and a progress board on the loop, leases them to the engine,
answers, and reads in the I/O pool; each run of pages read is marked on the
board, and the engine, waiting on it, copies those while the device reads
the rest.  Bytes only ever land in staging.  The blocks stay out of use until
the reads that write them ended (a hold of their own, whatever the engine's
lease: released early or expired), and a session's staging in flight counts
against its lease share until then, so a client that asks and gives up at
once cannot make the daemon hold more than that share for it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from tiers.node.faults import CorruptReads
from tiers.shm import progress
from tiers.shm.arena import Alloc, BlockArena, hold_blocks
from tiers.shm.buffers import address_of
from tiers.stores.base import PageStore
from tiers.wire import protocol as P

log = logging.getLogger("hicache.daemon")


class StreamedReads:
    def __init__(self, store: PageStore, arena: BlockArena, submit: Callable, count: Callable[[int, int], None],
                 corrupt_reads: Optional[CorruptReads] = None,
                 observe: Optional[Callable[[float], None]] = None):
        self.store, self.arena = store, arena
        self.enabled = store.streams_reads and store.export_arena() is None and progress.built()
        self._submit = submit  # runs the reads in the daemon's I/O pool
        self._count = count  # (pages, bytes) read: the daemon's get metrics
        # A get's duration, from its answer's start to its reads' end (the daemon's request_duration for a
        # streamed get: its reply alone would time none of the reading).
        self._observe = observe
        self.corrupt_reads = corrupt_reads
        self._base = address_of(arena.view) if self.enabled else 0
        self._lock = threading.Lock()
        self._in_flight: Dict[int, Dict[int, int]] = {}  # owner -> {its lease: bytes} of reads not ended
        self.reads = 0  # gets answered at once and streamed (the daemon's stats)

    def in_flight_bytes(self) -> int:
        """Staging bytes streamed reads hold now (every session's)."""
        with self._lock:
            return sum(sum(reads.values()) for reads in self._in_flight.values())

    def held_past_lease(self, owner: int) -> int:
        """Staging bytes owner's streamed reads still hold though its lease ended (released or expired): the
        rest of what they hold is in its leased bytes already."""
        with self._lock:
            reads = list(self._in_flight.get(owner, {}).items())
        return sum(nbytes for lease, nbytes in reads if not self.arena.active(lease))

    def start(self, ns: str, keys: list, sizes: List[int], owner: int, expiry: float,
              take_staging: Callable[[List[int], int], List[Optional[Alloc]]], budget: int) -> tuple:
        """Lease staging and a board for keys and start their reads (on the loop: memory work only):
        (reply fields, 0, 0); every page a miss where the session's share or the arena has no room left."""
        n = len(keys)
        started = time.perf_counter()
        board = self.arena.take(progress.board_bytes(n)) if budget > 0 else None
        # A board is one block (49 KiB for the largest batch): a staging arena's blocks are 64 KiB.  It is
        # not taken out of the budget (a session's share is a whole number of SGLang batches: 128 pages of
        # 8 MiB in 1 GiB), but it is leased and held with the pages, so it counts for the next read.
        allocs = take_staging(sizes, budget) if board is not None and len(board.extents) == 1 else []
        idx = [i for i, a in enumerate(allocs) if a is not None]
        if not idx:
            if board is not None:
                self.arena.give(board)
            if self._observe is not None:
                self._observe(time.perf_counter() - started)
            return dict(found=P.flags([False] * n), lease=0), 0, 0
        staged = [allocs[i] for i in idx]
        writer = progress.BoardWriter(self._base + board.extents[0][0], n)
        kept = staged + [board]
        nbytes = sum(a.size for a in kept)
        lease = self.arena.lease(owner, kept, expiry)
        hold = hold_blocks(self.arena, kept)  # until the reads ended, whatever the lease
        self.arena.give_many(kept)  # parked until both end
        with self._lock:
            self._in_flight.setdefault(owner, {})[lease] = nbytes
            self.reads += 1
        deadline = time.time() + max(0.0, expiry - time.monotonic())  # the store skips runs past it
        try:
            self._submit(lambda: self._read(ns, keys, idx, staged, writer, owner, (lease, hold), deadline,
                                            started))
        except RuntimeError:  # the pool is shutting down (the daemon stops): nothing will be read
            self._end(idx, [None] * len(idx), writer, owner, (lease, hold), staged, started)
        desc, counts = P.encode_descriptors([a.extents for a in staged])
        found = [a is not None for a in allocs]
        return (dict(found=P.flags(found), lease=lease, desc=desc, regions_per_page=counts,
                     board=board.extents[0][0]), 0, 0)

    def _read(self, ns: str, keys: list, idx: List[int], staged: List[Alloc], writer: progress.BoardWriter,
              owner: int, leases: Tuple[int, Callable[[], None]], deadline: float, started: float) -> None:
        final: List[Optional[int]] = [None] * len(idx)  # each page's sum once read (reader threads write these)

        def on_final(positions: List[int], sums: List[Optional[int]]) -> None:
            if self.corrupt_reads is not None:  # the test hook: after the tier's checks, before the engine's
                self.corrupt_reads.damage_extents(self.arena.view, [staged[p].extents for p, s in
                                                                    zip(positions, sums) if s is not None])
            for p, s in zip(positions, sums):
                final[p] = s
            writer.mark([idx[p] for p in positions], sums)
        try:
            # A page whose transfer the store gave up while its bytes may still land (the remote tier's) is
            # held on past the read's end, until the store says that transfer ended.
            self.store.get_many_streamed([(ns, keys[i]) for i in idx], [self.arena.views(a) for a in staged],
                                         deadline, on_final, lambda p: hold_blocks(self.arena, [staged[p]]))
        except Exception:  # a store's failure is a miss of whatever it did not mark, never a stuck engine
            log.exception("streamed read of %d pages failed", len(idx))
        finally:
            self._end(idx, final, writer, owner, leases, staged, started)

    def _end(self, idx: List[int], final: List[Optional[int]], writer: progress.BoardWriter, owner: int,
             leases: Tuple[int, Callable[[], None]], staged: List[Alloc], started: float) -> None:
        """The reads ended: pages never marked are marked missed, the blocks' hold ends, the session's staging in
        flight and the metrics are counted."""
        writer.mark_missed_rest(idx)
        lease, release_hold = leases
        release_hold()
        with self._lock:
            reads = self._in_flight.get(owner, {})
            reads.pop(lease, None)
            if not reads:
                self._in_flight.pop(owner, None)
        read = [p for p, s in enumerate(final) if s is not None]
        self._count(len(read), sum(staged[p].size for p in read))
        if self._observe is not None:
            self._observe(time.perf_counter() - started)
