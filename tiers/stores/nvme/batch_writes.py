"""The NVMe tier's batched puts: a put's pages of one namespace into one batch chunk file (tiers/stores/nvme/batch.py).

Raw pages (the default, no compression): the file is laid out first, every
page's record reserved (at most 8 MiB of records a lock hold, evicting as
needed, the victims' blocks given back before a byte of ours is written: the
disk never holds more than capacity); then a part at a time (PART_BYTES, then twice the part
before) the pages are filled, checked against the writer's checksum, given
their headers in one C call and handed to a writer thread while the next part
is prepared.  Compressed pages have no size until encoded: each part is
encoded, reserved and appended in turn.  The file is made under its own
name; one fdatasync at the end, and its directory fsynced while the device
writes the last part (files up to DIRSYNC_CONCURRENT_BYTES) or after that
flush (larger ones); then every page of the file is indexed.  A refusal is
per page (too large, bytes that do not match the writer's checksum, no
room); a failed write refuses every page of its file.
"""
from __future__ import annotations

import errno
import os
import secrets
import time
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple

from tiers.stores.base import (Buffers, FillFailed, FillPages, PageKey, PageTooLarge, StoreError, StoreFull,
                               StoreIOError, accepted_page, total_size)
from tiers.stores.nvme import batch, chunkfile as cf, laid_out
from tiers.stores.nvme.codec import Codec
from tiers.stores.nvme.dirsync import DirSyncer
from tiers.stores.nvme.layout import key_digest, namespace_hash
from tiers.stores.nvme.entry import Entry, Victim
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.nvme.recycle import Claim, RecycledFiles

BATCH_FILE_BYTES = 64 << 20  # a put's pages go into batch chunk files of at most this size (or one page)
# Bytes prepared (filled, checked, given headers) and handed to the device at a time within one file, the
# first part; each next part is twice the one before, up to MAX_PART_BYTES.  The first part's preparation is
# the device's idle start, yet smaller writes cost throughput: each part extends the file and ext4 serializes
# O_DIRECT writes that extend one, so a write's size is the device's queue depth (one 8.5 MiB O_DIRECT
# pwritev of 64 KiB records ran 1.03 GB/s here, 1 MiB ones 0.88; from 4 MiB on they are equal).  A file
# preallocated whole, parts of 512 KiB doubling, several in flight, started the device 1.5 ms sooner and
# wrote 256 KiB pages 25-30% slower through the daemon (scripts/ab_nvme_put.py, both orders): not kept.
# The first part is also at most FIRST_PART_PAGES pages: its preparation is ~10 us a page of Python and
# hashing before the device has anything to do.  At 64 KiB pages (1 MiB first parts instead of 4 MiB) that
# wrote 8% faster through the daemon, paired round by round (scripts/ab_nvme_put.py, 16 rounds); a 1 MiB
# first part at 1 MiB pages (one page) wrote 31% slower, so larger pages keep PART_BYTES.
PART_BYTES = 4 << 20
FIRST_PART_PAGES = 16
MAX_PART_BYTES = 64 << 20
# Without fsync nothing waits for the device, and a small batch file goes through the page cache: 1.5-1.8x as
# fast as O_DIRECT for files of 8.5 MiB (128 pages of 64 KiB with their headers), 1.0-2.4x for 33 MiB (256 KiB
# pages: 1.37-3.07 GB/s buffered across three A/Bs, 1.27-1.36 with O_DIRECT; scripts/ab_bench.py, session 38).
# Puts of 128 MiB and more (files of 64 MiB) ran 0.57-4.45 GB/s buffered in two full runs (the kernel throttles
# a writer past its dirty-page limits) against a steady 1.8-3.3 with O_DIRECT, and would hold that much of the
# node's page cache dirty: they stay O_DIRECT.  With fsync every batch file is O_DIRECT: buffered, the one
# flush wrote the whole file, 0.56-0.78x as fast.
BUFFERED_BATCH_BYTES = 40 << 20
# A durable put makes the new file's name durable with a directory fsync.  Up to this many bytes a file, it runs
# while the device writes the last part; past it, after the file's own fdatasync, when it finds that journal
# commit done and costs next to nothing.  Paired puts (scripts/ab_nvme_put.py, 16-24 rounds, session 39): the
# concurrent sync ran 1.03-1.07x faster at 64 KiB pages (8.5 MiB files) and 1.03x at 256 KiB (33 MiB), and
# 0.80-0.88x at 1 MiB pages (two 64 MiB files a put: a journal commit in the middle of their allocations, and
# another at their flush), 0.72x at 4 MiB, 0.96x at 8 MiB.  A bare file (one pwritev, 8.5 MiB): no sync 7.00 ms,
# sync after the flush 6.96, sync beside the write 7.51.
DIRSYNC_CONCURRENT_BYTES = 40 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _finish_durable(t: "BatchTarget", writer: batch.BatchWriter, path: str, file_bytes: int,
                    new_name: bool = True) -> None:
    """Every part on the device and, with fsync, the file flushed and, when new_name (not a kept file written
    over: its name is durable since its first put), its name made durable (DIRSYNC_CONCURRENT_BYTES says in
    which order).  The directory is synced on this thread: on a writer's, concurrent puts' syncs would hold up
    their parts."""
    if not new_name:
        writer.finish(t.fsync)
        return
    early = t.fsync and file_bytes <= DIRSYNC_CONCURRENT_BYTES
    if early:
        t.dirsync.sync(os.path.dirname(path))
    writer.finish(t.fsync)
    if t.fsync and not early:
        t.dirsync.sync(os.path.dirname(path))


@dataclass
class BatchTarget:
    """What puts need of the store they write for (a page alone: tiers/stores/nvme/page_writes.py)."""

    name: str
    root: str
    capacity: int
    max_page_bytes: int
    fsync: bool
    ledger: Ledger
    codec: Codec
    writers: Executor  # threads that move each part to the device
    dirsync: DirSyncer
    direct: Callable[[], bool]  # O_DIRECT now (a device that refused it turns it off)
    discard: Callable[..., None]  # evicted chunks' files or records given back (Removal.discard_many)
    replaced: Callable[[int, Entry], None]  # an older version of a page just indexed goes
    buffered_up_to: int = 0  # batch files of at most this many bytes go through the page cache (0: none)
    recycled: Optional[RecycledFiles] = None  # dead batch files a batch of their size is written over


@dataclass
class _Pending:
    """A page of a put on its way into a batch chunk."""

    position: int  # in the put's keys
    disk: int  # bytes its record takes on disk (header and payload, padded to 4 KiB)
    digest: int
    header: memoryview
    payload: List[memoryview]
    size: int  # the page's own bytes
    stored: int  # its payload's (compressed or not)
    parent: Optional[int]
    raw: bool  # the payload is the caller's own buffers (not compressed into ours)


class BatchWrites:
    def __init__(self, target: BatchTarget):
        self.t = target
        self._made: set = set()  # batch directories known to exist
        # Ids of the files being written (from before their creation until indexed or removed): a restart
        # scan running meanwhile leaves them alone (tiers/stores/nvme/batch.py scan_files).
        self.writing: Set[int] = set()

    def put_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], parents: Sequence[Optional[str]],
                 checksums: Optional[Sequence[int]], page_sums: Optional[Sequence[int]] = None,
                 fill: Optional[FillPages] = None, aligned: bool = False) -> List[Optional[StoreError]]:
        """None or the refusal of each page; checksums, page_sums and fill as PageStore.put_many_with_sums and
        put_many_filled declare them (each part is filled just before it is prepared)."""
        out: List[Optional[StoreError]] = [None] * len(keys)
        if fill is not None:
            page_sums = [0] * len(keys)
            if checksums is None:  # the daemon hashed for the writer: a page's checksum is its fill's sum,
                checksums = page_sums  # read by _record once its part is filled
        sizes = [total_size(page) for page in pages]
        namespace = keys[0][0] if keys else ""
        if all(key[0] == namespace for key in keys):  # an engine's put: one namespace
            groups = {namespace: list(range(len(keys)))}
        else:
            groups = {}
            for i, key in enumerate(keys):
                groups.setdefault(key[0], []).append(i)
        for namespace, idx in groups.items():
            first = 0
            while first < len(idx):  # files of at most BATCH_FILE_BYTES (or one page)
                last, at = first, 0
                while last < len(idx) and (last == first or at + sizes[idx[last]] <= BATCH_FILE_BYTES):
                    at += sizes[idx[last]]
                    last += 1
                if self.t.codec.codec_id == 0:
                    self._write_raw_file(namespace, idx[first:last], keys, pages, sizes, parents, checksums,
                                         page_sums, fill, out, aligned)
                else:
                    self._write_file(namespace, idx[first:last], keys, pages, parents, checksums, page_sums, fill,
                                     out, aligned)
                first = last
        return out

    def _record(self, position: int, key: PageKey, page: Buffers, parent, checksum: int,
                page_sum: Optional[int], header: memoryview) -> _Pending:
        """One page checked and encoded, its header packed into header (a 4 KiB block at a 4 KiB address):
        PageTooLarge, StoreIOError (bytes that do not match the writer's checksum).  page_sum: the bytes'
        checksum as the caller computed it, or None (hashed here)."""
        t = self.t
        src, size = accepted_page(page, t.max_page_bytes)
        namespace, name = key
        encoded = t.codec.encode(src, size)
        payload = src if encoded is None else [memoryview(encoded)]
        stored = total_size(payload)
        if page_sum is None or encoded is not None:
            payload_sum = cf.payload_hash(payload)
            page_sum = payload_sum if encoded is None else (page_sum or cf.payload_hash(src))
        else:
            payload_sum = page_sum  # a raw payload's checksum is the page's
        # Bytes changed on their way here are refused, not stored.
        if checksum and checksum != page_sum:
            t.ledger.count("checksum_refused")
            raise StoreIOError(f"{t.name}: the page's bytes do not match the writer's checksum")
        cf.pack_header(header, namespace, name, 0 if encoded is None else t.codec.codec_id, size, stored,
                       payload_sum, checksum)
        disk = batch.record_blocks(stored) * cf.ALIGN
        if disk > t.capacity:
            raise PageTooLarge(f"chunk of {disk} bytes exceeds capacity {t.capacity}")
        return _Pending(position, disk, key_digest(namespace, name), header, payload, size, stored,
                        _parent_digest(namespace, parent), encoded is None)

    def _write_raw_file(self, namespace: str, idx: List[int], keys, pages, page_bytes: List[int], parents,
                        checksums, page_sums, fill: Optional[FillPages], out: list, aligned: bool = False) -> None:
        """Pages idx of a put, stored raw, into one new batch file laid out ahead: every page's room reserved
        first, then parts filled, checked, given their headers (one C call a part) and written
        while the next is prepared; one flush, then indexed."""
        t = self.t
        ns_hash = namespace_hash(namespace)
        lay = laid_out.lay_out(t, namespace, ns_hash, idx, pages, page_bytes, out)
        if lay is None:
            return
        with self._new_file(sum(lay.disks), lay.claim) as (file_id, path, over):
            writer = self._open_writer(path, sum(lay.disks), over)
            if isinstance(writer, StoreError):
                self._refuse(lay, ns_hash, out, writer)
                return
            ns_bytes = namespace.encode()
            try:
                for part in _parts(lay.ok, pages):
                    if fill is not None:  # the part's bytes come in now, while the part before goes to the device
                        part_sums = fill(part)
                        for i, page_sum in zip(part, part_sums):
                            page_sums[i] = page_sum  # the writer's checksums too when the daemon hashed for it
                    elif page_sums is not None:
                        part_sums = [page_sums[i] for i in part]
                    else:
                        part_sums = [cf.payload_hash(pages[i]) for i in part]
                    laid_out.write_part(t, lay, writer, part, part_sums, checksums, keys, ns_bytes, ns_hash, out,
                                        aligned)
                    time.sleep(0)  # the GIL to the writer thread now, not at the next switch interval (5 ms)
                if not lay.held:
                    writer.abort()
                    return
                if lay.gaps:
                    writer.punch(lay.gaps)
                _finish_durable(t, writer, path, sum(lay.disks), new_name=not over)
            except FillFailed as exc:  # nothing of this file is kept: its pages are refused as the fill says
                writer.abort()
                self._refuse(lay, ns_hash, out, exc)
                return
            except (OSError, ValueError) as exc:  # ValueError: a namespace and key too long for a header
                writer.abort()
                full = isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS
                if full and t.recycled is not None and t.ledger.dead_bytes.give_up(sum(lay.disks)):
                    t.recycled.remove_given_up()  # the device is full below our count: room for the next put
                reason = getattr(exc, "strerror", None) or exc
                self._refuse(lay, ns_hash, out, StoreFull(f"{t.name}: {reason}") if full
                             else StoreIOError(f"{t.name}: writing {path}: {reason}"))
                return
            done = sorted(lay.held)
            stamp = max(1, int(time.monotonic()))
            for digest, replaced in t.ledger.commit_many(
                    ns_hash, namespace, stamp, file_id,
                    [(lay.digests[k], lay.disks[k], lay.sizes[k], _parent_digest(namespace, parents[lay.ok[k]]),
                      lay.blocks[k]) for k in done]):
                t.replaced(digest, replaced)
            written = sum(lay.sizes[k] for k in done)
            t.ledger.wrote(written, written, len(done))

    def _refuse(self, lay: laid_out.Layout, ns_hash: int, out: list, err: StoreError) -> None:
        """Every page of a file that failed is refused (a refusal a page has already stays) and the
        reservations still held given back."""
        for k in lay.held:
            self.t.ledger.release(lay.disks[k], ns_hash)
        lay.held.clear()
        for i in lay.ok:
            out[i] = out[i] or err

    def _write_file(self, namespace: str, idx: List[int], keys, pages, parents, checksums, page_sums,
                    fill: Optional[FillPages], out: list, aligned: bool = False) -> None:
        """Pages idx of a put into one new batch file, then indexed; each refusal to its page's slot in out."""
        with self._new_file() as (file_id, path, _over):
            t = self.t
            ns_hash = namespace_hash(namespace)
            writer = self._open_writer(path, sum(total_size(pages[i]) for i in idx))  # at most: compressed later
            if isinstance(writer, StoreError):
                for i in idx:
                    out[i] = writer
                return
            written: List[Tuple[_Pending, int]] = []
            try:
                for part in _parts(idx, pages):
                    if fill is not None:  # the part's bytes come in now, while the part before goes to the device
                        for i, checksum in zip(part, fill(part)):
                            page_sums[i] = checksum
                    records: List[_Pending] = []
                    victims: List[Victim] = []
                    headers = batch.aligned_blocks(len(part))  # one allocation a part, not one a page
                    for j, i in enumerate(part):
                        try:
                            record = self._record(i, keys[i], pages[i], parents[i], checksums[i],
                                                  None if page_sums is None else page_sums[i], headers[j])
                            victims += t.ledger.reserve(record.disk, ns_hash, namespace)
                            records.append(record)
                        except StoreFull as exc:
                            out[i] = StoreFull(f"{t.name}: {exc}")
                        except StoreError as exc:
                            out[i] = exc
                    t.discard(victims, True)  # before a byte of ours is written: never more than capacity on disk
                    if records:
                        # Headers and padding are aligned blocks; raw payloads the caller vouched for need no check.
                        firsts = writer.add([batch.Record(r.header, r.payload, r.stored) for r in records],
                                            aligned and all(r.raw for r in records))
                        written += zip(records, firsts)
                        time.sleep(0)  # the GIL to the writer thread now, not at the next switch interval (5 ms)
                if not written:
                    writer.abort()
                    return
                _finish_durable(t, writer, path, writer.blocks * cf.ALIGN)
            except FillFailed as exc:  # nothing of this file is kept: its pages are refused as the fill says
                writer.abort()
                for r, _block in written:
                    t.ledger.release(r.disk, ns_hash)
                for i in idx:
                    out[i] = out[i] or exc
                return
            except OSError as exc:
                writer.abort()
                for r, _block in written:
                    t.ledger.release(r.disk, ns_hash)
                err = (StoreFull(f"{t.name}: {exc.strerror}") if exc.errno in _FULL_ERRNOS
                       else StoreIOError(f"{t.name}: writing {path}: {exc.strerror}"))
                for r, _block in written:
                    out[r.position] = err
                return
            stamp = max(1, int(time.monotonic()))
            for digest, replaced in t.ledger.commit_many(ns_hash, namespace, stamp, file_id,
                                                         [(r.digest, r.disk, r.size, r.parent, block)
                                                          for r, block in written]):
                t.replaced(digest, replaced)
            t.ledger.wrote(sum(r.size for r, _b in written), sum(r.stored for r, _b in written), len(written))

    def _open_writer(self, path: str, nbytes: int, over: bool = False):
        """A BatchWriter for a file of about nbytes at path (over: a kept file of exactly nbytes, written over),
        or the StoreIOError that refuses its pages."""
        direct = self.t.direct() and nbytes > self.t.buffered_up_to
        if over:
            try:
                return batch.BatchWriter(path, direct, self.t.writers, over=True)
            except OSError as exc:  # removed behind our back: this put's pages are refused, the next one's not
                return StoreIOError(f"{self.t.name}: writing over {path}: {exc.strerror}")
        try:
            try:
                return batch.BatchWriter(path, direct, self.t.writers)
            except FileNotFoundError:  # its directory went (removed behind our back): made again, once
                self._made.discard(os.path.dirname(path))
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                return batch.BatchWriter(path, direct, self.t.writers)
        except OSError as exc:
            return StoreIOError(f"{self.t.name}: creating {path}: {exc.strerror}")

    @contextmanager
    def _new_file(self, exact_bytes: int = 0, claim: Optional[Claim] = None) -> Iterator[Tuple[int, str, bool]]:
        """A file id no batch chunk holds (random: nothing to recover at start) and its path, in writing (so a
        restart scan leaves the file alone) from before the file exists until the block ends: it is indexed
        or removed by then; or the dead file of exactly exact_bytes the put's claim got, to write over (its id
        and path, and True)."""
        recycled = self.t.recycled
        kept = recycled.settle(claim, exact_bytes) if claim is not None and recycled is not None else None
        if kept is not None and os.path.exists(kept[1]):  # else removed behind our back: a new file
            self.writing.add(kept[0])
            try:
                yield kept[0], kept[1], True
            finally:
                self.writing.discard(kept[0])
            return
        while True:
            file_id = secrets.randbits(32) or 1
            path = batch.batch_path(self.t.root, file_id)
            # One stat a put: a put choosing the same id at the same moment fails the writer's O_EXCL open
            # instead; directories are made once (nothing removes them; at most 4,096).
            if file_id not in self.writing and not os.path.exists(path):
                break
        self.writing.add(file_id)
        try:
            directory = os.path.dirname(path)
            if directory not in self._made:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                self._made.add(directory)
            yield file_id, path, False
        finally:
            self.writing.discard(file_id)

def _parts(idx: List[int], pages) -> List[List[int]]:
    """idx cut into parts: the first of PART_BYTES or FIRST_PART_PAGES pages, whichever is less, then each
    twice the one before, up to MAX_PART_BYTES (a page at least): the device starts early, and later writes
    are larger."""
    parts: List[List[int]] = [[]]
    at, limit = 0, PART_BYTES
    if idx:
        limit = min(PART_BYTES, FIRST_PART_PAGES * total_size(pages[idx[0]]))
    for i in idx:
        if at >= limit:
            parts.append([])
            at, limit = 0, min(2 * limit, MAX_PART_BYTES)
        parts[-1].append(i)
        at += total_size(pages[i])
    return parts


def _parent_digest(namespace: str, parent) -> Optional[int]:
    return key_digest(namespace, parent) if isinstance(parent, str) and parent else None
