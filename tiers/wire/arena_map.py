"""A daemon's arena as an engine maps it: read-only, and the copy of leased pages out of it.

The engine's half of a leased read (tiers/shm/arena.py is the daemon's): the
engine copies the pages into its own host pool, in one call without the GIL,
and keeps them only if that copy ended by the lease's expiry, after which
the daemon may reuse the blocks.
"""
from __future__ import annotations

import mmap
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from tiers.shm import progress
from tiers.shm.buffers import POPULATE_SLICE, address_of, populate
from tiers.shm.directory import DirectoryView
from tiers.shm.page_runs import PageRuns, copy_pages


class ArenaMap:
    """A daemon's arena, mapped read-only in this process; unmapped once closed and no copy uses it."""

    def __init__(self, arena_id: int, mapping: mmap.mmap, populate_now: bool = False,
                 directory: Optional[DirectoryView] = None):
        self.arena_id = arena_id
        self.directory = directory  # the arena's page directory, read-only: hits found without asking
        self.size = len(mapping)
        self._mapping: Optional[mmap.mmap] = mapping
        self._users = 0
        self._closed = False
        self._lock = threading.Lock()
        with memoryview(mapping) as view:
            self.base = address_of(view)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # the daemon's shmem THP, where enabled
        except (AttributeError, OSError, ValueError):
            pass
        # Build the page tables off the engine's threads: a copy out of a fresh mapping would
        # otherwise take a minor fault every 4 KiB (the daemon prefaulted the memory itself).
        if populate_now:
            self._users += 1
            threading.Thread(target=self._populate, name="arena-populate", daemon=True).start()

    def _populate(self) -> None:
        try:
            if self._mapping is not None:
                populate(self._mapping, write=False, step=POPULATE_SLICE)  # beside the engine's threads
        except (OSError, ValueError, TypeError):
            pass
        finally:
            self.done()

    def use(self) -> bool:
        """Hold the mapping for a copy (False once closed)."""
        with self._lock:
            if self._closed:
                return False
            self._users += 1
            return True

    def done(self) -> None:
        with self._lock:
            self._users -= 1
            self._unmap_if_idle_locked()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._unmap_if_idle_locked()

    def _unmap_if_idle_locked(self) -> None:
        if self._closed and not self._users and self._mapping is not None:
            # Unmapped on a thread of its own: the last mapping of a dead daemon's arena frees its memory
            # (2 GiB of NVMe staging: 0.57 s idle here, 1.4 s in the short chaos test), and whichever thread
            # closed it waited that long: the prober re-attaching to the restarted daemon under the client's
            # lock (so every call of the engine behind it), or a read that finished the last copy.
            mapping, self._mapping = self._mapping, None
            threading.Thread(target=mapping.close, name="arena-unmap", daemon=True).start()
            if self.directory is not None:
                self.directory.close()

    def copy_out(self, extents: PageRuns, dst: PageRuns, found: Sequence[bool], expiry: float,
                 copied: Optional[List[int]] = None) -> List[bool]:
        """Copy found page i (extents: offsets in this arena, one a found page, in order) into page i of dst
        (addresses of this process); the found flags when the copy ended by expiry (time.monotonic()), else
        all False.  copied, when given, gets the checksum of each page as it lies in dst after the copy
        (0: not copied), each page hashed right after its copy (tiers/shm/page_runs.py).

        MemoryFault or ValueError (a page of another size) propagate to the caller.
        """
        out = [False] * len(found)
        if copied is not None:
            copied[:] = [0] * len(found)
        if not self.use():
            return out
        try:
            if len(extents) != sum(found):
                raise ValueError("the reply's extents are not one a found page")
            if time.monotonic() < expiry:
                sums = copy_pages(dst.select(found), extents, self.base, copied is not None)
                if copied is not None:
                    it = iter(sums)
                    copied[:] = [next(it) if ok else 0 for ok in found]
                if time.monotonic() <= expiry:
                    out = list(found)
        finally:
            self.done()
        return out

    def copy_streamed(self, extents: PageRuns, dst: PageRuns, found: Sequence[bool], board: int, expiry: float,
                      copied: Optional[List[int]] = None,
                      alive: Optional[Callable[[], bool]] = None) -> Tuple[List[bool], List[int]]:
        """A streamed read's pages (tiers/shm/progress.py), each found page copied as the board at offset board
        marks it read, until every one is marked, expiry passes or alive() says the daemon exited: (the pages
        copied by expiry, each page's checksum as the board gave it, 0 for the others); copied as for
        copy_out.  Errors as copy_out's."""
        n = len(found)
        out, sums = [False] * n, [0] * n
        if copied is not None:
            copied[:] = [0] * n
        if not self.use():
            return out, sums
        try:
            if len(extents) != sum(found):
                raise ValueError("the reply's extents are not one a found page")
            if not 0 <= board <= self.size - progress.board_bytes(n):
                raise ValueError("the read's progress board lies outside the arena")
            rank = np.cumsum(np.asarray(found, dtype=np.int64)) - 1  # page i's extents among the found pages'
            reader = progress.BoardReader(self.base + board, found)
            while reader.left:
                read, missed = reader.next_final(expiry, alive)
                if not read and not missed:
                    break  # expiry passed
                if not read or time.monotonic() >= expiry:
                    continue
                take_dst = np.zeros(n, dtype=bool)
                take_dst[read] = True
                take_src = np.zeros(len(extents), dtype=bool)
                take_src[rank[read]] = True
                got = copy_pages(dst.select(take_dst), extents.select(take_src), self.base, copied is not None)
                if time.monotonic() > expiry:
                    break  # the lease ended during this copy: these pages may hold the blocks' next bytes
                for j, i in enumerate(read):
                    out[i], sums[i] = True, int(reader.sums[i])
                    if copied is not None:
                        copied[i] = got[j]
        finally:
            self.done()
        return out, sums

    def read_direct(self, namespace_id: int, digests: bytes, size: int, dst: PageRuns,
                    summed: bool) -> Tuple[List[bool], List[int], List[int]]:
        """The pages of dst found in the page directory, copied out of this arena (DirectoryView.read); all
        False when there is no directory or the mapping is closed."""
        if self.directory is None or not self.use():
            return [False] * len(dst), [0] * len(dst), []
        try:
            return self.directory.read(namespace_id, digests, size, dst, self.base, summed)
        finally:
            self.done()

    def held_direct(self, namespace_id: int, digests: bytes) -> Optional[bytes]:
        """The page directory's held flags (DirectoryView.held); None without a directory or once closed."""
        if self.directory is None or not self.use():
            return None
        try:
            return self.directory.held(namespace_id, digests)
        finally:
            self.done()
