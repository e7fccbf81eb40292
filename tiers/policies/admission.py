"""Which pages a lower tier served are promoted into the top tier: those read from below min_reads times.

The backend's router promotes a page a lower tier served into the top tier
after the read (hicache_ext/router.py) and the simulator does the same
(tiers/sim/node_tiers.py); both ask a ``ReadAdmission`` which pages have
now been read from below ``min_reads`` times, this read counted.  A page
read once and never again costs the top tier a copy and a slot an eviction
must free, and on a CPU-bound server the copy's CPU comes out of the next
forward (docs/PERFORMANCE.md: 16-27 ms of a 4,096-8,192-token L3 hit here).
Admitting on the second read (2Q's probation queue, the second-hit caching
of content delivery networks) skips those one-hit wonders; 1 promotes on
every read, as before.

Memory is bounded: the read counts of the last ``remember`` pages read from
below, by hash (a collision promotes a page early, nothing worse); an older
one is forgotten, and its next read counts as its first.  A promoted page
stays counted: read from below again once the top tier evicted it, it is
promoted again at once (it proved itself; ARC's ghost hit does the same).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Iterable, List

DEFAULT_REMEMBER = 1 << 16  # pages: ~6 MB of counts; 1-4M tokens of reads at 16-64-token pages


class ReadAdmission:
    def __init__(self, min_reads: int = 2, remember: int = DEFAULT_REMEMBER):
        if isinstance(min_reads, bool) or not isinstance(min_reads, int) or min_reads < 1:
            raise ValueError(f"min_reads must be an integer >= 1, got {min_reads!r}")
        if remember < 1:
            raise ValueError(f"remember must be >= 1, got {remember!r}")
        self.min_reads = min_reads
        self.remember = remember
        # hash of a page's key -> its reads from below, least recently read first (O(1) both ends)
        self._reads: "OrderedDict[int, int]" = OrderedDict()
        self._lock = threading.Lock()  # a rank's reads may come from several threads
        self.not_admitted = 0  # pages read from below and not promoted (fewer reads than min_reads)

    def admit(self, keys: Iterable[Hashable]) -> List[bool]:
        """For each key of a page just read from below: promote it now?"""
        if self.min_reads <= 1:
            return [True for _ in keys]
        out: List[bool] = []
        with self._lock:
            reads = self._reads
            for key in keys:
                h = hash(key)
                n = reads.pop(h, 0) + 1  # popped and put back: the most recent read goes last
                reads[h] = min(n, self.min_reads)
                out.append(n >= self.min_reads)
            while len(reads) > self.remember:
                reads.popitem(last=False)
            self.not_admitted += out.count(False)
        return out

    def __len__(self) -> int:  # pages remembered
        return len(self._reads)
