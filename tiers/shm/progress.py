"""A streamed read's progress board: staged pages handed to the engine as each one's read ends.

A tier that reads pages from a device into staging (NVMe) used to answer a
leased get once every page was read; the engine then copied the whole batch
out of staging while the device had nothing to do (~10-16% of a cold read
here: 2.3 of 23 ms at 64 KiB, 6 of 38 ms at 256 KiB).  Streamed, the daemon
answers at once with the lease and a board in its arena (tiers/_progress.c);
its reads mark each page final on the board (a sum and a state, then a count
the engine waits on with a futex), and the engine copies each page as it is
marked, while the rest are still being read.  The late-copy rule is the
leased read's: bytes move only into staging, the engine copies only before
its lease's expiry, and the daemon keeps the blocks out of use until its own
reads ended, whatever the lease (tiers/node/streamed_reads.py).
"""
from __future__ import annotations

import ctypes
import functools
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

PENDING, READ, MISSED = 0, 1, 2
NOT_ASKED = 3  # the engine's own mark for a page the reply did not lease: never waited for
# The engine's longest single futex wait, after which it asks whether the daemon is still there (a daemon
# that exited marks nothing more); a frozen one is waited for until the lease's expiry.
WAIT_SLICE_S = 0.05


@functools.lru_cache(maxsize=None)
def lib() -> Optional[ctypes.CDLL]:
    """The compiled board (tiers/_progress.c), or None where it is not built: reads are then not streamed."""
    from importlib.util import find_spec
    try:
        spec = find_spec("tiers._progress")
        if spec is None or not spec.origin:
            return None
        dll = ctypes.CDLL(spec.origin)
    except (ImportError, OSError):
        return None
    vp, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    dll.progress_board_bytes.argtypes, dll.progress_board_bytes.restype = [i64], i64
    dll.progress_mark.argtypes, dll.progress_mark.restype = [vp, i64, vp, vp, vp, i64], None
    dll.progress_wait.argtypes, dll.progress_wait.restype = [vp, u32, i64], u32
    dll.progress_take.argtypes, dll.progress_take.restype = [vp, i64, vp, vp], i64
    return dll


def built() -> bool:
    return lib() is not None


def board_bytes(n: int) -> int:
    """Bytes of a board for n pages."""
    return int(lib().progress_board_bytes(n))


class BoardWriter:
    """The daemon's side of one board: at address (its own, writable mapping), zeroed here."""

    def __init__(self, address: int, n: int):
        self.address, self.n = address, n
        self._marked = np.zeros(n, dtype=bool)  # each position is marked by one reader thread, once
        ctypes.memset(address, 0, board_bytes(n))

    def mark(self, positions: Sequence[int], sums: Sequence[Optional[int]]) -> None:
        """Pages positions final: read with its sum, or missed where the sum is None; one wake."""
        if not positions:
            return
        at = np.asarray(positions, dtype=np.int64)
        self._marked[at] = True
        state = np.array([MISSED if s is None else READ for s in sums], dtype=np.uint32)
        value = np.array([s or 0 for s in sums], dtype=np.uint64)
        lib().progress_mark(self.address, self.n, at.ctypes.data, state.ctypes.data, value.ctypes.data, len(at))

    def mark_missed_rest(self, positions: Sequence[int]) -> None:
        """Those of positions not marked yet, marked missed (once every reader is done)."""
        rest = [p for p in positions if not self._marked[p]]
        self.mark(rest, [None] * len(rest))


class BoardReader:
    """The engine's side of one board, in its read-only mapping of the daemon's arena.  asked[i]: the
    reply leased page i (only those are waited for)."""

    def __init__(self, address: int, asked: Sequence[bool]):
        self.address, self.n = address, len(asked)
        self.taken = np.array([PENDING if a else NOT_ASKED for a in asked], dtype=np.uint8)
        self.sums = np.zeros(self.n, dtype=np.uint64)
        self._seen = 0
        self.left = int(sum(1 for a in asked if a))

    def next_final(self, expiry: float, alive: Optional[Callable[[], bool]] = None) -> Tuple[List[int], List[int]]:
        """(pages read, pages missed) marked since the last call, waiting up to expiry (time.monotonic())
        for at least one; both empty once expiry passed with nothing new, or once alive() (asked after
        each WAIT_SLICE_S without a mark) says the daemon that marks the board is gone."""
        dll = lib()
        while self.left:
            before = self.taken.copy()
            if dll.progress_take(self.address, self.n, self.taken.ctypes.data, self.sums.ctypes.data):
                fresh = np.nonzero(before != self.taken)[0]
                read = [int(i) for i in fresh if self.taken[i] == READ]
                missed = [int(i) for i in fresh if self.taken[i] != READ]
                self.left -= len(fresh)
                return read, missed
            left = expiry - time.monotonic()
            if left <= 0:
                break
            seen = int(dll.progress_wait(self.address, self._seen, int(min(left, WAIT_SLICE_S) * 1e9)))
            if seen == self._seen and alive is not None and not alive():
                break  # a daemon that exited marks nothing more: its pages are misses now, not at expiry
            self._seen = seen
        return [], []
