"""A client's reads through its tier's page directory: hits copied with no round trip to the daemon.

The DRAM daemon hands engines, with its arena, a page directory that says
where each page lies (tiers/shm/directory.py).  An engine finds its pages
there, copies them out of the arena itself and checks afterwards that no
page changed hands during the copy; whatever it did not find or could not
keep is asked of the daemon as before, so a directory that is stale, racing
an eviction, or unusable costs a round trip, never a wrong page.  The daemon
learns of those reads after they returned (``touch``, not waited for), so its
eviction order and read counts stay as if it had served them.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Deque, List, Optional, Sequence, Tuple

from tiers.shm.page_runs import PageRuns
from tiers.wire import protocol as P
from tiers.wire.arena_map import ArenaMap

Found = Tuple[List[bool], List[int], List[int]]  # a flag a page, each page's checksum, each copy's own sum


def read_direct(arena: ArenaMap, namespace: str, namespace_id: int, keys: Sequence[str], dst: PageRuns,
                summed: bool) -> Found:
    """The pages of keys found in arena's directory under namespace_id, copied into dst (see DirectoryView.read);
    nothing found where the pages differ in size (a batch of one host pool never does)."""
    n = len(keys)
    sizes = dst.sizes()
    if not n or not namespace_id or arena.directory is None or min(sizes) != max(sizes):
        return [False] * n, [0] * n, []
    return arena.read_direct(namespace_id, P.pack_key_digests(namespace, keys), sizes[0], dst, summed)


# A direct read's touch waits this long for a request of the engine's own to carry it (one that does not
# wait then goes on a message of its own): carried, it reaches the daemon before anything the engine asks
# after the read, as a leased read's count would have.
TOUCH_DELAY_S = 0.1
# Touches waiting at most (batches of a read); past it the oldest are dropped: the daemon then misses that
# recency, never a page.
MAX_QUEUED = 256
IDLE_LOOKS = 20  # the touch thread looks every TOUCH_DELAY_S while reads come, then sleeps until one does


class Toucher:
    """The pages a client read through its tier's directory, until a request carries them (``take``) or,
    TOUCH_DELAY_S after the oldest, the touch thread sends them alone: a read never waits for a socket."""

    def __init__(self, name: str, send: Callable[[dict], None]):
        self._name, self._send = name, send
        self._queue: Deque[Tuple[float, List[str], int]] = deque(maxlen=MAX_QUEUED)
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._asleep = False  # waiting without a timeout: a touch must wake it
        self._closed = False

    def touch(self, keys: List[str], size: int) -> None:
        with self._wake:
            if self._closed:
                return
            now = time.monotonic()
            for at in range(0, len(keys), P.MAX_BATCH):  # a request carries MAX_BATCH keys at most
                self._queue.append((now, keys[at:at + P.MAX_BATCH], size))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"touch-{self._name}", daemon=True)
                self._thread.start()
            elif self._asleep:  # else it looks again within TOUCH_DELAY_S: no wake-up on the read's way
                self._wake.notify()

    def take(self, fields: dict) -> None:
        """Move the pending touches (up to MAX_BATCH pages) into a request's fields."""
        if not self._queue:  # the common case, without the lock
            return
        keys: List[str] = []
        sizes: List[int] = []
        with self._wake:
            while self._queue and len(keys) + len(self._queue[0][1]) <= P.MAX_BATCH:
                _at, batch, size = self._queue.popleft()
                keys += batch
                sizes += [size] * len(batch)
        if keys:
            fields["touched"], fields["touched_sizes"] = keys, P.encode_sizes(sizes)

    def _run(self) -> None:
        idle = 0  # looks that found nothing to send; past IDLE_LOOKS the thread sleeps until a touch
        while True:
            with self._wake:
                if self._closed:
                    return
                now = time.monotonic()
                if not self._queue:
                    idle += 1
                    self._asleep = idle > IDLE_LOOKS
                    self._wake.wait(None if self._asleep else TOUCH_DELAY_S)
                    self._asleep = False
                    continue
                idle = 0
                if now < self._queue[0][0] + TOUCH_DELAY_S:  # a request of the engine may carry it yet
                    self._wake.wait(self._queue[0][0] + TOUCH_DELAY_S - now)
                    continue
            fields: dict = {}
            self.take(fields)
            if fields:
                try:
                    self._send(fields)
                except Exception:  # a touch lost is recency lost, never a reason to stop sending
                    pass

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
