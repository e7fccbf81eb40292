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

Records evicted from a file that still holds live pages are left in place
too (not punched) while the same budget allows, so that file is whole when
its last page goes and a batch is written over it with no block allocated
again; a clean stop punches them.  After a crash the restart walks them as
the pages they were, whole and checked.

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
        # Records evicted from files that still hold live ones, left in place (not punched) while the budget
        # allows, so the file is whole when its last page goes: path -> (first block, blocks) ranges.
        self._deferred: Dict[str, List[Tuple[int, int]]] = {}
        self._deferred_bytes = 0
        self._lock = threading.Lock()
        self.kept = 0  # dead files kept instead of removed
        self.reused = 0  # batches written over a kept file

    @property
    def nbytes(self) -> int:
        """Bytes of kept files and of dead records left in place."""
        return self._bytes + self._deferred_bytes

    def deferred(self, path: str) -> List[Tuple[int, int]]:
        """The dead records left in place in the file at path."""
        with self._lock:
            return list(self._deferred.get(path, ()))

    def defer(self, path: str, ranges: List[Tuple[int, int]]) -> bool:
        """Leave dead records (first block, blocks) of a file that still holds live ones in place, when the
        budget allows: the file stays whole for a batch to be written over once its last page goes.  False:
        the caller punches them."""
        nbytes = sum(blocks for _block, blocks in ranges) * cf.ALIGN
        if not self.limit or not self._ready():
            return False
        with self._lock:
            if self._bytes + self._deferred_bytes + nbytes > self.limit:
                return False
            self._deferred.setdefault(path, []).extend(ranges)
            self._deferred_bytes += nbytes
            return True

    def forget(self, path: str) -> List[Tuple[int, int]]:
        """The file at path goes (removed, or its dead records punched): its deferred records, no longer
        counted."""
        with self._lock:
            ranges = self._deferred.pop(path, [])
            self._deferred_bytes -= sum(blocks for _block, blocks in ranges) * cf.ALIGN
            return ranges

    def offer(self, path: str) -> bool:
        """Keep the dead batch file at path, its first header zeroed, when it fits the limit; False: the caller
        removes it.  Either way its dead records left in place are no longer counted apart."""
        self.forget(path)
        file_id = batch.parse_name(os.path.basename(path))
        if not self.limit or file_id is None or not self._ready():
            return False
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        with self._lock:
            if not size or self._bytes + self._deferred_bytes + size > self.limit:
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
        """Remove every kept file and punch every dead record left in place (a clean stop: the next start's
        index would not know them, and a file would never be found empty); how many files removed."""
        with self._lock:
            files = [path for kept in self._by_size.values() for _id, path in kept]
            self._by_size.clear()
            self._bytes = 0
            deferred, self._deferred, self._deferred_bytes = self._deferred, {}, 0
        for path, ranges in deferred.items():
            try:
                if batch.punch_ranges(path, ranges) is False:
                    cf.unlink_quietly(path)
            except OSError:
                pass  # the next start walks the file: those records come back as pages, whole
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
