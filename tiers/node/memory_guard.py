"""A bound on the bytes libzmq holds for messages a peer has not finished sending.

libzmq hands the daemon a message only once its last frame has arrived, and
until then keeps every frame it read, with no limit of its own: ZMQ_MAXMSGSIZE
bounds a frame, the high-water marks count whole messages.  A peer that
speaks ZMTP itself (a raw socket, not libzmq, whose sender holds an
unfinished message back) can send frame after frame of one message it never
ends: 2 GiB in under 5 s over the ipc socket, growing the daemon until the
kernel kills it.  Nothing in the daemon ever sees those bytes.

So a thread watches the daemon's anonymous memory (/proc/self/statm: resident
less shared; the arenas are memfds and count as shared) every CHECK_S.  Past
the bound (what it held when it started serving, plus the store's own index
(PageStore.index_bytes), plus max_inflight_bytes and SLACK_BYTES: every
legitimate use) it wakes the loop, which shuts each connection that has not
completed a message for SILENT_S (tiers/node/connections.py ``shut_silent``).
A connection in the middle of an unfinished message completes none, so it is
among them; an engine's connections complete a lookup or a put every few
milliseconds while it works, and one idle that long loses only its
connection (its client reconnects at its next call).  libzmq drops what it
held for a connection it closes; the thread then gives freed memory back to
the system (malloc_trim), or the process would keep it.

Measured (tests/test_hostile_clients.py ``-k never_ended``, a bound of 288 MiB
over the start): three such peers at once were each shut after the daemon
grew 455 MiB (the bound, plus what they sent between two reads of the
memory and the loop's turn), and it was back at its start a second later.
Peers on tcp:// endpoints are watched the same way (a key CurveZMQ admitted
can send such a message too); the test runs on both.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Callable, Optional

from tiers.logs import RateLimitedLog

log = logging.getLogger("hicache.memory")
_warn = RateLimitedLog(log)

CHECK_S = 0.02  # an ipc peer sends ~2-5 GB/s: what the bound can be passed by before the loop hears of it
SILENT_S = 0.25  # a connection shut for memory has completed no message for this long
SLACK_BYTES = 256 << 20  # the Python heap, replies being built, sessions: growth no peer is answerable for
STORE_EVERY_S = 1.0  # how often the store's own index size is asked (it takes the store's lock)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous_bytes(statm_fd: Optional[int] = None) -> int:
    """This process's resident memory that is not shared (memfd arenas and mapped files excluded); statm_fd:
    /proc/self/statm kept open (a flood that takes every descriptor must not blind the watch)."""
    if statm_fd is None:
        with open("/proc/self/statm", "rb") as fh:
            fields = fh.read().split()
    else:
        fields = os.pread(statm_fd, 512, 0).split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def _malloc_trim() -> Callable[[], None]:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc: freed memory stays with the allocator
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class MemoryGuard:
    """Watches the daemon's anonymous memory from a thread of its own; over the bound, the loop sheds."""

    def __init__(self, name: str, max_inflight_bytes: int, store_bytes: Callable[[], int],
                 wake: Callable[[], None]):
        self.name = name
        self.allowance = max_inflight_bytes + SLACK_BYTES
        self._store_bytes = store_bytes  # the store's index in RAM (PageStore.index_bytes)
        self._wake = wake
        self._trim = _malloc_trim()
        self.baseline = 0  # taken by start
        self.over = False  # set by the thread, read and cleared by the loop
        self.shed = 0  # connections shut for memory
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._statm: Optional[int] = None  # /proc/self/statm, opened by start

    def start(self) -> None:
        """Take the baseline now (the daemon is bound and its arena mapped) and start watching."""
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        self.baseline = anonymous_bytes(self._statm)
        self._thread = threading.Thread(target=self._watch, name=f"{self.name}-memory", daemon=True)
        self._thread.start()

    def bound(self, store_bytes: int) -> int:
        return self.baseline + store_bytes + self.allowance

    def _watch(self) -> None:
        store_bytes, asked = 0, 0.0
        while not self._stop.wait(CHECK_S):
            now = time.monotonic()
            if now - asked >= STORE_EVERY_S:
                asked = now
                try:
                    store_bytes = self._store_bytes()
                except Exception:  # a store failing to say must not end the watch
                    log.exception("%s: the store's index size for the memory bound failed", self.name)
            held = anonymous_bytes(self._statm)
            if held > self.bound(store_bytes):
                if not self.over:
                    self.over = True
                    self._wake()
                self._trim()  # what libzmq freed for the connections shut so far goes back to the system

    def shed_with(self, shut_silent: Callable[[float], int]) -> None:
        """On the loop, when over: shut connections silent for SILENT_S (shut_silent(seconds) -> how many)."""
        self.over = False
        count = shut_silent(SILENT_S)
        if count:
            self.shed += count
            _warn.warning("memory", "tier %s shut %d connection(s) that completed no message for %.2f s: the "
                                    "daemon holds %d MiB of anonymous memory, over its bound", self.name, count,
                          SILENT_S, anonymous_bytes(self._statm) >> 20)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._statm is not None and (self._thread is None or not self._thread.is_alive()):
            os.close(self._statm)
            self._statm = None
