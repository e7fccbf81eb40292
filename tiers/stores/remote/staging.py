"""Node-side plumbing of the remote stores: registered memory, staging slots for the rest, counters.

Pages normally lie in the engine's host pool, mapped by the tier daemon and
registered once, so writes start from their own addresses.  Pages that
arrived as ZeroMQ frames (no shared memory) are copied into a registered
staging slot first: one copy on this node, none on the wire.  Reads land in
``Landing`` chunks, and whatever a transfer given up at its deadline may
still touch waits in ``Abandoned`` until the engine reports that it ended.
"""
from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from tiers.shm.buffers import address_of, as_bytes_view, block_extents, scatter_copy
from tiers.stores.base import Buffers, PageTooLarge, StoreIOError, StoreStats, total_size

log = logging.getLogger("hicache.remote.staging")

Extents = List[Tuple[int, int]]


class Registrations:
    """Address ranges registered with an engine (host pool mappings, staging).

    Readers (every transfer) look at an immutable snapshot; writers replace it
    under a lock.  A host pool can be registered in the background: with RDMA,
    pinning tens of GiB takes seconds, longer than the engine waits for the
    region's acknowledgement; until it is done its pages go through staging.
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None]):
        self._register, self._unregister = register, unregister
        self._ranges: Dict[int, int] = {}  # replaced, never mutated: readers need no lock
        self._lock = threading.Lock()
        self._pending: Dict[int, threading.Thread] = {}

    def add(self, view: memoryview, background: bool = False) -> None:
        """Register view with the engine (EngineError on refusal unless in the background: then a log line).
        In the background, once: nothing is done for a view registered, on its way, or refused already (its
        pages keep going through staging; the refusal was logged)."""
        base, size = address_of(view), view.nbytes
        if not background:
            self._register(base, size)
            self._publish(base, size)
            return
        with self._lock:  # checked and claimed in one hold: two puts at once register it once
            if base in self._ranges or base in self._pending:
                return
            thread = threading.Thread(target=self._register_later, args=(base, size), name="register", daemon=True)
            self._pending[base] = thread
        thread.start()

    def _register_later(self, base: int, size: int) -> None:
        try:
            self._register(base, size)
        except Exception as exc:  # pages of this region keep going through staging
            log.warning("cannot register a host pool of %d bytes with the engine: %s; its pages are staged", size, exc)
            return
        self._publish(base, size)
        log.info("host pool of %d bytes registered with the engine", size)

    def _publish(self, base: int, size: int) -> None:
        with self._lock:
            self._ranges = {**self._ranges, base: size}

    def remove(self, view: memoryview) -> None:
        base = address_of(view)
        with self._lock:
            pending = self._pending.pop(base, None)
        if pending is not None:
            pending.join()  # a registration still running ends first, then is undone
        with self._lock:
            ranges = dict(self._ranges)
            known = ranges.pop(base, None) is not None
            self._ranges = ranges
        if known:
            self._unregister(base)

    def covers(self, addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + size for base, size in self._ranges.items())

    def extents(self, views: Sequence[memoryview]) -> Optional[Extents]:
        """(address, length) of the buffers, adjacent ones merged, when all are registered; else None."""
        out: Extents = []
        for view in views:
            addr = address_of(view)
            if not self.covers(addr, view.nbytes):
                return None
            if out and out[-1][0] + out[-1][1] == addr:
                out[-1] = (out[-1][0], out[-1][1] + view.nbytes)
            else:
                out.append((addr, view.nbytes))
        return out


class Staging:
    """Slots of slot_bytes in one registered mapping, handed out one at a time."""

    def __init__(self, registrations: Registrations, slots: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(-1, max(1, slots) * slot_bytes)
        self._view = memoryview(self._map)
        self._registrations = registrations
        registrations.add(self._view)
        self._free: "queue.Queue[int]" = queue.Queue()
        for i in range(max(1, slots)):
            self._free.put(i)

    def take(self, timeout: float) -> int:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise StoreIOError("every staging slot is busy") from None

    def give(self, slot: int) -> None:
        self._free.put(slot)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = slot * self.slot_bytes
        return self._view[start:start + nbytes]

    def free_slots(self) -> int:
        return self._free.qsize()

    @contextmanager
    def source_extents(self, views: Sequence[memoryview], size: int, timeout: float) -> Iterator[Extents]:
        """Addresses to send a page from: its own when registered (a host pool), else a slot holding a copy."""
        local = self._registrations.extents(views)
        if local is not None:
            yield local
            return
        slot = self.take(timeout)
        try:
            staged = self.view(slot, size)
            scatter_copy([staged], views)
            yield [(address_of(staged), size)]
        finally:
            self.give(slot)

    def close(self) -> None:
        self._registrations.remove(self._view)
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a transfer still holds a slot; the process is ending anyway
            pass


class Abandoned:
    """Transfers given up at their deadline, polled until the engine reports each ended; then what waited runs.

    A Transfer Engine transfer cannot be cancelled: one given up may still
    move its bytes later (a thawed or healed peer).  Memory it may write
    (landing chunks) or a lease it may write under stays out of use until
    then.  The engine's status of an id freed once it reports the end (1 or
    -1) must not be asked again: this thread is the only one that asks.
    """

    def __init__(self, status: Callable[[int], int], poll: float = 0.05, warn_after: float = 60.0):
        self._status = status
        self.poll, self.warn_after = poll, warn_after
        self._entries: List[Tuple[float, List[int], Optional[Callable[[], None]]]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._warned = False
        self._thread: Optional[threading.Thread] = None

    def add(self, batches: Sequence[int], then: Optional[Callable[[], None]] = None) -> None:
        """Watch these batch ids; call then() (on the watcher thread) once all have ended."""
        with self._cond:
            self._entries.append((time.monotonic(), list(batches), then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="abandoned-transfers", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._entries)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._entries and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            self._sweep()
            time.sleep(self.poll)

    def _sweep(self) -> None:
        """Ask after every watched transfer once, and run what waited on those that ended.  A call of its own:
        nothing of an ended entry (its then(), and what that keeps alive: a write's views of a host pool, so
        the mapping) outlives it on this thread's stack while the thread waits for the next."""
        with self._cond:
            # A copy: the entries stay listed (pending() counts them) while their state is asked.
            entries = list(self._entries)
        ended, still = [], {}
        now = time.monotonic()
        for entry in entries:
            since, batches, then = entry
            live = [b for b in batches if self._status(b) not in (1, -1)]  # 0 running, -2 timed out: not over
            if not live:
                ended.append(entry)
                continue
            if now - since > self.warn_after and not self._warned:
                self._warned = True
                log.warning("a transfer given up %.0f s ago has not ended (a frozen or partitioned peer?): "
                            "the memory or lease it may still write stays out of use", now - since)
            still[id(entry)] = (since, live, then)  # an ended id is freed: never asked again
        gone = {id(entry) for entry in ended}
        with self._cond:  # entries added meanwhile are kept as they are
            self._entries = [still.get(id(entry), entry) for entry in self._entries if id(entry) not in gone]
        for _since, _batches, then in ended:
            if then is not None:
                try:
                    then()
                except Exception:  # a release to a pool that is down: its lease ends by itself
                    log.debug("after an abandoned transfer ended", exc_info=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class Landing:
    """Registered memory that reads land in before their bytes reach the host pool.

    A transfer cannot be cancelled: one given up at its deadline may still
    complete later.  Landing here instead of in the engine's host pool means
    a late completion writes only here; the chunks it may still write are
    held (``hold``) until the engine reports the transfer ended, so they are
    not handed to the next read either.  A page takes ceil(size / chunk)
    chunks, not necessarily adjacent (a transfer is cut at their edges).
    """

    def __init__(self, registrations: Registrations, nbytes: int, chunk: int, abandoned: Abandoned):
        self.chunk = chunk
        self.n_chunks = max(1, nbytes // chunk)
        self._map = mmap.mmap(-1, self.n_chunks * chunk)
        self._view = memoryview(self._map)
        self._base = address_of(self._view)
        self._registrations = registrations
        registrations.add(self._view)
        self._abandoned = abandoned
        self._free = deque(range(self.n_chunks))  # first freed first taken: ascending runs (BlockArena's reason)
        self._held = 0
        self._cond = threading.Condition()

    def chunks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk)

    def take(self, nbytes: int, timeout: float) -> Optional[List[int]]:
        """Chunks for nbytes, waiting up to timeout for them; None when they do not come (or never fit)."""
        needed = self.chunks_for(nbytes)
        if needed > self.n_chunks:
            return None
        end = time.monotonic() + timeout
        with self._cond:
            while len(self._free) < needed:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            take = self._free.popleft
            return [take() for _ in range(needed)]

    def extents(self, chunks: Sequence[int], nbytes: int) -> Extents:
        """(address, length) runs the first nbytes of these chunks cover, adjacent ones merged."""
        return [(self._base + off, n) for off, n in block_extents(chunks, self.chunk, nbytes)]

    def views(self, chunks: Sequence[int], nbytes: int) -> List[memoryview]:
        return [self._view[a - self._base:a - self._base + n] for a, n in self.extents(chunks, nbytes)]

    def give(self, chunks: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(chunks)
            self._cond.notify_all()

    def hold(self, chunks: Sequence[int], batches: Sequence[int]) -> None:
        """Keep chunks out of use until every one of these abandoned transfers has ended."""
        chunks = list(chunks)
        with self._cond:
            self._held += len(chunks)

        def ended() -> None:
            with self._cond:
                self._held -= len(chunks)
            self.give(chunks)
        self._abandoned.add(batches, ended)

    def held_chunks(self) -> int:
        with self._cond:
            return self._held

    def free_chunks(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        with self._cond:
            if self._held:  # a late completion may still write here: leave the memory mapped and registered
                return
        self._registrations.remove(self._view)
        try:
            self._view.release()
            self._map.close()
        except BufferError:
            pass


class Counters:
    """A node-side remote store's hit, miss and byte counters (the pools keep sizes and evictions)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = StoreStats()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def snapshot(self, **extra: float) -> StoreStats:
        with self._lock:
            snap = StoreStats(**{k: v for k, v in self._stats.__dict__.items() if k != "extra"})
        snap.extra = dict(extra)
        return snap


def page_views(buffers: Buffers, max_page_bytes: int) -> Tuple[List[memoryview], int]:
    """A page's non-empty byte views and its size; PageTooLarge when empty or over max_page_bytes."""
    views = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
    size = total_size(views)
    if size == 0 or size > max_page_bytes:
        raise PageTooLarge(f"page of {size} bytes not accepted (max {max_page_bytes})")
    return views, size
