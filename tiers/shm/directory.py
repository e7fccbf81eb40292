"""The page directory of a DRAM arena: engines read hits through it without a round trip to the daemon.

The DRAM daemon keeps, in a sealed memfd beside its arena, where each page
it holds lies: a table from (namespace number, key digest) to the page's
size, checksum and first block, and for every block of the arena the page
that owns it and the block after it (tiers/_directory.c says the layout and
why a reader can trust what it checked).  Engines map it read-only with the
arena (tiers/wire/attachment.py).  A read then finds its pages, copies them
out of the arena into the host pool, and checks afterwards that no block
changed hands meanwhile; a page that did, or that it did not find, is asked
of the daemon as before.  The daemon learns of those reads afterwards
(``touch``: recency, read counts, hits), never on the read's way.

Writer (``PageDirectory``): the daemon, under its store's lock.  Readers
(``DirectoryView``): any engine that maps the arena, without locks.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tiers.shm.arena import seal_against_writes
from tiers.shm.buffers import address_of
from tiers.shm.page_runs import PageRuns, copy_pages


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    """The compiled directory, loaded once a process."""
    from importlib.util import find_spec
    spec = find_spec("tiers._directory")
    if spec is None or not spec.origin:
        raise ImportError("tiers._directory is not built; install the package with pip (scripts/install.sh)")
    dll = ctypes.CDLL(spec.origin)
    vp, u32, i64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64
    dll.dir_bytes.argtypes, dll.dir_bytes.restype = [u32, u32], ctypes.c_uint64
    dll.dir_init.argtypes, dll.dir_init.restype = [vp, u32, u32, u32], None
    # A commit passes its arrays by address too (made here contiguous and of the right type): a full tier's
    # page-by-page commits (policies that may evict a page just inserted) spent most of their ~15 us in them.
    dll.dir_publish.argtypes = [vp, u32, i64, ctypes.c_char_p, vp, vp, vp, vp, vp]
    dll.dir_publish.restype = i64
    dll.dir_withdraw.argtypes, dll.dir_withdraw.restype = [vp, u32, i64, ctypes.c_char_p], i64
    dll.dir_count.argtypes, dll.dir_count.restype = [vp], i64
    dll.dir_check.argtypes, dll.dir_check.restype = [vp, ctypes.c_uint64, ctypes.c_uint64], ctypes.c_int
    # A read passes its scratch arrays by address (_Scratch): ndpointer's checks cost ~3 us an argument.
    dll.dir_resolve.argtypes = [vp, u32, i64, ctypes.c_char_p, u32, vp, vp, vp, i64, vp, vp, vp, i64]
    dll.dir_resolve.restype = i64
    dll.dir_validate.argtypes, dll.dir_validate.restype = [vp, i64, vp, u32, vp, vp], i64
    dll.dir_held.argtypes, dll.dir_held.restype = [vp, u32, i64, ctypes.c_char_p, ctypes.c_char_p], i64
    return dll


def slots_for(n_blocks: int) -> int:
    """Table slots for an arena of n_blocks: a power of two, at least twice the blocks (never half full)."""
    return 1 << max(10, (2 * max(1, n_blocks) - 1).bit_length())


class PageDirectory:
    """The daemon's side: a sealed memfd it writes, engines map read-only."""

    def __init__(self, n_blocks: int, block_size: int, name: str):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.n_slots = slots_for(n_blocks)
        self.size = int(lib().dir_bytes(n_blocks, self.n_slots))
        self.fd = os.memfd_create(f"hicache-{name}-directory", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        self._map = mmap.mmap(self.fd, self.size)
        with memoryview(self._map) as view:
            self._base = address_of(view)
        lib().dir_init(self._base, n_blocks, self.n_slots, block_size)
        # Only this mapping, made before the seal, can write it: an engine cannot map it writable.  Where the
        # kernel cannot seal writes, no directory is handed out (export_fd says None).
        self.write_sealed = seal_against_writes(self.fd)
        self._namespaces: Dict[str, int] = {}
        self._next_namespace = 1

    def namespace_id(self, namespace: str) -> int:
        """The number the directory files namespace under (given on first use, never reused)."""
        number = self._namespaces.get(namespace)
        if number is None:
            number = self._namespaces[namespace] = self._next_namespace
            self._next_namespace += 1
        return number

    def namespaces(self) -> List[str]:
        return list(self._namespaces)

    def forget_namespace(self, namespace: str) -> None:
        """namespace holds nothing any more: its number goes (an engine holding it then misses, and asks)."""
        self._namespaces.pop(namespace, None)

    def publish(self, namespace: str, digests: bytes, sizes: Sequence[int], checksums: Sequence[int],
                extents: Sequence[Sequence[Tuple[int, int]]]) -> int:
        """The pages (16-byte digests packed, their sizes, checksums, and each page's (offset, length) runs
        of the arena in order: a run a page in adjacent blocks), found from now on."""
        n = len(sizes)
        if not n:
            return 0
        if len(digests) != 16 * n or len(checksums) != n or len(extents) != n:
            raise ValueError("a digest, a checksum and the runs of each page")
        counts = np.fromiter(map(len, extents), dtype=np.int64, count=n)
        runs = np.array([run for page in extents for run in page], dtype=np.uint64).reshape(-1, 2)
        offsets, lengths = np.ascontiguousarray(runs[:, 0]), np.ascontiguousarray(runs[:, 1])
        sizes_u32 = np.ascontiguousarray(sizes, dtype=np.uint32)
        sums_u64 = np.ascontiguousarray(checksums, dtype=np.uint64)
        return int(lib().dir_publish(self._base, self.namespace_id(namespace), n, digests, sizes_u32.ctypes.data,
                                     sums_u64.ctypes.data, offsets.ctypes.data, lengths.ctypes.data,
                                     counts.ctypes.data))

    def withdraw(self, namespace: str, digests: bytes) -> int:
        """The pages are no longer found; their blocks are no longer theirs (call before reusing them)."""
        number = self._namespaces.get(namespace)
        if number is None or not digests:
            return 0
        return int(lib().dir_withdraw(self._base, number, len(digests) // 16, digests))

    def count(self) -> int:
        return int(lib().dir_count(self._base))

    def export_fd(self) -> Optional[int]:
        """A descriptor to hand an engine (the caller closes it); None where it could not be sealed."""
        return os.dup(self.fd) if self.write_sealed else None

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class DirectoryView:
    """An engine's read-only mapping of a daemon's page directory, read beside that daemon's arena."""

    def __init__(self, mapping: mmap.mmap, arena_size: int):
        self._mapping = mapping
        with memoryview(mapping) as view:
            self._base = address_of(view)
        if lib().dir_check(self._base, len(mapping), arena_size) != 0:
            raise ValueError("not a page directory of this version, or larger than it says")
        header = np.frombuffer(mapping, dtype=np.uint32, count=6, offset=8)
        self.block_size = int(header[3])

    def held(self, namespace_id: int, digests: bytes) -> bytes:
        """One byte a key (16-byte digests packed): 1 when the directory has the page (nothing is read)."""
        n = len(digests) // 16
        out = ctypes.create_string_buffer(n)
        if namespace_id:
            lib().dir_held(self._base, namespace_id, n, digests, out)
        return out.raw

    def read(self, namespace_id: int, digests: bytes, size: int, dst: PageRuns, arena_base: int,
             summed: bool) -> Tuple[List[bool], List[int], List[int]]:
        """The pages found (each of size bytes), copied from the arena at arena_base into the pages of dst:
        (a flag a page that was found and copied whole, each page's checksum as the directory has it, each
        copied page's own sum when summed, else []).  MemoryFault propagates (a bad destination)."""
        n = len(dst)
        if not n or not namespace_id:
            return [False] * n, [0] * n, []
        per_page = -(-size // self.block_size)
        work = _scratch(n, per_page)
        found = int(lib().dir_resolve(self._base, namespace_id, n, digests, size, work.at_ids, work.at_sums,
                                      work.at_blocks, n * per_page, work.at_off, work.at_len, work.at_counts,
                                      n * per_page))
        if found <= 0:
            return [False] * n, [0] * n, []
        hit = work.ids != 0
        runs = int(work.counts.sum())
        counts = work.counts if found == n else work.counts[hit]
        src = PageRuns(work.off[:runs], work.length[:runs], counts)
        copied = copy_pages(dst if found == n else dst.select(hit), src, arena_base, summed)
        lib().dir_validate(self._base, n, work.at_ids, size, work.at_blocks, work.at_ok)
        flags = work.ok.view(bool).tolist()
        sums = (work.sums * work.ok).tolist()
        if summed and found < n:
            it = iter(copied)
            copied = [next(it) if h else 0 for h in hit.tolist()]
        return flags, sums, copied

    def close(self) -> None:
        self._mapping.close()


class _Scratch:
    """A read's arrays for n pages of per_page blocks, and their addresses (reused by the thread)."""

    def __init__(self, n: int, per_page: int):
        self.key = (n, per_page)
        self.ids, self.sums = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
        self.blocks = np.zeros(n * per_page, dtype=np.uint32)
        self.off, self.length = np.zeros(n * per_page, dtype=np.uint64), np.zeros(n * per_page, dtype=np.uint64)
        self.counts = np.zeros(n, dtype=np.int64)
        self.ok = np.zeros(n, dtype=np.uint8)
        self.at_ids, self.at_sums, self.at_blocks = self.ids.ctypes.data, self.sums.ctypes.data, self.blocks.ctypes.data
        self.at_off, self.at_len = self.off.ctypes.data, self.length.ctypes.data
        self.at_counts = self.counts.ctypes.data
        self.at_ok = self.ok.ctypes.data


_local = threading.local()  # each reading thread's last _Scratch (a prefetch thread reads one shape)


def _scratch(n: int, per_page: int) -> _Scratch:
    work = getattr(_local, "scratch", None)
    if work is None or work.key != (n, per_page):
        work = _local.scratch = _Scratch(n, per_page)
    return work
