"""The NVMe disk kept in step with the index: what leaves the ledger leaves the disk.

A chunk of a file of its own is unlinked unless its key was written back
into that file meanwhile; a batch record's blocks are punched back to the
file system (the file goes with its last record); an evicted page is handed
to the eviction listener first; a page that cannot be served is dropped.
Per-digest stripe locks order "rename + commit" of a write
(tiers/stores/nvme/page_writes.py) and "unlink unless re-added" here.
"""
from __future__ import annotations

import os
import threading
from typing import List, Optional

from tiers.logs import RateLimitedLog
from tiers.stores.base import EvictionListener
from tiers.stores.nvme import batch, chunkfile as cf
from tiers.stores.nvme.codec import Codec
from tiers.stores.nvme.entry import Entry, Victim
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.nvme.recycle import Claim, RecycledFiles

N_STRIPES = 64


class Removal:
    """Files and batch records of chunks already out of the index (or of one that cannot be served) removed."""

    def __init__(self, name: str, ledger: Ledger, codec: Codec, evictions: Optional[EvictionListener],
                 rlog: RateLimitedLog, recycled: RecycledFiles):
        self.name = name
        self._recycled = recycled  # a batch file that loses its last page is kept for a batch of its size
        self._ledger = ledger
        self._codec = codec
        # Hears of each evicted chunk before its file is removed: the daemon may demote it further.
        self._evictions = evictions
        self._rlog = rlog
        self._stripes = [threading.Lock() for _ in range(N_STRIPES)]
        self._file_stripes = [threading.Lock() for _ in range(N_STRIPES)]  # batch files given back, by path

    def stripe(self, digest: int) -> threading.Lock:
        return self._stripes[digest % N_STRIPES]

    def discard(self, digest: int, entry: Entry, evicted: bool = False) -> None:
        """Delete the file (or batch record) of a chunk already out of the index, unless the key was re-added
        into the same file."""
        if evicted and self._evictions is not None:
            self._notify_evict(entry)
        if entry.file:  # its own record, whatever came since: a newer version lies elsewhere
            self.give_back(entry)
            return
        with self.stripe(digest):
            if digest not in self._ledger:  # else a newer version was renamed over the file already
                cf.unlink_quietly(entry.path)

    def give_back(self, entry: Entry) -> None:
        """A batch record's blocks back to the file system; the file goes with its last record."""
        self._give_back_many([entry])

    def _give_back_many(self, entries: List[Entry], held: bool = False, claim: Optional[Claim] = None) -> None:
        """Batch records' blocks back, each file opened once and adjacent records punched as one range (the
        victims of a batch are mostly the oldest records of one file); a file that loses its last record goes
        whole, with no hole punched: kept for a batch of its size (tiers/stores/nvme/recycle.py) or removed.
        held: the records' bytes are still counted as dead (Ledger.pop_many), freed once they left the disk.
        claim: the reserving put's, which a file of its size emptied here goes to."""
        by_file: dict = {}
        for entry in entries:
            by_file.setdefault(entry.path, []).append((entry.block, -(-entry.disk_size // cf.ALIGN)))
        for path, ranges in by_file.items():
            pending = sum(blocks for _b, blocks in ranges) * cf.ALIGN if held else 0
            # One give-back a file at a time: two puts' victims in one file, given back at once, each found
            # the other's records still there and both punched, or one found the file empty and handed it to
            # its put to write over while the other still punched ranges of it (the new records' blocks).
            try:
                with self._file_stripes[hash(path) % N_STRIPES]:
                    self._give_back_file(path, ranges, claim, pending)
            except OSError as exc:
                self._rlog.warning("punch", "%s: giving back pages of %s: %s", self.name, path, exc.strerror)

    def _give_back_file(self, path: str, ranges: list, claim: Optional[Claim], pending: int) -> None:
        """_give_back_many's work on one file, holding its stripe; pending (held bytes) settled here."""
        recycled = self._recycled
        try:
            if not batch.holds_data_outside(path, ranges + recycled.deferred(path)):
                if recycled.offer(path, pending, claim):
                    pending = 0  # settled by the offer
                else:
                    cf.unlink_quietly(path)
            elif not recycled.defer(path, ranges):  # else left in place (out of the index's capacity)
                if batch.punch_ranges(path, ranges + recycled.forget(path)) is False:
                    cf.unlink_quietly(path)
        finally:
            if pending:
                self._ledger.dead_bytes.free(pending)

    def discard_many(self, victims: List[Victim], evicted: bool = False, held: bool = False,
                     claim: Optional[Claim] = None) -> None:
        """discard for many chunks: the batch records among them given back together; and the kept files the
        reservation gave up for room removed (every writer calls this after reserving, victims or none).
        held: the victims' bytes are still counted as dead (Ledger.pop_many), each freed once it left the
        disk.  claim: the reserving put's (tiers/stores/nvme/recycle.py)."""
        self._recycled.remove_given_up()
        records = []
        for digest, entry in victims:
            if not entry.file:
                try:
                    self.discard(digest, entry, evicted)
                finally:
                    if held:
                        self._ledger.dead_bytes.free(entry.disk_size)
                continue
            if evicted and self._evictions is not None:
                self._notify_evict(entry)
            records.append(entry)
        if records:
            self._give_back_many(records, held, claim)

    def unlink_stale(self, digest: int, entry: Entry) -> None:
        """A chunk the rebuild found after its page was deleted, evicted or cleared: gone, unless re-added."""
        self.discard(digest, entry)

    def _notify_evict(self, entry: Entry) -> None:
        try:
            # The index keeps no key text: the header names the page.
            hdr = cf.read_header(entry.path, entry.record_block)
            key = (hdr.namespace, hdr.key)
            buf = bytearray(hdr.raw_len)
            hdr = cf.read_chunk(entry.path, *key, [memoryview(buf)], hdr.raw_len, self._codec.decode, False,
                                entry.record_block)
        except (OSError, cf.CorruptChunk, cf.SizeMismatch):
            return  # nothing sound to hand on
        self._evictions.page_evicted(key, [memoryview(buf)], entry.reads, hdr.page_sum)

    def forget(self, digest: int, entry: Entry, ino: Optional[int], why: str) -> None:
        """Drop a chunk that cannot be served; unlink its file if it is still the one that was read."""
        removed = False
        if entry.file:  # a record of a batch chunk: its blocks go back, the other records stay
            dropped = self._ledger.drop(digest, entry, corrupt=ino is not None)
            if dropped:
                self.give_back(entry)
                self._rlog.warning("corrupt" if ino is not None else "lost", "%s: dropped a page of %s: %s",
                                   self.name, entry.path, why)
            return
        with self.stripe(digest):
            if ino is not None:
                try:
                    if os.stat(entry.path).st_ino == ino:
                        removed = cf.unlink_quietly(entry.path)
                except FileNotFoundError:
                    pass
            dropped = self._ledger.drop(digest, entry, corrupt=removed)
        if removed:
            self._rlog.warning("corrupt", "%s: removed %s: %s", self.name, entry.path, why)
        elif dropped:  # not a race with an eviction or overwrite: the file went behind our back
            self._rlog.warning("lost", "%s: forgot %s: %s", self.name, entry.path, why)

    def replaced(self, digest: int, replaced: Entry) -> None:
        """The older version of a page now in a batch chunk goes: its record, or its own file (unless the page
        was written back into that file meanwhile)."""
        if replaced.file:
            self.give_back(replaced)
            return
        with self.stripe(digest):
            entry = self._ledger.get(digest)
            if entry is None or entry.file:
                cf.unlink_quietly(replaced.path)
