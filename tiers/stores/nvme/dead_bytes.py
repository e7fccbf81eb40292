"""Bytes on the NVMe tier's disk that no index entry holds, counted beside the index's (tiers/stores/nvme/ledger.py).

Dead batch files kept to be written over (tiers/stores/nvme/recycle.py), and
the files and records of a delete or clear on their way off the disk
(Ledger.pop_many): the disk holds them, so the ledger's room counts them.  A
reservation gives kept files up (``spares``) before it evicts a live page, and
waits for removals under way (``wait_locked``) before it takes room they still
hold.  The methods ending in ``_locked`` run holding the ledger's lock; the
others take it.
"""
from __future__ import annotations

import threading
from typing import Optional

from tiers.stores.nvme.entry import SpareFiles


class DeadBytes:
    def __init__(self, lock: threading.Lock):
        self.count = 0
        self.spares: Optional[SpareFiles] = None  # the kept files, given up for room
        self._freed = threading.Condition(lock)  # a reservation waiting for a delete's removals

    def give_up_locked(self, nbytes: int) -> int:
        """Kept files given up for nbytes at least (removed by the reserving writer's discard before it writes);
        the bytes given up, no longer counted."""
        freed = 0
        while freed < nbytes and self.spares is not None and self.count:
            given_up = self.spares.give_up_locked()
            if not given_up:
                break
            self.count -= given_up
            freed += given_up
        return freed

    def give_up(self, nbytes: int) -> int:
        """give_up_locked, taking the lock (the device is full below our count: another user of the disk
        filled it)."""
        with self._freed:
            return self.give_up_locked(nbytes)

    def take_spare_locked(self, spare: int, nbytes: int) -> int:
        """A reservation of nbytes takes over what it can of spare bytes of a kept file it writes over (counted
        here until now); the spare bytes left."""
        taken = min(spare, nbytes)
        self.count -= taken
        return spare - taken

    def free(self, nbytes: int) -> None:
        """Dead bytes no longer on disk (removed, punched) or no longer dead (a batch written over them)."""
        with self._freed:
            self.count -= nbytes
            self._freed.notify_all()

    def wait_locked(self, timeout: float) -> None:
        """Let go of the lock until some dead bytes are freed, timeout seconds at most."""
        self._freed.wait(timeout)
