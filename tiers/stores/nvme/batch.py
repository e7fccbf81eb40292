"""Batch chunks: the pages of one put in one file, written sequentially with one flush.

A file per page costs an fsync and a rename per page: at 64 KiB pages that
ran at 0.06x of writing the same batch as one file with one fdatasync
(hicache-tiers bench, ``limit.disk_write_batch``).  A batch chunk is one file
holding a put's pages, each as the chunk record a file of its own holds
(tiers/stores/nvme/chunkfile.py: a 4 KiB header naming namespace, key, sizes
and checksums, then the payload), each record starting at a 4 KiB boundary.
So a page is read, verified and identified exactly as before, at its record's
offset; the index row says which file and block (tiers/stores/page_index.py).

The file is written under its own name (no temporary name, no rename: a
rename and the directory fsync after it took 0.4-0.5 ms on each 8 MiB
put's way here, after the device was done); the directory is fsynced
while the device writes the last part (after the file's flush for files
over 40 MiB: tiers/stores/nvme/batch_writes.py), and the put is
acknowledged after that and the file's one fdatasync.  A crash
before that leaves a file cut short, whose pages were never acknowledged:
the restart removes a file of the last run whose walk ends before the file
does (a header that fails verification, a record past the end), and a page
whose header reached the disk but whose payload did not fails its checksum
when read (a miss, and the record is dropped), never served.  A file this
run is still writing is left alone by a scan running meanwhile (its put
indexes it).  Evicting a page punches a hole over its record (its blocks go
back to the file system at once, so disk use stays what the index counts)
and the file goes when its last page does.  A restart walks each file's
records, skipping holes (SEEK_DATA).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import dataclass
from typing import Container, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from tiers.stores.nvme import chunkfile as cf
from tiers.stores.nvme.layout import key_digest, namespace_hash

SUFFIX = ".hcb"
_LOW64 = (1 << 64) - 1
TOP = "batches"  # beside the per-page fan-out directories
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PAD = memoryview(mmap.mmap(-1, cf.ALIGN))  # zeros, page aligned: a record's tail up to the next boundary


def batch_path(root: str, file_id: int) -> str:
    """Where batch chunk file_id lives: 4,096 directories of up to 4,096 files each, then they wrap."""
    return os.path.join(root, TOP, f"{(file_id >> 12) & 0xFFF:03x}", f"{file_id:08x}{SUFFIX}")


def parse_name(name: str) -> Optional[int]:
    """The file id a batch chunk's name says, None for any other name (temporary files included)."""
    if not name.endswith(SUFFIX) or len(name) != 8 + len(SUFFIX):
        return None
    try:
        return int(name[:8], 16)
    except ValueError:
        return None


def aligned_block() -> memoryview:
    """A zeroed 4 KiB buffer at a 4 KiB address (a record header O_DIRECT may write)."""
    return aligned_blocks(1)[0]


def aligned_buffer(n: int) -> memoryview:
    """n zeroed 4 KiB blocks at a 4 KiB address, in one piece."""
    raw = np.zeros((n + 1) * cf.ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % cf.ALIGN
    return memoryview(raw[start:start + n * cf.ALIGN])


def aligned_blocks(n: int) -> List[memoryview]:
    """n zeroed 4 KiB buffers at 4 KiB addresses, from one allocation."""
    whole = aligned_buffer(n)
    return [whole[k * cf.ALIGN:(k + 1) * cf.ALIGN] for k in range(n)]


def record_blocks(payload_len: int) -> int:
    """4 KiB blocks a record takes: its header and its payload, padded."""
    return 1 + -(-payload_len // cf.ALIGN)


@dataclass
class Record:
    header: memoryview  # the page's chunk header (chunkfile.pack_header), one 4 KiB block
    payload: Sequence[memoryview]
    payload_len: int


def _views(records: Sequence[Record]) -> List[memoryview]:
    views: List[memoryview] = []
    for rec in records:
        views.append(rec.header)
        views.extend(rec.payload)
        pad = -rec.payload_len % cf.ALIGN
        if pad:
            views.append(_PAD[:pad])
    return views


class BatchWriter:
    """One batch chunk written in parts as its records are ready: each part goes to the device from a thread
    of pool (pwritev lets go of the GIL) while the caller prepares the next, and the file gets one flush at
    the end (finish).  Parts whose buffers allow it are written with O_DIRECT."""

    def __init__(self, path: str, direct: bool, pool=None, over: bool = False):
        """over: path is a recycled file of the batch's exact size (tiers/stores/nvme/recycle.py), written over
        from its start; else a new file.  Written over, its first record's header goes last (finish): until
        then the file starts with the zeros it was kept with, and a restart after a crash meanwhile removes
        it whole.  Otherwise a record cut short by the crash (a buffered write stops between pages at a
        SIGKILL) would lie over the old record's bytes, its header whole: indexed by the scan, then a
        checksum failure at its first read."""
        self.path = path
        self._over = over
        self._first_header: Optional[memoryview] = None  # held back until finish (over only)
        self._pool = pool
        flags = os.O_WRONLY | os.O_CLOEXEC | (0 if over else os.O_CREAT | os.O_EXCL)
        self._fd = os.open(path, flags | (cf.O_DIRECT if direct else 0), 0o600)
        self._direct = direct
        self._buffered_fd: Optional[int] = None if direct else self._fd
        self._pending: list = []
        self.blocks = 0  # blocks written or being written
        self.direct_parts = 0

    def punch(self, ranges: Sequence[Tuple[int, int]]) -> None:
        """Give back (first block, blocks) ranges laid out for pages refused after all (their bytes did not
        match their sums): a hole already where nothing was written past them, and certain to be one."""
        for block, blocks in ranges:
            if _libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, block * cf.ALIGN,
                               blocks * cf.ALIGN) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), self.path)

    def add(self, records: Sequence[Record], aligned: bool = False, block: Optional[int] = None) -> List[int]:
        """Write records after those added before, or from block when given (a laid-out file); the first
        block of each.  aligned: every buffer is known to start and end on a 4 KiB boundary (else each is
        checked: a read-only view's address costs ~1.4 us)."""
        at = self.blocks if block is None else block
        offset, firsts = at * cf.ALIGN, []
        for rec in records:
            firsts.append(at)
            at += record_blocks(rec.payload_len)
        views = _views(records)
        if self._over and offset == 0 and records:
            self._first_header, views[0] = records[0].header, _PAD
        fd = self._fd_for(views, aligned)
        self.blocks = max(self.blocks, at)
        if self._pool is None:
            cf.pwritev_all(fd, views, offset)
        else:
            self._pending.append(self._pool.submit(cf.pwritev_all, fd, views, offset))
        return firsts

    def _fd_for(self, views: List[memoryview], aligned: bool) -> int:
        """The O_DIRECT descriptor where every buffer allows it, else a buffered one (opened once)."""
        if self._direct and (aligned or cf.is_aligned(views)):
            self.direct_parts += 1
            return self._fd
        if self._buffered_fd is None:
            self._buffered_fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        return self._buffered_fd

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()  # the first error raises

    def finish(self, fsync: bool) -> None:
        """Every part on the device (and then a file written over its first header), then one fdatasync when
        fsync."""
        self._wait()
        if self._first_header is not None:
            header, self._first_header = self._first_header, None
            cf.pwritev_all(self._fd_for([header], False), [header], 0)
        if fsync:
            os.fdatasync(self._fd)  # the file's data, by whichever descriptor it was written
            if self._buffered_fd is not None:
                os.posix_fadvise(self._buffered_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._close()

    def abort(self) -> None:
        try:
            self._wait()
        except OSError:
            pass
        self._close()
        cf.unlink_quietly(self.path)

    def _close(self) -> None:
        for fd in {self._fd, self._buffered_fd} - {None}:
            os.close(fd)
        self._fd = self._buffered_fd = None


def punch(path: str, block: int, blocks: int) -> bool:
    """Give a record's blocks back to the file system (the file keeps its size); False where it cannot
    (a file system without hole punching: the bytes stay until the file goes)."""
    return punch_ranges(path, [(block, blocks)]) is not None


def _merged(ranges: Sequence[Tuple[int, int]]) -> List[List[int]]:
    merged: List[List[int]] = []
    for block, blocks in sorted(ranges):
        if merged and merged[-1][0] + merged[-1][1] >= block:
            merged[-1][1] = max(merged[-1][1], block + blocks - merged[-1][0])
        else:
            merged.append([block, blocks])
    return merged


def holds_data_outside(path: str, ranges: Sequence[Tuple[int, int]]) -> bool:
    """Whether the batch file at path holds data anywhere but in the (first block, blocks) ranges: False when
    giving those back leaves it empty (or it is gone), so it can go whole without a hole punched."""
    merged = _merged(ranges)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        end = os.fstat(fd).st_size
        at, i = 0, 0
        while at < end:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only holes from here
                    return False
                raise
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            while i < len(merged) and (merged[i][0] + merged[i][1]) * cf.ALIGN <= start:
                i += 1
            if i == len(merged) or merged[i][0] * cf.ALIGN > start or (merged[i][0] + merged[i][1]) * cf.ALIGN < stop:
                return True  # data from start on that no range covers
            at = stop
        return False
    finally:
        os.close(fd)


def punch_ranges(path: str, ranges: Sequence[Tuple[int, int]]) -> Optional[bool]:
    """Punch (first block, blocks) ranges of one batch file, adjacent ones merged, through one descriptor;
    whether the file still holds data afterwards (False: remove it), None where holes cannot be punched."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        for block, blocks in _merged(ranges):
            if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, block * cf.ALIGN,
                               blocks * cf.ALIGN) != 0:
                err = ctypes.get_errno()
                if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                    return None
                raise OSError(err, os.strerror(err), path)
        try:
            os.lseek(fd, 0, os.SEEK_DATA)
            return True
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return False
            raise
    finally:
        os.close(fd)


def read_run(path: str, first_block: int, pages: Sequence[Tuple[str, str, Sequence[memoryview], int]],
             direct: bool) -> List[Optional[cf.ChunkHeader]]:
    """Read adjacent uncompressed records of one batch file (pages: namespace, key, the buffers of each and its
    size, in block order from first_block) with one open and one preadv straight into the buffers; each
    record's verified header, or None for one that does not verify (the caller reads it alone to learn why:
    compressed, corrupt, another key)."""
    views: List[memoryview] = []
    blocks = 0
    headers = []
    for _ns, _key, dst, size in pages:
        hdr = aligned_block() if direct else memoryview(bytearray(cf.HEADER_SIZE))
        headers.append(hdr)
        views.append(hdr)
        views.extend(dst)
        pad = -size % cf.ALIGN
        if pad:
            views.append(memoryview(bytearray(pad)))
        blocks += record_blocks(size)
    direct = direct and cf.is_aligned(views)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (cf.O_DIRECT if direct else 0))
    try:
        ino = os.fstat(fd).st_ino
        got = cf.preadv_all(fd, views, first_block * cf.ALIGN)
    finally:
        os.close(fd)
    out: List[Optional[cf.ChunkHeader]] = []
    at = 0
    for hdr_block, (namespace, key, dst, size) in zip(headers, pages):
        at += record_blocks(size) * cf.ALIGN
        try:
            hdr = cf.parse_header(hdr_block, ino)
        except cf.CorruptChunk:
            out.append(None)
            continue
        ok = (at <= got and hdr.codec == 0 and hdr.namespace == namespace and hdr.key == key
              and hdr.raw_len == size and hdr.payload_len == size and cf.payload_hash(dst) == hdr.payload_hash)
        out.append(hdr if ok else None)
    return out


def walk_records(path: str) -> Tuple[List[Tuple[int, cf.ChunkHeader]], bool]:
    """(first block, verified header) of each record a batch file still holds, in file order, and whether
    the walk reached the file's end: a header that fails verification or a record past the end stops it
    (nothing after it can be located), as a crash before the file's flush leaves it."""
    found: List[Tuple[int, cf.ChunkHeader]] = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        at = 0
        while at < st.st_size:
            try:
                at = os.lseek(fd, at, os.SEEK_DATA)  # past punched records
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only holes from here
                    return found, True
                raise
            at -= at % cf.ALIGN
            data = os.pread(fd, cf.HEADER_SIZE, at)
            if len(data) < cf.HEADER_SIZE:
                return found, False
            try:
                hdr = cf.parse_header(data, st.st_ino)
            except cf.CorruptChunk:
                return found, False
            if at + cf.HEADER_SIZE + hdr.payload_len > st.st_size:
                return found, False
            found.append((at // cf.ALIGN, hdr))
            at += record_blocks(hdr.payload_len) * cf.ALIGN
        return found, True
    finally:
        os.close(fd)


@dataclass
class ScannedFile:
    """What the scan made of one batch chunk file (or a temporary file of an older version)."""

    records: np.ndarray  # each record as a restart scan indexes it (tiers/stores/nvme/index.py RECORD)
    temps: int = 0  # temporary files removed (older versions wrote a batch under NAME.tmp, then renamed it)
    torn: int = 0  # files cut short by a crash, removed


def scan_files(root: str, record_dtype, writing: Container[int] = ()) -> Iterator[ScannedFile]:
    """Each batch chunk file under root, one at a time, as ScannedFile.  Files whose ids are in writing (being
    written by this run: its puts index them) are left alone; a file cut short is removed whole (its put was
    never acknowledged: acknowledgement follows the file's flush)."""
    top = os.path.join(root, TOP)
    try:
        subdirs = sorted(e.path for e in os.scandir(top) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return
    for sub in subdirs:
        with os.scandir(sub) as it:
            entries = list(it)
        for entry in entries:
            if entry.name.endswith(".tmp"):  # an older version's batch a crash cut short: never acknowledged
                yield ScannedFile(np.empty(0, dtype=record_dtype), temps=int(cf.unlink_quietly(entry.path)))
                continue
            file_id = parse_name(entry.name)
            if file_id is None or file_id in writing:
                continue
            try:
                mtime = int(entry.stat(follow_symlinks=False).st_mtime)
                found, whole = walk_records(entry.path)
            except OSError:
                continue
            if not whole and file_id not in writing:  # checked again: its put may have begun since the walk
                yield ScannedFile(np.empty(0, dtype=record_dtype), torn=int(cf.unlink_quietly(entry.path)))
                continue
            out = np.zeros(len(found), dtype=record_dtype)
            for i, (block, hdr) in enumerate(found):
                digest = key_digest(hdr.namespace, hdr.key)
                out[i] = (digest & _LOW64, digest >> 64, namespace_hash(hdr.namespace),
                          record_blocks(hdr.payload_len) * cf.ALIGN, mtime, file_id, block)
            if not len(found):  # every record was punched out, the file's removal cut short
                cf.unlink_quietly(entry.path)
            yield ScannedFile(out)
