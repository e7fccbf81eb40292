"""The NVMe tier's one-page reads: a chunk read and verified into the caller's buffers (or new bytes).

Readers take no stripe lock: a reader holding an open file keeps reading
that file's inode however it is renamed over or unlinked, and everything it
reads is verified.  A chunk that cannot be served is forgotten (its file
removed when it is still the one read); a read that fails for want of a
resource is a miss that keeps the page.  Batched gets read runs of records
(tiers/stores/nvme/batch_reads.py) and come here for the rest.
"""
from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from tiers.logs import RateLimitedLog
from tiers.shm.buffers import as_bytes_view
from tiers.stores.base import Buffers, PageKey, total_size
from tiers.stores.nvme import chunkfile as cf
from tiers.stores.nvme.batch_reads import TOUCH_INTERVAL
from tiers.stores.nvme.codec import Codec
from tiers.stores.nvme.layout import key_digest
from tiers.stores.nvme.entry import Entry
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.nvme.removal import Removal

# A read that fails for want of a resource says nothing about the page on disk: a miss, the page kept
# (forgetting it lost an acknowledged page to a moment without descriptors or memory).
_TRANSIENT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EBUSY,
                     errno.ENOBUFS)


@dataclass
class PageReadSource:
    """What one-page reads need of the store they read for."""

    name: str
    ledger: Ledger
    codec: Codec
    removal: Removal  # chunks that cannot be served are forgotten
    warn_once: RateLimitedLog  # each kind once per store
    rlog: RateLimitedLog
    direct: Callable[[], bool]  # O_DIRECT now (a device that refused it turns it off)
    refuse_direct: Callable[[], None]  # the device refused O_DIRECT: buffered I/O from now on


class PageReads:
    def __init__(self, source: PageReadSource):
        self.s = source

    def get_into(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        """The page into buffers: its checksum (0: unknown), None on a miss."""
        dst = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
        size = total_size(dst)
        digest = key_digest(*key)
        entry = self.s.ledger.get(digest)
        if entry is None or size == 0 or (entry.raw_size is not None and entry.raw_size != size):
            self.s.ledger.miss()
            return None
        return self._read(key, digest, entry, dst, size)

    def get_bytes(self, key: PageKey) -> Tuple[Optional[bytearray], int]:
        """The page as new bytes and its checksum; (None, 0) on a miss."""
        digest = key_digest(*key)
        entry = self.s.ledger.get(digest)
        if entry is None:
            self.s.ledger.miss()
            return None, 0
        size = entry.raw_size
        if size is None:  # rebuilt entry of unknown page size: its header says
            try:
                size = cf.read_header(entry.path, entry.record_block).raw_len
            except (OSError, cf.CorruptChunk):
                size = 0  # _read finds the same fault, reports it and cleans up
        buf = bytearray(size)
        checksum = self._read(key, digest, entry, [memoryview(buf)], size)
        return (buf, checksum) if checksum is not None else (None, 0)

    def _read(self, key: PageKey, digest: int, entry: Entry, dst: List[memoryview], size: int) -> Optional[int]:
        """Read and verify the chunk into dst: the page's checksum (0: unknown), None on a miss."""
        s = self.s
        direct = s.direct() and cf.is_aligned(dst)
        try:
            hdr = cf.read_chunk(entry.path, key[0], key[1], dst, size, s.codec.decode, direct, entry.record_block)
        except FileNotFoundError:
            s.removal.forget(digest, entry, None, "file vanished")
            s.ledger.miss()
            return None
        except cf.SizeMismatch:
            s.ledger.miss()
            return None
        except cf.CorruptChunk as exc:
            s.removal.forget(digest, entry, exc.ino, str(exc))
            s.ledger.miss()
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL and direct:
                s.warn_once.warning("einval-read", "%s: O_DIRECT read refused (%s); buffered I/O from now on",
                                    s.name, exc.strerror)
                s.refuse_direct()
                return self._read(key, digest, entry, dst, size)
            s.rlog.warning("read", "%s: reading %s: %s", s.name, entry.path, exc.strerror)
            if exc.errno in _TRANSIENT_ERRNOS:
                s.ledger.miss(read_error=True)
                return None
            s.removal.forget(digest, entry, None, exc.strerror or "I/O error")
            s.ledger.miss(read_error=True)
            return None
        if s.ledger.hit(digest, entry, key[0], hdr.raw_len, time.monotonic(), TOUCH_INTERVAL):
            try:
                os.utime(entry.path)  # the mtime is the recency a restart rebuilds from
            except OSError:
                pass
        return hdr.page_sum
