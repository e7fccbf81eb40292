"""Batch chunk files whose every page left, kept to be written over by the next batch of their size.

A full tier evicts for every put, and a put of a whole batch usually frees a
whole older batch file (LRU and FIFO evict the oldest pages, which lie
together).  Removing that file and creating the new one costs the put twice
on the file system: the old file's blocks are freed (with ``discard`` mounts,
trimmed) in the journal commit the new file's flush waits for, and the new
file's blocks are allocated and its name made durable by a directory fsync.
Writing the next batch over the dead file, under the dead file's own name
(durable since its first put), with its blocks already allocated and written,
leaves the flush only the data: on the development disk an 8 MiB file written
over in place took 2.4 ms, a new one 4.3 ms, and 4.3 + 2.4 (the old one's
removal) in a full tier (docs/PERFORMANCE.md, session 41).  RocksDB recycles
its log files for the same reason.

The kept files take at most ``limit`` bytes, which the tier keeps out of its
index's capacity (tiers/stores/nvme/store.py), so the disk never holds more
than the capacity.  A kept file's first record header is zeroed when it is
kept (one 4 KiB write): a restart after a crash walks it, finds no record at
its start and removes it, as it removes a file a crash cut short, so a page
evicted or deleted is not found again.  A clean stop removes the kept files.
Nothing is kept while the index is rebuilt (a scan must not meet a kept file
that a put is about to write over).

A batch written over a kept file lays its records from the start and writes
every block up to its own size, which is the file's size (only a file of
exactly that size is taken): a finished file holds nothing of the old one.  A
crash during the write can leave old records after the new ones, each
verified by its header and payload checksums before it is served, as any
record is.  A reader that opened the old file before it was written over reads
bytes that no longer match the record it looked up: a miss, never a wrong
page.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, List, Optional, Tuple

from tiers.stores.nvme import batch, chunkfile as cf

RECYCLE_BYTES = 128 << 20  # the default limit: two batch files of the largest size (batch_writes.BATCH_FILE_BYTES)
_ZEROS = batch.aligned_block()  # a header no walk takes for a record


class RecycledFiles:
    """Dead batch files by size, up to limit bytes, kept under their own names."""

    def __init__(self, limit: int, ready: Callable[[], bool] = lambda: True):
        self.limit = max(0, limit)
        self._ready = ready  # false while the index is rebuilt
        self._by_size: Dict[int, List[Tuple[int, str]]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.kept = 0  # dead files kept instead of removed
        self.reused = 0  # batches written over a kept file

    @property
    def nbytes(self) -> int:
        return self._bytes

    def offer(self, path: str) -> bool:
        """Keep the dead batch file at path, its first header zeroed, when it fits the limit; False: the caller
        removes it."""
        file_id = batch.parse_name(os.path.basename(path))
        if not self.limit or file_id is None or not self._ready():
            return False
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        with self._lock:
            if not size or self._bytes + size > self.limit:
                return False
            self._bytes += size  # claimed before the write below, so two offers never pass the limit together
        try:
            _zero_first_header(path)
        except OSError:
            with self._lock:
                self._bytes -= size
            return False
        with self._lock:
            self._by_size.setdefault(size, []).append((file_id, path))
            self.kept += 1
        return True

    def take(self, size: int) -> Optional[Tuple[int, str]]:
        """A kept file of exactly size bytes for a batch to be written over: (its file id, its path), no longer
        kept; None when there is none."""
        with self._lock:
            files = self._by_size.get(size)
            if not files:
                return None
            got = files.pop()
            if not files:
                del self._by_size[size]
            self._bytes -= size
            self.reused += 1
            return got

    def drain(self) -> int:
        """Remove every kept file (a clean stop: the next start's index would not know them); how many."""
        with self._lock:
            files = [path for kept in self._by_size.values() for _id, path in kept]
            self._by_size.clear()
            self._bytes = 0
        return sum(cf.unlink_quietly(path) for path in files)


def _zero_first_header(path: str) -> None:
    """Zero the first 4 KiB of path on the device (O_DIRECT where the file system takes it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | cf.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, _ZEROS, 0)
    finally:
        os.close(fd)
