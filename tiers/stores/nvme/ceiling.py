"""How many bytes of chunks the NVMe tier's directory may hold, as a restart after a crash will assume.

After a crash the index is rebuilt by a scan while the store already serves
(tiers/stores/nvme/rebuild.py), and until the scan ends the ledger cannot
count the chunks it has not reached.  Writes made meanwhile would then take
the disk past ``capacity`` (on a node whose tier fills its disk: a full
disk for every tenant on it).  So the store keeps a ceiling on disk: a
small checksummed file, ``usage.ceiling``, saying the chunks on disk add up
to at most so many bytes.  It is raised, durably, before a write would take
the bytes held and reserved past it (a step of capacity / 32 at a time, 256 MiB
at least: a few dozen small fsyncs to fill a tier), and brought down to what
is held at a clean close, once a rebuild has counted everything, and after a
clear that left it two steps above.  A restart after a crash
then treats ``ceiling - bytes scanned so far`` as held by chunks it has not
reached, and admits a write only with room for it beside them.

Without the file (a directory from before it, or a file that does not
check) the ceiling is taken as the capacity: safe, and the scan's writes
then evict scanned chunks to make room, or wait for the scan.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from typing import Optional

from tiers.stores.nvme import chunkfile as cf

log = logging.getLogger("hicache.nvme")

NAME = "usage.ceiling"
MAGIC = b"HCNVCEIL"
_FORMAT = struct.Struct("<8sQI")  # magic, bytes, crc32 of the two before
STEPS = 32  # a raise goes this fraction of the capacity past what is needed...
# ...and at least this far: each raise is a file written and two fsyncs (1-3 ms here) on a writer's way, and
# a tier a few batches fill (a bench's, cleared between repetitions) would pay one a batch.  Below 8 GiB the
# ceiling is therefore coarser than capacity / 32, and a tier under 256 MiB keeps it at its capacity: a
# restart after a crash takes it as full until its scan (short, at that size) has counted its chunks.
MIN_STEP_BYTES = 256 << 20


class UsageCeiling:
    """The persisted bound on the bytes of chunks in root (root None: kept in memory only, as capacity)."""

    def __init__(self, root: Optional[str], capacity: int):
        self.path = os.path.join(root, NAME) if root is not None else None
        self.capacity = capacity
        self.step = max(1, capacity // STEPS, min(capacity, MIN_STEP_BYTES))
        self.value = capacity  # until loaded or set: nothing lower is known to hold
        self.failed = 0  # raises that could not be written (the tier then evicts below the last one written)
        self._lock = threading.Lock()

    def load(self) -> Optional[int]:
        """The bound the last run left, or None (no file, or one that does not check)."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as f:
                data = f.read(_FORMAT.size + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("usage ceiling %s unreadable (%s): the restart assumes a full tier", self.path, exc)
            return None
        if len(data) != _FORMAT.size:
            return None
        magic, value, crc = _FORMAT.unpack(data)
        if magic != MAGIC or crc != zlib.crc32(data[:-4]):
            log.warning("usage ceiling %s does not check: the restart assumes a full tier", self.path)
            return None
        self.value = value
        return value

    def ensure(self, needed: int) -> bool:
        """Raise the ceiling, durably, to needed bytes and a step past them (at most the capacity: beyond it
        the ledger evicts) before they are written; False when it could not be written.  A call that finds
        it high enough costs one compare."""
        if needed <= self.value or self.value >= self.capacity:
            return True
        with self._lock:
            if needed <= self.value or self.value >= self.capacity:
                return True
            value = min(self.capacity, needed + self.step)
            if not self._write(value):
                return False
            self.value = value  # only once on disk: until then writes are held below the old value
            return True

    def lower(self, held: int, slack_steps: int = 0) -> bool:
        """What is held now is counted exactly (called under the ledger's lock, so no write is reserved
        meanwhile): the ceiling comes down to a step above it, in memory at once (writes are held below it
        from now on) and on disk at the next persist(); only when it is slack_steps steps or more above
        that.  True when it came down."""
        target = min(max(self.capacity, held), held + self.step)
        if target + slack_steps * self.step > self.value or target >= self.value:
            return False
        self.value = target
        return True

    def persist(self) -> None:
        """Write the value lowered in memory (the file keeps the old, higher one meanwhile: still a bound)."""
        with self._lock:
            self._write(self.value)

    def _write(self, value: int) -> bool:
        if self.path is None:
            return True
        tmp = self.path + ".tmp"
        body = _FORMAT.pack(MAGIC, value, 0)[:-4]
        try:
            cf.unlink_quietly(tmp)  # one a crash left behind
            cf.write_file(tmp, [memoryview(body + struct.pack("<I", zlib.crc32(body)))], fsync=True, direct=False)
            os.replace(tmp, self.path)
            cf.fsync_dir(os.path.dirname(self.path))
        except OSError as exc:
            # Not raised: the ledger keeps the tier below the value last written (it evicts instead of growing).
            cf.unlink_quietly(tmp)
            self.failed += 1
            log.warning("usage ceiling %s not written (%s); the tier stays within %d bytes", self.path, exc,
                        self.value)
            return False
        return True
