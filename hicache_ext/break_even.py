"""Hits that pay: report a stored page as a hit only when reading it beats recomputing it.

Users see TTFT rise as the L3 hit rate rises when a tier is slow (sglang
#33984, #36179): SGLang prefetches every page the backend says it has, and a
page read from a slow disk or a congested link costs more than the prefill it
replaces.  So the backend keeps, for each tier, the read speed it measures on
its own reads (bytes over the wall time of each get, an exponentially
weighted average, kept current), and cuts a lookup's leading run where the
savings stop growing:

    savings(k) = sum over the first k pages of (recompute_i - read_i)

with read_i = page bytes / the measured speed of the fastest tier holding
page i, and recompute_i the prefill time of the page's tokens at its context
position (a token at position n costs ``recompute_us_per_token +
recompute_growth_us_per_ki_token * n / 1024`` microseconds: attention grows
with the context; ``hicache-tiers bench --only ttft`` measures both on the
serving machine).  The hit is the k that maximises savings(k), 0 when no
prefix pays.

A tier whose speed is unknown or older than ``stale_s`` is taken as free, so
its next read measures it again: a tier that recovered is used again, and a
slow one costs at most one slow read per ``stale_s``.  With
``recompute_us_per_token`` 0 (the default) every held page is a hit, as
before.
"""
from __future__ import annotations

import threading
import time
from typing import List

import numpy as np

UNKNOWN_TIER = 255  # as read_plan.UNKNOWN: no tier is known to hold the page


class ReadSpeeds:
    """Each tier's measured read speed, averaged over its recent reads.

    The average is of seconds a byte (what a read costs), not of bytes a
    second: one stalled read among fast ones must weigh as the time it took.
    """

    def __init__(self, tiers: int, weight: float = 0.3, stale_s: float = 30.0):
        self.weight = weight
        self.stale_s = stale_s
        self._cost = [0.0] * tiers  # seconds a byte
        self._when = [float("-inf")] * tiers
        self._lock = threading.Lock()

    def observe(self, tier: int, nbytes: int, seconds: float) -> None:
        """One read of nbytes that took seconds (pages found only)."""
        if nbytes <= 0 or seconds <= 0:
            return
        sample = seconds / nbytes
        now = time.monotonic()
        with self._lock:
            current = self._cost[tier]
            fresh = now - self._when[tier] <= self.stale_s
            self._cost[tier] = current + self.weight * (sample - current) if fresh and current else sample
            self._when[tier] = now

    def current(self) -> List[float]:
        """Bytes a second of each tier; 0 where unknown or stale (taken as free: the next read measures)."""
        now = time.monotonic()
        with self._lock:
            return [1.0 / c if c and now - w <= self.stale_s else 0.0 for c, w in zip(self._cost, self._when)]


class BreakEven:
    """How many leading pages of a lookup are worth reading instead of recomputing."""

    def __init__(self, speeds: ReadSpeeds, recompute_us_per_token: float,
                 recompute_growth_us_per_ki_token: float = 0.0):
        self.speeds = speeds
        self.base_s = recompute_us_per_token * 1e-6
        self.growth_s = recompute_growth_us_per_ki_token * 1e-6 / 1024

    @property
    def enabled(self) -> bool:
        return self.base_s > 0 or self.growth_s > 0

    def paying_pages(self, fastest: bytes, held: int, page_bytes: float, page_tokens: float,
                     first_token: int = 0) -> int:
        """Of the first held pages (fastest[i]: the fastest tier holding page i), how many to report."""
        if not self.enabled or held == 0:
            return held
        speed = np.zeros(UNKNOWN_TIER + 1)
        current = self.speeds.current()
        speed[:len(current)] = current
        rate = speed[np.frombuffer(fastest, dtype=np.uint8, count=held)]
        read = np.divide(float(page_bytes), rate, out=np.zeros(held), where=rate > 0)
        # Page i's tokens start at first_token + i * page_tokens; its marginal cost is the cost at its middle.
        middle = first_token + (np.arange(held) + 0.5) * page_tokens
        recompute = page_tokens * (self.base_s + self.growth_s * middle)
        savings = np.cumsum(recompute - read)
        best = int(np.argmax(savings))
        return best + 1 if savings[best] > 0 else 0


def first_token_of(prefix_keys, page_tokens: int) -> int:
    """The context position of a lookup's first page: SGLang passes the keys before it (prefix_keys)."""
    return len(prefix_keys or ()) * page_tokens
