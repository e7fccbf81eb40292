"""A test hook, never a product switch: a daemon that damages the pages it serves.

With ``HICACHE_TIERS_TEST_CORRUPT_READS`` set to N (or ``all``) when a tier
daemon starts, the daemon flips one byte of each of the first N pages it
serves, in the bytes the engine reads (the leased arena extent, or the
frame), after the tier's own checks: the engine's end-to-end checksums
(hicache_ext/page_sums.py) must then take those pages for misses.  The
daemon reads the variable once, when it is built, and warns loudly while the
hook is on.  In the DRAM tier the leased extent is the stored page itself,
so its damage stays (as a bit flip in memory would); other tiers damage only
the staged copy of one read.  It lives here, not in tiers/testing, because
that package needs pytest and a daemon must not.
"""
from __future__ import annotations

import logging
import threading
from typing import List, Mapping, Optional, Sequence, Tuple

log = logging.getLogger("hicache.daemon")

ENV = "HICACHE_TIERS_TEST_CORRUPT_READS"


class CorruptReads:
    """Flips one byte of each of the first ``pages`` pages served (None: every page)."""

    def __init__(self, pages: Optional[int]):
        self.pages = pages
        self.damaged = 0
        self._lock = threading.Lock()  # reads are served from the loop thread and the I/O pool

    @classmethod
    def from_environ(cls, tier: str, environ: Mapping[str, str]) -> Optional["CorruptReads"]:
        """The hook the environment asks for (None when the variable is unset or empty)."""
        raw = environ.get(ENV, "").strip()
        if not raw:
            return None
        if raw.lower() != "all" and not (raw.isdigit() and int(raw) > 0):
            raise ValueError(f"{ENV} must be a positive number of pages or 'all', not {raw!r}")
        hook = cls(None if raw.lower() == "all" else int(raw))
        log.warning("TEST HOOK ACTIVE: %s=%s: tier %s damages %s pages it serves; never set this in production",
                    ENV, raw, tier, "all the" if hook.pages is None else f"the first {hook.pages}")
        return hook

    def _take(self, n: int) -> int:
        """How many of the next n pages served get damaged."""
        with self._lock:
            take = n if self.pages is None else max(0, min(n, self.pages - self.damaged))
            self.damaged += take
            return take

    def damage_extents(self, arena: memoryview, pages: Sequence[Optional[List[Tuple[int, int]]]]) -> None:
        """Flip the first byte of each found page's first extent (offset, length) in the daemon's arena."""
        found = [extents for extents in pages if extents]
        for extents in found[:self._take(len(found))]:
            offset = extents[0][0]
            arena[offset] ^= 0xFF

    def damage_frames(self, frames: List) -> List:
        """The frames of found pages, the first ones a damaged copy."""
        out = list(frames)
        for i in range(self._take(len(out))):
            damaged = bytearray(out[i])
            if damaged:
                damaged[0] ^= 0xFF
            out[i] = damaged
        return out
