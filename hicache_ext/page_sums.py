"""End-to-end page checksums, the engine's half: the sum each written page carries, the check of each read.

A page's checksum is xxh3_64 of its bytes in the host pool, its regions in
order (hicache_ext/host_pool.py): a put asks each tier's daemon to hash each
page as it copies it (tiers/wire/protocol.py ``hash_pages``), the same sum in
the copy's own pass; a write of buffers (the legacy path) and a promotion
send sums computed here (``sums``).  Every tier keeps it with the page, moves
between tiers keep it, and reads return it.  After this process copied a page
into its host pool (out of a daemon's arena, or from a frame) it hashes the
page there again: a page that does not match is a miss, counted and logged,
never reported to SGLang as a hit.  A sum of 0 is unknown (a page stored by
an older writer, a tier kind that keeps none) and is not checked.

A batch is hashed in one C call without the GIL, and a copy out of a daemon's
arena hashes each page right after copying it (tiers/shm/checksums.py): one
GIL hand-over a batch, not one a page, which in a busy server is what counts.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, List, Sequence

from tiers.shm.checksums import page_sums
from tiers.logs import RateLimitedLog

log = logging.getLogger("hicache.backend")
_warn = RateLimitedLog(log)

__all__ = ["ReadChecks", "page_sums"]

SumsOf = Callable[[List[int]], List[int]]  # page positions -> each page's checksum as its bytes lie now


class ReadChecks:
    """Checks pages copied into the host pool against their checksums; counts and logs the mismatches."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # the page_checksums setting: off, nothing is hashed or checked
        self._lock = threading.Lock()
        self.mismatches = 0

    def verify(self, tier: str, keys: List[str], found: List[bool], sums: List[int],
               sums_of: SumsOf) -> List[bool]:
        """found, less the pages whose bytes (sums_of(positions): the checksums of what we copied) do not
        match their sum."""
        todo = [i for i, ok in enumerate(found) if ok and sums[i]] if self.enabled else []
        if not todo:
            return found
        bad = [i for i, got in zip(todo, sums_of(todo)) if got != sums[i]]
        if not bad:
            return found
        with self._lock:
            self.mismatches += len(bad)
        _warn.warning(f"checksum:{tier}", "tier %s served %d page(s) whose bytes do not match their checksum "
                                          "(first: %s); read as misses", tier, len(bad), keys[bad[0]])
        out = list(found)
        for i in bad:
            out[i] = False
        return out

    def sums_of(self, pages: Sequence[Sequence]) -> bytes:
        """The encoded sums a write of pages (each the buffers that concatenate to it) carries (empty,
        unknown to every tier, when checksums are off)."""
        from tiers.wire.protocol import encode_sums
        return encode_sums(page_sums(pages)) if self.enabled else b""

    def counters(self) -> dict:
        with self._lock:
            return {"checksum_mismatches": self.mismatches}
