"""Where a batch of pages lives in SGLang's host pool, as descriptors or views.

``pool.get_page_buffer_meta(host_indices)`` gives each page's regions as raw
pointers (page_first: K and V, 2 regions a page; layer_first: 2 x layers).
When the pool lives in a memfd (``"allocator": "shm"``), pointers become
(offset, length) pairs into that memfd, which the daemon maps once; otherwise
they become zero-copy memoryviews that ride as ZeroMQ frames.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from tiers.shm.buffers import view_at
from tiers.shm.page_runs import PageRuns
from tiers.wire import protocol as P

log = logging.getLogger("hicache.backend")


@dataclass
class PageBatch:
    """The pages of one call: keys, their regions, and bytes moved."""

    keys: List[str]
    offsets: Optional[np.ndarray]  # [pages, regions] offsets in the memfd, None without shm
    pointers: np.ndarray  # [pages, regions] process addresses
    lengths: np.ndarray  # [pages, regions]

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def subset(self, indices: Sequence[int]) -> "PageBatch":
        idx = np.asarray(indices, dtype=np.int64)
        return PageBatch([self.keys[i] for i in indices],
                         None if self.offsets is None else self.offsets[idx], self.pointers[idx], self.lengths[idx])

    def descriptors(self):
        """(desc, regions_per_page) for a shared-memory transfer."""
        return P.encode_descriptor_arrays(self.offsets, self.lengths)

    def page_runs(self) -> PageRuns:
        """Each page's regions in this process, as the arrays a copy takes."""
        return PageRuns.uniform(self.pointers, self.lengths)

    def views(self) -> List[List[memoryview]]:
        """Zero-copy views of each page's regions in this process."""
        out = []
        for ptrs, lens in zip(self.pointers.tolist(), self.lengths.tolist()):
            out.append([view_at(p, n) for p, n in zip(ptrs, lens)])
        return out


def page_buffer_meta(pool, indices):
    """SGLang's ``pool.get_page_buffer_meta``, plus the ``page_unified`` layout.

    0.5.23 ships page_unified pools whose get_page_buffer_meta raises; their
    buffer is page-major with one contiguous block a page
    (``page_unified_layout.bytes_per_page``), so each page is one region.
    """
    if getattr(pool, "layout", None) == "page_unified":
        page_size = int(pool.page_size)
        block = int(pool.page_unified_layout.bytes_per_page)
        base = pool.kv_buffer.data_ptr()
        firsts = indices[::page_size].tolist()
        return [base + (slot // page_size) * block for slot in firsts], [block] * len(firsts)
    return pool.get_page_buffer_meta(indices)


class HostPoolView:
    """Address arithmetic over one registered host pool."""

    def __init__(self, pool, head_split: int = 0):
        self.pool = pool
        self.page_size = int(pool.page_size)
        # > 0: each page is head_split (K, V) shard pairs (hicache_ext/head_shards.py)
        self.head_split = head_split
        self.memfd: Optional[int] = None
        self.memfd_count = 0  # memfds the pool's allocator holds (page_first_kv_split: one per buffer)
        self.memfd_base = 0
        self.memfd_size = 0
        self._page_bytes: Optional[int] = None
        self._find_memfd()

    def _find_memfd(self) -> None:
        allocator = getattr(self.pool, "allocator", None)
        fds = list(getattr(allocator, "fds", []) or [])
        mms = list(getattr(allocator, "mms", []) or [])
        self.memfd_count = len(fds)
        if len(fds) != 1 or len(mms) != 1:
            return  # no memfd, or several mappings: pages travel as frames
        mm = mms[0]
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            base = ctypes.addressof(anchor)
            del anchor  # release the export at once; the mapping stays
        except (TypeError, ValueError, BufferError):
            return
        self.memfd, self.memfd_base, self.memfd_size = fds[0], base, len(mm)

    def page_bytes(self) -> int:
        """Bytes of one page of this pool (all its regions)."""
        if self._page_bytes is None:
            import torch
            _, sizes = page_buffer_meta(self.pool, torch.arange(self.page_size, dtype=torch.int64))
            self._page_bytes = int(sum(sizes))
        return self._page_bytes

    def batch(self, keys: List[str], host_indices) -> PageBatch:
        """The regions of the pages starting at host_indices[i * page_size].

        Split by heads, ``keys`` are shard keys (head_split per page) and each
        shard is one (K, V) pair of the page.
        """
        n = len(keys)
        pages = n // self.head_split if self.head_split else n
        if len(host_indices) != pages * self.page_size or (self.head_split and n % self.head_split):
            raise ValueError(f"{len(host_indices)} host slots for {n} keys of {self.page_size}-slot pages")
        if self.head_split:
            ptrs, sizes = self.pool.get_split_heads_page_buffer_meta(host_indices, self.head_split)
        else:
            ptrs, sizes = page_buffer_meta(self.pool, host_indices)
        pointers = np.asarray(ptrs, dtype=np.int64)
        lengths = np.asarray(sizes, dtype=np.int64)
        if n == 0 or pointers.size % n:
            raise ValueError("page buffer meta does not split evenly into pages")
        pointers = pointers.reshape(n, -1)
        lengths = lengths.reshape(n, -1)
        offsets = None
        if self.memfd is not None:
            rel = pointers - self.memfd_base
            if rel.min() >= 0 and int((rel + lengths).max()) <= self.memfd_size:
                offsets = rel
        return PageBatch(list(keys), offsets, pointers, lengths)
