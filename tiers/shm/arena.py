"""A memfd of fixed-size blocks that engines map read-only, with read leases.

The DRAM tier keeps its pages here, and every other daemon stages pages here
on their way in and out.  Whoever owns a piece of memory does the last copy
into it: a read never writes into the engine's host pool from the daemon.
Instead the daemon leases the blocks holding the pages until the engine's
own give-up time, and the engine copies them out of its read-only mapping of
this arena.  A leased block is not reused (a page evicted, deleted or
overwritten meanwhile parks its blocks) until the lease is released or has
expired, and the engine keeps a page only if its copy ended before the
expiry: a frozen daemon, or a frozen engine, can never make a late byte land
in memory the engine has reused.

The memfd is sealed against shrinking and growing (no SIGBUS for anyone who
maps it) and against writes through any new mapping or ``write()``
(F_SEAL_FUTURE_WRITE): only the daemon's own mapping, made before sealing,
can change it, so a buggy engine cannot write over another tenant's pages.
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tiers.shm.buffers import POPULATE_SLICE, block_extents, populate

log = logging.getLogger("hicache.arena")

F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x10
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
Extents = List[Tuple[int, int]]


def seal_against_writes(fd: int) -> bool:
    """Seal a memfd's size, then writes through any later mapping or write(): only mappings made before
    can change it.  False where the kernel lacks the write seal (Linux < 5.1: size sealed only)."""
    try:
        fcntl.fcntl(fd, _ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL)
        return True
    except OSError:
        fcntl.fcntl(fd, _ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        return False


@dataclass(slots=True)
class Alloc:
    """The blocks one page (or staged page) takes, and their (offset, length) runs, computed once."""

    alloc_id: int
    blocks: List[int]
    size: int
    extents: Extents


@dataclass
class _Lease:
    owner: int
    expiry: float  # time.monotonic(): CLOCK_MONOTONIC is one clock for every process of the machine
    allocs: List[int]
    nbytes: int


class BlockArena:
    """capacity bytes of blocks in a sealed memfd; blocks are taken, given back, and leased to readers."""

    def __init__(self, capacity: int, block_size: int, name: str, prefault: bool = True, background: bool = False):
        if block_size <= 0 or capacity < block_size:
            raise ValueError("capacity must hold at least one block")
        self.block_size = block_size
        self.n_blocks = capacity // block_size
        self.size = self.n_blocks * block_size
        self.name = name
        self.fd = os.memfd_create(f"hicache-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)  # sparse: memory is used only when written
        self._map = mmap.mmap(self.fd, self.size)
        self.view = memoryview(self._map)
        self.write_sealed = self._seal()
        # Set once the arena is faulted in (or will not be): until then copies into it run ~10x slower, so a
        # benchmark waits for it (the daemons' stats say arena_prefaulted) to measure a daemon at work.
        self.prefaulted = threading.Event()
        if not prefault:
            self.prefaulted.set()
        if prefault and background:  # serve at once; blocks fault in from the bottom up meanwhile
            threading.Thread(target=self._prefault, args=(True,), name=f"{name}-prefault", daemon=True).start()
        elif prefault:
            self._prefault(beside_serving=False)
        # Free blocks, first freed first taken, lowest first in a fresh arena.  Pages are freed in the order
        # they were written (a batch's staging, a namespace cleared, LRU or FIFO victims), so a batch taken
        # next gets its blocks back in ascending runs, and a batch of small pages sits in adjacent blocks at
        # both ends of a transfer: the remote tier moves such pages as one transfer (tiers/stores/remote/
        # engine.py merge_pieces).  A stack handed them back last freed first, in descending order.
        self._free = deque(range(self.n_blocks))
        # Pins count leases per allocation (a page), not per block: a batch of 8 MiB pages in
        # 64 KiB blocks is 128 pins, not 16,384.
        self._pins: Dict[int, int] = {}
        self._parked: Dict[int, Alloc] = {}  # given back while leased: freed when the last lease ends
        self._leases: Dict[int, _Lease] = {}
        self._owner_bytes: Dict[int, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.leases_expired = 0

    def _seal(self) -> bool:
        if seal_against_writes(self.fd):
            return True
        log.warning("%s: this kernel cannot seal the arena against writes; engines could map it writable", self.name)
        return False

    def _prefault(self, beside_serving: bool) -> None:
        """Fault the whole arena in now: a first touch costs ~10x a warm copy (0.5 vs 3-7 GB/s here).

        Beside serving threads it goes a slice at a time (see populate), and
        where the kernel cannot populate it leaves the pages to fault in on
        first use: touching them by writing would overwrite pages already stored.
        """
        try:
            self._prefault_now(beside_serving)
        finally:
            self.prefaulted.set()

    def _prefault_now(self, beside_serving: bool) -> None:
        started = time.perf_counter()
        try:
            self._map.madvise(_MADV_HUGEPAGE)  # where shmem THP is enabled; harmless elsewhere
        except (OSError, ValueError):
            pass
        try:
            done = populate(self._map, step=POPULATE_SLICE if beside_serving else 0)
        except ValueError:  # closed meanwhile (a daemon stopping at once)
            return
        if not done and beside_serving:
            log.info("%s: this kernel cannot prefault the arena; its pages fault in on first use", self.name)
            return
        if not done:  # nothing is stored yet: a write a page faults it in and changes nothing anyone reads
            for offset in range(0, self.size, mmap.PAGESIZE):
                self._map[offset] = 0
        log.info("%s: prefaulted %d MiB of arena in %.2fs", self.name, self.size >> 20, time.perf_counter() - started)

    def export_fd(self) -> int:
        """A new read-only descriptor of the arena, for an engine to map (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    # ---------------------------------------------------------------- blocks
    def blocks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.block_size)

    def take(self, nbytes: int) -> Optional[Alloc]:
        """Free blocks for nbytes (lowest first, so a fresh arena gives contiguous runs), or None."""
        got = self.take_many([nbytes])
        return got[0] if got else None

    def take_many(self, sizes: Sequence[int]) -> List[Alloc]:
        """take for each size in turn under one lock hold; the leading ones that fit (a batch's reserve)."""
        out: List[Alloc] = []
        block_size, free = self.block_size, self._free
        with self._lock:
            for nbytes in sizes:
                needed = self.blocks_for(nbytes)
                if len(free) < needed:
                    self._expire_locked(time.monotonic())
                    if len(free) < needed:
                        break
                if needed == 1:  # a page in one block (most pages: blocks are sized to them)
                    block = free.popleft()
                    out.append(Alloc(next(self._ids), [block], nbytes, [(block * block_size, nbytes)]))
                    continue
                take = free.popleft
                blocks = [take() for _ in range(needed)]
                first = blocks[0]
                extents = ([(first * block_size, nbytes)] if blocks == list(range(first, first + needed))
                           else block_extents(blocks, block_size, nbytes))
                out.append(Alloc(next(self._ids), blocks, nbytes, extents))
        return out

    def give(self, alloc: Alloc) -> None:
        """An allocation back to the arena; a leased one waits for its leases to end."""
        self.give_many((alloc,))

    def give_many(self, allocs: Sequence[Alloc]) -> None:
        """give for each allocation under one lock hold (a batch's staging)."""
        with self._lock:
            pins, free = self._pins, self._free
            for alloc in allocs:
                if alloc.alloc_id in pins:
                    self._parked[alloc.alloc_id] = alloc
                else:
                    free.extend(alloc.blocks)

    def pinned(self, alloc: Alloc) -> bool:
        """A reader's lease holds alloc: given back, its blocks wait for the lease to end."""
        with self._lock:
            return alloc.alloc_id in self._pins

    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    def views(self, alloc: Alloc) -> List[memoryview]:
        return self.extent_views(alloc.extents)

    def extent_views(self, extents: Extents) -> List[memoryview]:
        """Views of (offset, length) runs of the arena (an allocation's, or a pinned page's)."""
        return [self.view[off:off + n] for off, n in extents]

    # ---------------------------------------------------------------- leases
    def lease(self, owner: int, allocs: Sequence[Alloc], expiry: float) -> int:
        """Pin allocations for owner until release or expiry (time.monotonic()); returns the lease id."""
        nbytes = sum(a.size for a in allocs)
        with self._lock:
            lease_id = next(self._ids)
            self._leases[lease_id] = _Lease(owner, expiry, [a.alloc_id for a in allocs], nbytes)
            for alloc in allocs:
                self._pins[alloc.alloc_id] = self._pins.get(alloc.alloc_id, 0) + 1
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes
            return lease_id

    def active(self, lease_id: int) -> bool:
        """The lease still holds its blocks (neither released nor expired)."""
        with self._lock:
            return lease_id in self._leases

    def leased_bytes(self, owner: int) -> int:
        with self._lock:
            return self._owner_bytes.get(owner, 0)

    def release(self, lease_id: int, owner: int) -> bool:
        """End a lease early (only its owner may); False when unknown, expired or another's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner != owner:
                return False
            self._end_locked(lease_id)
            return True

    def expire(self) -> int:
        """End leases past their expiry; returns how many (the daemon calls this every tick)."""
        with self._lock:
            return self._expire_locked(time.monotonic())

    def _expire_locked(self, now: float) -> int:
        # Strictly after the expiry: the engine keeps a page whose copy ended at or before it.
        late = [i for i, lease in self._leases.items() if now > lease.expiry]
        for lease_id in late:
            self._end_locked(lease_id)
        self.leases_expired += len(late)
        return len(late)

    def _end_locked(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        left = self._owner_bytes.get(lease.owner, 0) - lease.nbytes
        if left > 0:
            self._owner_bytes[lease.owner] = left
        else:
            self._owner_bytes.pop(lease.owner, None)
        for alloc_id in lease.allocs:
            pins = self._pins[alloc_id] - 1
            if pins:
                self._pins[alloc_id] = pins
                continue
            del self._pins[alloc_id]
            parked = self._parked.pop(alloc_id, None)
            if parked is not None:
                self._free.extend(parked.blocks)

    def lease_count(self) -> int:
        with self._lock:
            return len(self._leases)

    def pinned_allocations(self) -> int:
        with self._lock:
            return len(self._pins)

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a slice is still held somewhere; the process is ending anyway
            pass
        os.close(self.fd)


HOLD_OWNER = -2  # lease owner of blocks kept out of use until what may still write them (a read, a transfer) ended


def hold_blocks(arena: BlockArena, allocs: Sequence[Alloc]) -> Callable[[], None]:
    """Keep allocs' blocks out of use until the returned function runs: a lease that never expires (an alloc
    given back meanwhile is parked until it ends)."""
    lease = arena.lease(HOLD_OWNER, allocs, float("inf"))
    return lambda: arena.release(lease, HOLD_OWNER)
