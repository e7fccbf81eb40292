"""What a read can skip, and what it may leave for later.

LookupHints: SGLang looks a prefix up (``batch_exists``) and, moments later,
reads a run of the keys it found (``batch_get``, often in chunks).  The
lookup already asked every tier; the read asks each tier only for the keys
it said it holds, all tiers at once, instead of asking the top tier for
every page and walking down with the misses.  Remembering costs the lookup
nothing per key: the last few answers are kept whole (keys and per-tier
flags) and a read finds its keys in them with C-level list operations.

Promoter: a page a lower tier served is copied into the top tier after the
read returned.  Its bytes are copied out of the engine's host memory first
(the engine may reuse those slots the moment the read returns), within a
bound; past the bound a promotion is dropped and counted, never waited for.
The put itself waits until no engine call is in flight and delay_s passed:
on the real server a put started beside the read it follows took the GIL
and the CPU from SGLang's prefetch thread and added 7-8 ms to a 32-page
NVMe read (docs/PERFORMANCE.md); a promotion is worth nothing to the request that
caused it, so it goes last.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Deque, List, Optional, Sequence, Tuple

log = logging.getLogger("hicache.backend")

UNKNOWN = 255  # no tier is known to hold the key: the read walks the chain
PROMOTE_DELAY_S = 0.02  # a promotion's put starts this long after its read returned, at the soonest
PROMOTE_MAX_WAIT_S = 1.0  # and waits at most this long more for the engine's calls to end
QUIET_POLL_S = 0.002


class LookupHints:
    """The fastest tier holding each key of the last few lookups, for reads that follow within ttl seconds."""

    def __init__(self, tiers: int, keep: int = 16, ttl: float = 5.0):
        if tiers >= UNKNOWN:
            raise ValueError("too many tiers for a one-byte hint")
        self.ttl = ttl
        self._answers: Deque[Tuple[float, List[str], bytes]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def remember(self, keys: List[str], fastest: bytes) -> None:
        """One lookup's answer: the fastest tier holding each key (``fastest_tiers``)."""
        with self._lock:
            self._answers.append((time.monotonic() + self.ttl, keys, fastest))

    def plan(self, keys: List[str]) -> Optional[bytes]:
        """The fastest tier of each key (UNKNOWN where not known), or None when no recent lookup covers them."""
        if not keys:
            return None
        now = time.monotonic()
        with self._lock:
            answers = list(self._answers)
        for expires, looked_up, fastest in reversed(answers):  # the newest answer first
            if expires < now:
                continue
            try:
                start = looked_up.index(keys[0])
            except ValueError:
                continue
            if looked_up[start:start + len(keys)] == keys:
                return fastest[start:start + len(keys)]
        return None


def fastest_tiers(per_tier: Sequence[Optional[bytes]], n: int) -> bytes:
    """The fastest tier holding each of n keys (UNKNOWN where none), from each tier's held flags."""
    fastest = bytearray(bytes([UNKNOWN]) * n)
    # Bottom tier first, so a faster tier holding a key overwrites a slower one (C-level passes a tier).
    for tier in range(len(per_tier) - 1, -1, -1):
        flags = per_tier[tier]
        if flags is None:
            continue
        mark = bytes([tier])
        for begin, end in _runs_of_ones(flags):
            fastest[begin:end] = mark * (end - begin)
    return bytes(fastest)


def _runs_of_ones(flags: bytes):
    """(begin, end) of each run of 1 bytes, found with bytes.find (no Python step a key)."""
    n, pos = len(flags), 0
    while pos < n:
        begin = flags.find(1, pos)
        if begin < 0:
            return
        end = flags.find(0, begin)
        end = n if end < 0 else end
        yield begin, end
        pos = end


class Promoter:
    """Copies of pages a lower tier served, put into the top tier on a thread of their own, bounded.

    ``submit(keys, pages, put)`` copies the pages now (the caller's memory
    may be reused once it returns) and runs ``put(keys, copies)`` later; a
    batch that would take the bytes in flight past ``max_bytes`` is dropped.
    """

    def __init__(self, max_bytes: int = 256 << 20, delay_s: float = PROMOTE_DELAY_S,
                 max_wait_s: float = PROMOTE_MAX_WAIT_S):
        self.max_bytes = max_bytes
        self.delay_s = delay_s  # a put starts no sooner than this after its read returned
        self.max_wait_s = max_wait_s  # ... and waits at most this long for the engine's calls to end
        self._lock = threading.Lock()
        self._calls = EngineCalls()  # engine calls (lookups, reads) in flight: puts wait for none
        self._in_flight = 0
        self.queued = self.done = self.dropped = self.failed = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-promote")
        self._closed = False

    def submit(self, keys: List[str], pages: Sequence[Sequence[memoryview]],
               put: Callable[[List[str], List[List[bytes]]], List[bool]]) -> bool:
        """Copy pages now; put(keys, copies) later."""
        nbytes = sum(v.nbytes for page in pages for v in page)
        if not self._admit(len(keys), nbytes):
            return False
        copies = [[bytes(v) for v in page] for page in pages]  # before the engine can reuse its slots
        self._thread.submit(self._run, keys, lambda: put(keys, copies), nbytes, time.monotonic() + self.delay_s)
        return True

    def submit_checked(self, keys: List[str], nbytes: int, put: Callable[[], List[bool]]) -> bool:
        """put() later, copying nothing now: the top tier copies the pages out of the engine's host pool
        itself and keeps only those still matching their checksums (a checked put: the engine may have
        reused a slot in between). One copy, made by the daemon, none on the engine's read path."""
        if not self._admit(len(keys), nbytes):
            return False
        self._thread.submit(self._run, keys, put, nbytes, time.monotonic() + self.delay_s)
        return True

    def _admit(self, pages: int, nbytes: int) -> bool:
        with self._lock:
            if self._closed or self._in_flight + nbytes > self.max_bytes:
                self.dropped += pages
                return False
            self._in_flight += nbytes
            self.queued += pages
        return True

    def engine_call(self) -> EngineCalls:
        """Around an engine call a promotion must not compete with (the router's lookups and reads)."""
        return self._calls

    def _wait_for_quiet(self, due: float) -> None:
        """Until due, then until no engine call is in flight (at most max_wait_s past due)."""
        time.sleep(max(0.0, due - time.monotonic()))
        give_up = time.monotonic() + self.max_wait_s
        while self._calls.in_flight and not self._closed and time.monotonic() < give_up:
            time.sleep(QUIET_POLL_S)

    def _run(self, keys, put: Callable[[], List[bool]], nbytes: int, due: float) -> None:
        self._wait_for_quiet(due)
        try:
            stored = sum(put())
        except Exception:  # a promotion is an optimisation: it must never take the engine down
            log.debug("promotion failed", exc_info=True)
            stored = 0
        with self._lock:
            self._in_flight -= nbytes
            self.done += stored
            self.failed += len(keys) - stored

    def counters(self) -> dict:
        with self._lock:
            return {"promotions_queued": self.queued, "promotions_done": self.done,
                    "promotions_dropped": self.dropped, "promotions_failed": self.failed,
                    "promotion_bytes_in_flight": self._in_flight}

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued promotion ended (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if self._in_flight == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._thread.shutdown(wait=True)


class EngineCalls:
    """The engine calls (lookups, reads) in flight, counted by a ``with`` around each.  A class, not a
    generator context manager: it is on every lookup and read, and the generator cost 1.5 us more a call."""

    __slots__ = ("_lock", "in_flight")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0

    def __enter__(self) -> None:
        with self._lock:
            self.in_flight += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.in_flight -= 1
