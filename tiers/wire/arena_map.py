"""A daemon's arena as an engine maps it: read-only, and the copy of leased pages out of it.

The engine's half of a leased read (tiers/node/arena.py is the daemon's): the
engine copies the pages into its own host pool, in one call without the GIL,
and keeps them only if that copy ended by the lease's expiry, after which
the daemon may reuse the blocks.
"""
from __future__ import annotations

import mmap
import threading
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from tiers.node.buffers import address_of, copy_runs, in_halves, populate, scatter_pages
from tiers.node.checksums import copy_runs_summed


class ArenaMap:
    """A daemon's arena, mapped read-only in this process; unmapped once closed and no copy uses it."""

    def __init__(self, arena_id: int, mapping: mmap.mmap, populate_now: bool = False):
        self.arena_id = arena_id
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
                populate(self._mapping, write=False)
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
            self._mapping.close()  # the daemon's memory is freed only when no engine maps it
            self._mapping = None

    def copy_out(self, extents: Sequence[Sequence[Tuple[int, int]]], dst: Sequence[Sequence[Tuple[int, int]]],
                 found: Sequence[bool], expiry: float, copied: Optional[List[int]] = None) -> List[bool]:
        """Copy found page i (extents in this arena, in order) into dst[i], runs of (address, length) of this
        process; the found flags when the copy ended by expiry (time.monotonic()), else all False.
        copied, when given, gets the checksum of each page as it lies in dst after the copy (0: not copied),
        each page hashed right after its copy (tiers/node/checksums.py).

        MemoryFault or ValueError (a page of another size) propagate to the caller.
        """
        out = [False] * len(found)
        if copied is not None:
            copied[:] = [0] * len(found)
        if not self.use():
            return out
        try:
            pages = [dst[i] for i, ok in enumerate(found) if ok]
            extents = list(extents)
            if len(extents) != len(pages):
                raise ValueError("the reply's extents are not one a found page")
            if time.monotonic() < expiry:
                sums = self._copy_pages(pages, extents, copied is not None)
                if copied is not None:
                    it = iter(sums)
                    copied[:] = [next(it) if ok else 0 for ok in found]
                if time.monotonic() <= expiry:
                    out = list(found)
        finally:
            self.done()
        return out

    def _copy_pages(self, pages, extents, summed: bool) -> List[int]:
        """Copy each page's extents into its runs, each page hashed after its copy when summed (its sums);
        a large batch in two halves at once (tiers/node/buffers.py in_halves)."""
        nbytes = sum(n for page in extents for _o, n in page)
        return in_halves(lambda a, b: self._copy_some(pages[a:b], extents[a:b], summed), len(pages), nbytes)

    def _copy_some(self, pages, extents, summed: bool) -> List[int]:
        # ValueError when a page's size differs from its extents'.
        runs_d, runs_s, runs_n = scatter_pages(pages, extents, self.base)
        if not summed:
            copy_runs(runs_d, runs_s, runs_n)
            return []
        flat = np.array([run for page in pages for run in page], dtype=np.uint64).reshape(-1, 2)
        return copy_runs_summed(runs_d, runs_s, runs_n, flat[:, 0], flat[:, 1],
                                np.fromiter(map(len, pages), dtype=np.int64, count=len(pages)))
