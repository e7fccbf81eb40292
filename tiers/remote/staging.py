"""Node-side plumbing of the remote stores: registered memory, staging slots for the rest, counters.

Pages normally lie in the engine's host pool, mapped by the tier daemon and
registered once, so transfers start from their own addresses.  Pages that
arrived as ZeroMQ frames (no shared memory) are copied into a registered
staging slot first: one copy on this node, none on the wire.
"""
from __future__ import annotations

import logging
import mmap
import queue
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from tiers.buffers import as_bytes_view, scatter_copy
from tiers.remote.engine import address_of
from tiers.store import Buffers, PageTooLarge, StoreIOError, StoreStats, total_size

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
        """Register view with the engine (EngineError on refusal unless in the background: then a log line)."""
        base, size = address_of(view), view.nbytes
        if not background:
            self._register(base, size)
            self._publish(base, size)
            return
        thread = threading.Thread(target=self._register_later, args=(base, size), name="register", daemon=True)
        with self._lock:
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

    def close(self) -> None:
        self._registrations.remove(self._view)
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a transfer still holds a slot; the process is ending anyway
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


class HostPoolStore:
    """Mixin of the node-side remote stores: host-pool mappings, and where a page's bytes leave from.

    The subclass sets ``_registrations`` and ``_staging``.
    """

    _registrations: Registrations
    _staging: Staging

    def region_mapped(self, view: memoryview) -> None:
        """Register a host-pool mapping with the engine (the tier daemon calls this when it maps one)."""
        self._registrations.add(view, background=True)

    def region_unmapped(self, view: memoryview) -> None:
        self._registrations.remove(view)

    @contextmanager
    def source_extents(self, views: Sequence[memoryview], size: int, timeout: float) -> Iterator[Extents]:
        """Addresses to send a page from: its own when registered, else a staging slot holding a copy."""
        local = self._registrations.extents(views)
        if local is not None:
            yield local
            return
        slot = self._staging.take(timeout)
        try:
            staged = self._staging.view(slot, size)
            scatter_copy([staged], views)
            yield [(address_of(staged), size)]
        finally:
            self._staging.give(slot)
