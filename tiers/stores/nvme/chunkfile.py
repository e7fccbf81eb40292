"""The on-disk chunk format and the blocking I/O that writes and reads it.

A chunk file is one 4 KiB header block followed by the payload::

    0   magic "HCKVCHNK"        8s      24  raw_len (page bytes)     Q
    8   format version           H      32  payload_len (on disk)    Q
    10  codec id                 B      40  xxh3_64 of the payload   Q
    11  flags                    B      48  namespace, then key (UTF-8)
    12  header size (4096)       I      ... zero padding
    16  namespace length         H      4080 page checksum (flag 1)    Q
    18  key length               H      4088 xxh3_64 of bytes 0..4087  Q
    20  reserved (0)             I

The header fills a whole block so the payload starts aligned: O_DIRECT can
move it straight between the disk and the caller's buffers.  Every byte of the
header is covered by its own checksum and every payload byte by the payload
checksum, so a torn, truncated, bit-flipped or misplaced file is detected.

Flag 1 (FLAG_PAGE_SUM): the writer's end-to-end checksum of the raw page
(xxh3_64, tiers/wire/protocol.py ``sums``) is at 4080; for an uncompressed
page it equals the payload checksum.  Files without the flag (written before
it, or for a writer that sent none) have no known page checksum (0); a
reader that predates the flag ignores both, so the version stays 1.
"""
from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence

import xxhash

from tiers.shm.buffers import address_of

MAGIC = b"HCKVCHNK"
VERSION = 1
HEADER_SIZE = 4096
ALIGN = 4096  # O_DIRECT alignment of addresses, offsets and lengths
_FIXED = struct.Struct("<8sHBBIHHIQQQ")
_SUM_AT = HEADER_SIZE - 8
_PAGE_SUM_AT = HEADER_SIZE - 16
FLAG_PAGE_SUM = 1
_ZEROS = bytes(HEADER_SIZE)
IOV_MAX = 1024  # Linux limit on buffers per preadv/pwritev call
O_DIRECT = getattr(os, "O_DIRECT", 0)


class CorruptChunk(Exception):
    """A chunk file that fails verification; ino names the file that was read."""

    def __init__(self, reason: str, ino: int = 0):
        super().__init__(reason)
        self.ino = ino


class SizeMismatch(Exception):
    """A sound chunk whose page size differs from the caller's buffers."""


@dataclass
class ChunkHeader:
    codec: int
    raw_len: int
    payload_len: int
    payload_hash: int
    namespace: str
    key: str
    page_sum: int = 0  # the writer's checksum of the raw page (0: unknown)


_local = threading.local()


def header_block(slot: str = "read") -> memoryview:
    """This thread's page-aligned header buffer for slot ("read" or "write").

    mmap memory is page-aligned, as O_DIRECT needs.  Writers use their own slot
    because an eviction callback may read a chunk while a header waits to be written.
    """
    blocks = getattr(_local, "blocks", None)
    if blocks is None:
        blocks = _local.blocks = {}
    block = blocks.get(slot)
    if block is None:
        block = blocks[slot] = memoryview(mmap.mmap(-1, HEADER_SIZE))
    return block


def pack_header(block: memoryview, namespace: str, key: str, codec: int, raw_len: int,
                payload_len: int, payload_hash: int, page_sum: int = 0) -> memoryview:
    """Fill block with a header and return it."""
    ns_b, key_b = namespace.encode(), key.encode()
    end = _FIXED.size + len(ns_b) + len(key_b)
    if end > _PAGE_SUM_AT:
        raise ValueError("namespace and key too long for the header")
    block[:] = _ZEROS
    _FIXED.pack_into(block, 0, MAGIC, VERSION, codec, FLAG_PAGE_SUM if page_sum else 0, HEADER_SIZE, len(ns_b),
                     len(key_b), 0, raw_len, payload_len, payload_hash)
    block[_FIXED.size:end] = ns_b + key_b
    struct.pack_into("<Q", block, _PAGE_SUM_AT, page_sum)
    struct.pack_into("<Q", block, _SUM_AT, xxhash.xxh3_64_intdigest(block[:_SUM_AT]))
    return block


def parse_header(block, ino: int = 0) -> ChunkHeader:
    """Decode and verify a header block (CorruptChunk when anything is off)."""
    if len(block) < HEADER_SIZE:
        raise CorruptChunk("short header", ino)
    (stored_sum,) = struct.unpack_from("<Q", block, _SUM_AT)
    if xxhash.xxh3_64_intdigest(block[:_SUM_AT]) != stored_sum:
        raise CorruptChunk("header checksum mismatch", ino)
    magic, version, codec, flags, size, ns_len, key_len, _r, raw_len, payload_len, phash = \
        _FIXED.unpack_from(block, 0)
    if magic != MAGIC or version != VERSION or size != HEADER_SIZE:
        raise CorruptChunk("bad magic, version or header size", ino)
    if codec == 0 and payload_len != raw_len:
        raise CorruptChunk("raw payload length differs from page length", ino)
    page_sum = struct.unpack_from("<Q", block, _PAGE_SUM_AT)[0] if flags & FLAG_PAGE_SUM else 0
    if codec == 0 and page_sum and page_sum != phash:
        raise CorruptChunk("page checksum differs from the payload checksum", ino)
    names = bytes(block[_FIXED.size:_FIXED.size + ns_len + key_len])
    try:
        namespace, key = names[:ns_len].decode(), names[ns_len:].decode()
    except UnicodeDecodeError:
        raise CorruptChunk("undecodable key", ino) from None
    return ChunkHeader(codec, raw_len, payload_len, phash, namespace, key, page_sum)


def payload_hash(views: Sequence) -> int:
    """xxh3_64 of the concatenation of views."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def is_aligned(views: Sequence[memoryview]) -> bool:
    """True when every view may be used for O_DIRECT (address and length aligned)."""
    for v in views:
        if v.nbytes % ALIGN or address_of(v) % ALIGN:
            return False
    return True


def _advance(views: List[memoryview], n: int) -> List[memoryview]:
    """Drop the first n bytes of a buffer list (after a short transfer)."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if n:
        views = [views[0][n:], *views[1:]]
    return views


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int = 0) -> int:
    """Write every byte of views at offset (loops over short writes and IOV_MAX)."""
    todo = [v for v in views if v.nbytes]
    written = 0
    while todo:
        n = os.pwritev(fd, todo[:IOV_MAX], offset + written)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        written += n
        todo = _advance(todo, n)
    return written


def preadv_all(fd: int, views: Sequence[memoryview], offset: int = 0) -> int:
    """Read into views from offset until they are full or the file ends; bytes read."""
    todo = [v for v in views if v.nbytes]
    done = 0
    while todo:
        n = os.preadv(fd, todo[:IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        todo = _advance(todo, n)
    return done


def write_file(path: str, views: Sequence[memoryview], fsync: bool, direct: bool) -> None:
    """Create path (must not exist) holding views; fdatasync when fsync.  Removes it on failure."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        pwritev_all(fd, views)
        if fsync:
            os.fdatasync(fd)  # data and the size that finds it; the name is synced with the directory
            if not direct:  # now clean: leave the page cache to others (what O_DIRECT would have done)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or create in directory path durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> bool:
    """Remove path; False when it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def read_chunk(path: str, namespace: str, key: str, dst: Sequence[memoryview], size: int,
               decode, direct: bool, block: Optional[int] = None) -> ChunkHeader:
    """Read and verify the chunk at path (a file of its own), or its record at 4 KiB block ``block`` of a
    batch chunk (tiers/stores/nvme/batch.py), into dst (size bytes in all).

    Raises FileNotFoundError, SizeMismatch (sound record, other page size) or
    CorruptChunk; dst may hold garbage after an exception.  ``decode`` is
    ``Codec.decode`` for compressed payloads.
    """
    in_batch = block is not None
    offset = block * ALIGN if in_batch else 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        st = os.fstat(fd)
        hdr_block = header_block()
        if st.st_size == HEADER_SIZE + size or (in_batch and st.st_size >= offset + HEADER_SIZE + size):
            # The common case, an uncompressed page: header and payload in one call.
            got = preadv_all(fd, [hdr_block, *dst], offset)
            hdr = parse_header(hdr_block, st.st_ino)
            if hdr.codec == 0:
                _check_identity(hdr, namespace, key, size, st, offset, in_batch)
                if got != HEADER_SIZE + size or payload_hash(dst) != hdr.payload_hash:
                    raise CorruptChunk("payload checksum mismatch", st.st_ino)
                return hdr
        else:
            if preadv_all(fd, [hdr_block], offset) != HEADER_SIZE:
                raise CorruptChunk("truncated header", st.st_ino)
            hdr = parse_header(hdr_block, st.st_ino)
        _check_identity(hdr, namespace, key, size, st, offset, in_batch)
        if hdr.codec == 0:
            raise CorruptChunk("file size does not match header", st.st_ino)
        if direct:  # our payload buffer is not aligned: read it through the page cache
            os.close(fd)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        payload = bytearray(hdr.payload_len)
        if preadv_all(fd, [memoryview(payload)], offset + HEADER_SIZE) != hdr.payload_len:
            raise CorruptChunk("truncated payload", st.st_ino)
        if xxhash.xxh3_64_intdigest(payload) != hdr.payload_hash:
            raise CorruptChunk("payload checksum mismatch", st.st_ino)
        try:
            decode(hdr.codec, payload, dst, size)
        except ValueError as exc:  # CodecError: checksum passed but the writer was broken
            raise CorruptChunk(f"undecodable payload: {exc}", st.st_ino) from None
        if hdr.page_sum and payload_hash(dst) != hdr.page_sum:  # the codec broke the page: never serve it
            raise CorruptChunk("decoded page checksum mismatch", st.st_ino)
        return hdr
    finally:
        os.close(fd)


def _check_identity(hdr: ChunkHeader, namespace: str, key: str, size: int, st: os.stat_result,
                    offset: int = 0, in_batch: bool = False) -> None:
    if hdr.namespace != namespace or hdr.key != key:
        raise CorruptChunk("file holds another key", st.st_ino)
    if (st.st_size < offset + HEADER_SIZE + hdr.payload_len if in_batch
            else st.st_size != HEADER_SIZE + hdr.payload_len):
        raise CorruptChunk("file size does not match header", st.st_ino)
    if hdr.raw_len != size:
        raise SizeMismatch(f"page is {hdr.raw_len} bytes, buffers hold {size}")


def read_header(path: str, block: Optional[int] = None) -> ChunkHeader:
    """The verified header of the chunk at path, or of its record at 4 KiB block ``block`` of a batch chunk
    (FileNotFoundError, CorruptChunk)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ino = os.fstat(fd).st_ino
        data = os.pread(fd, HEADER_SIZE, (block or 0) * ALIGN)
    finally:
        os.close(fd)
    return parse_header(data, ino)
