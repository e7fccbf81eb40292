"""The engine's mapping of a daemon's arena (tiers/wire/arena_map.py): how it goes away.

Real memfds, real mappings: the last unmap of a dead daemon's arena frees its memory (0.57 s for 2 GiB
here), so it must never run on the thread that closed the mapping (the prober re-attaching under the
client's lock, or a read).
"""
from __future__ import annotations

import mmap
import os
import threading

from tiers.wire.arena_map import ArenaMap


class _WatchedMap(mmap.mmap):
    """A mapping that records which thread unmapped it."""

    def close(self):
        self.closed_by = threading.current_thread()
        self.unmapped.set()
        super().close()


def _arena(size: int = 1 << 20) -> _WatchedMap:
    fd = os.memfd_create("arena")
    try:
        os.ftruncate(fd, size)
        mapping = _WatchedMap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    mapping.unmapped = threading.Event()
    return mapping


def test_closing_an_arena_unmaps_it_off_the_closing_thread():
    mapping = _arena()
    arena = ArenaMap(7, mapping)
    arena.close()
    assert mapping.unmapped.wait(10)
    assert mapping.closed_by is not threading.current_thread() and mapping.closed_by.name == "arena-unmap"
    assert not arena.use()  # closed: no copy starts on it


def test_an_arena_in_use_is_unmapped_when_its_last_copy_is_done_and_not_by_that_copys_thread():
    mapping = _arena()
    arena = ArenaMap(8, mapping)
    assert arena.use()  # a copy out of it is under way
    arena.close()
    assert not mapping.unmapped.wait(0.2)  # never under a copy
    arena.done()
    assert mapping.unmapped.wait(10)
    assert mapping.closed_by is not threading.current_thread() and mapping.closed_by.name == "arena-unmap"
