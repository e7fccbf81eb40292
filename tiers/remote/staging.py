"""Node-side plumbing of the remote stores: registered memory, staging slots for the rest, counters.

Pages normally lie in the engine's host pool, mapped by the tier daemon and
registered once, so transfers start from their own addresses.  Pages that
arrived as ZeroMQ frames (no shared memory) are copied into a registered
staging slot first: one copy on this node, none on the wire.
"""
from __future__ import annotations

import mmap
import queue
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tiers.remote.engine import address_of
from tiers.store import StoreIOError, StoreStats

Extents = List[Tuple[int, int]]


class Registrations:
    """Address ranges registered with an engine (host pool mappings, staging)."""

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None]):
        self._register, self._unregister = register, unregister
        self._ranges: Dict[int, int] = {}

    def add(self, view: memoryview) -> None:
        base = address_of(view)
        self._register(base, view.nbytes)
        self._ranges[base] = view.nbytes

    def remove(self, view: memoryview) -> None:
        base = address_of(view)
        if self._ranges.pop(base, None) is not None:
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
