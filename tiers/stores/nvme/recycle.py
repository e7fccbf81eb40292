"""Batch chunk files whose every page left, written over by the next batch of their size.

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

Where the dead file goes:

- A put claims a file of its batch's exact size before it reserves
  (``claim``).  A kept file of that size is its at once; else a dead file of
  that size that its own victims empty goes to it (``offer`` from its own
  discard), so a put into a full tier writes over the file it evicted.  Its
  reservation counts exactly that file.  (A file another thread empties is
  never handed over: the put's own victims' file would then stay on disk,
  counted by nobody, while the other thread wrote a new file in the room its
  evictions made: the suite's concurrency test measured that.)
- Else it is kept (``offer``) while the disk has room for it beside what the
  index holds and what writes have in flight: the ledger counts kept bytes as
  ``dead`` (tiers/stores/nvme/ledger.py), so the disk never holds more than
  the capacity, and a reservation gives kept files up (``give_up_locked``;
  removed before its writer writes) before it evicts a live page.  A kept
  file costs the cache nothing: it is free room, already allocated.
- Else it is removed.

A dead file's first record header is zeroed before it is kept or claimed (one
4 KiB write): a restart after a crash walks it, finds no record at its start
and removes it, as it removes a file a crash cut short, so a page evicted or
deleted is not found again.  A clean stop removes the kept files.  Nothing is
kept while the index is rebuilt (a scan must not meet a kept file that a put
is about to write over).

Records evicted from a file that still holds live pages are left in place
too (not punched), up to ``limit`` bytes, so that file is whole when its
last page goes and a batch is written over it with no block allocated again;
a clean stop punches them.  After a crash the restart walks them as the pages
they were, whole and checked.  They are left by a put into a full tier, which
has no room to spare then, so the limit is taken out of the index's capacity
ahead (tiers/stores/nvme/store.py): those bytes do cost the cache.

A batch written over a dead file lays its records from the start and writes
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
from tiers.stores.nvme.ledger import Ledger

# The default limit of dead records left in place on a tier of 8 GiB and more: two batch files of the largest
# size (batch_writes.BATCH_FILE_BYTES).  A smaller tier leaves none: it would give up a visible share of its
# cache for it.
RECYCLE_BYTES = 128 << 20
_ZEROS = batch.aligned_block()  # a header no walk takes for a record


class Claim:
    """A put's claim on a dead batch file of its exact size: file the (id, path) it got; spare the bytes of a
    kept file it took, still counted as dead until its reservation takes them over (Ledger.reserve_many).
    One put's own, used by its thread alone."""

    __slots__ = ("size", "file", "spare")

    def __init__(self, size: int = 0) -> None:
        self.size = size
        self.file: Optional[Tuple[int, str]] = None
        self.spare = 0


class RecycledFiles:
    """Dead batch files kept under their own names, by size, within the ledger's room; files handed to the
    puts whose victims emptied them; dead records left in place up to limit bytes (kept out of the ledger's
    capacity by the store).  Implements the ledger's SpareFiles (its lock is taken before this one's, never
    after)."""

    def __init__(self, ledger: Ledger, limit: int, ready: Callable[[], bool] = lambda: True, on: bool = True):
        self.on = on  # False: nothing is kept, claimed or left in place (recycle_bytes = 0)
        self.limit = max(0, limit) if on else 0
        self._ledger = ledger
        self._ready = ready  # false while the index is rebuilt
        self._by_size: Dict[int, List[Tuple[int, str]]] = {}
        self._bytes = 0
        self._given_up: List[str] = []  # kept files given up for room, removed by the next remove_given_up
        # Records evicted from files that still hold live ones, left in place (not punched) while the limit
        # allows, so the file is whole when its last page goes: path -> (first block, blocks) ranges.
        self._deferred: Dict[str, List[Tuple[int, int]]] = {}
        self._deferred_bytes = 0
        self._lock = threading.Lock()
        self._removing = threading.Lock()  # held while given-up files are removed
        self.kept = 0  # dead files kept instead of removed
        self.reused = 0  # batches written over a dead file

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
        limit allows: the file stays whole for a batch to be written over once its last page goes.  False:
        the caller punches them."""
        nbytes = sum(blocks for _block, blocks in ranges) * cf.ALIGN
        if not self.limit or not self._ready():
            return False
        with self._lock:
            if self._deferred_bytes + nbytes > self.limit:
                return False
            self._deferred.setdefault(path, []).extend(ranges)
            self._deferred_bytes += nbytes
            return True

    def forget(self, path: str) -> List[Tuple[int, int]]:
        """The file at path goes (removed, written over, or its dead records punched): its deferred records, no
        longer counted."""
        with self._lock:
            ranges = self._deferred.pop(path, [])
            self._deferred_bytes -= sum(blocks for _block, blocks in ranges) * cf.ALIGN
            return ranges

    def claim(self, size: int) -> Claim:
        """A put's claim on a dead file of exactly size bytes, before it reserves: a kept one at once (its bytes
        the claim's spare, still counted as dead until the reservation takes them over); else the one its
        own victims empty, if any (offer)."""
        got = Claim(size)
        if not self.on or not size:
            return got
        with self._lock:
            files = self._by_size.get(size)
            if files:
                got.file = files.pop()
                if not files:
                    del self._by_size[size]
                self._bytes -= size
                got.spare = size
        return got

    def settle(self, claim: Claim, size: int) -> Optional[Tuple[int, str]]:
        """The (id, path) of the file claim got, to write over, when that is exactly size bytes (the put's file
        as laid out); else None (a file it got of another size is kept or removed as any dead file)."""
        got, claim.file = claim.file, None
        if got is None:
            return None
        if claim.size != size:
            self._keep_or_remove(got[1], claim.size)
            return None
        with self._lock:
            self.reused += 1
        return got

    def drop_spare(self, claim: Claim, left: int) -> None:
        """The kept file claim took is not written over after all (some of its put's pages were refused): removed
        at once, before the put writes, and the left bytes of it still counted as dead freed."""
        got, claim.file = claim.file, None
        if got is not None:
            cf.unlink_quietly(got[1])
        if left:
            self._ledger.dead_bytes.free(left)

    def offer(self, path: str, held: int = 0, claim: Optional[Claim] = None) -> bool:
        """Take the dead batch file at path, its first header zeroed: to claim, when the discard of that claim's
        own put emptied it and it is of the claim's size, else kept where the ledger has room.  held: bytes
        of its records the ledger still counts as dead (a delete's or clear's, Ledger.pop_many); True: they
        are settled too.  False: the caller removes the file, then frees them.  Either way its dead records
        left in place are no longer counted apart."""
        self.forget(path)
        file_id = batch.parse_name(os.path.basename(path))
        if not self.on or file_id is None or not self._ready():
            return False
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        if not size:
            return False
        handed = claim is not None and claim.file is None and claim.size == size
        if not handed and not self._ledger.keep_dead(size, held):
            return False
        try:
            _zero_first_header(path)
        except OSError:
            if not handed:
                self._ledger.dead_bytes.free(size - held)  # back to held counted, for the caller to free
            return False
        if handed:  # the put's reservation counts the file: what a delete held of it is free
            claim.file = (file_id, path)
            if held:
                self._ledger.dead_bytes.free(held)
            return True
        with self._lock:
            self._keep_locked(file_id, path, size)
        return True

    def _keep_locked(self, file_id: int, path: str, size: int) -> None:
        self._by_size.setdefault(size, []).append((file_id, path))
        self._bytes += size
        self.kept += 1

    def _keep_or_remove(self, path: str, size: int) -> None:
        """A zeroed dead file no claim uses: kept where the ledger has room, else removed."""
        file_id = batch.parse_name(os.path.basename(path))
        if file_id is not None and self._ledger.keep_dead(size):
            with self._lock:
                self._keep_locked(file_id, path, size)
        else:
            cf.unlink_quietly(path)

    def give_up_locked(self) -> int:
        """SpareFiles: a kept file given up for room, the largest (removed by remove_given_up before the
        reserving writer writes); its bytes, 0 when none is kept."""
        with self._lock:
            if not self._by_size:
                return 0
            size = max(self._by_size)
            files = self._by_size[size]
            _id, path = files.pop()
            if not files:
                del self._by_size[size]
            self._bytes -= size
            self._given_up.append(path)
            return size

    def remove_given_up(self) -> None:
        """Remove the kept files given up for room (by the writer that reserved it, before it writes).  A
        writer that finds another removing them waits until it is done: the room it reserved may be theirs."""
        with self._removing:
            with self._lock:
                paths, self._given_up = self._given_up, []
            for path in paths:
                cf.unlink_quietly(path)

    def drain(self) -> int:
        """Remove every kept file and punch every dead record left in place (a clean stop: the next start's
        index would not know them, and a file would never be found empty); how many files removed."""
        with self._lock:
            files = [path for kept in self._by_size.values() for _id, path in kept] + self._given_up
            self._by_size.clear()
            self._given_up = []
            freed, self._bytes = self._bytes, 0
            deferred, self._deferred, self._deferred_bytes = self._deferred, {}, 0
        self._ledger.dead_bytes.free(freed)
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
