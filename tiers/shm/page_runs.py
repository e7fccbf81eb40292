"""A batch of pages as flat arrays of (address, length) runs, and the one guarded copy between two batches.

A page of an engine's host pool is one or more regions (a run each: per
layer, or K and V apart); a page in an arena is one or more runs of blocks.
A list of lists of tuples a page cost ~1 us a page to build, and as much
again to flatten into arrays for C; at 64 KiB pages (a 5 us copy) that was
most of a batch.  ``PageRuns`` keeps a batch as three arrays from the wire
or the host pool's own tensors to the C copy, which cuts, copies and
(optionally) hashes every page of a batch in one call without the GIL
(tiers/_guardcopy.c ``guarded_copy_pages``).
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from tiers.shm.buffers import MemoryFault, copy_runs, guarded, in_halves, scatter_runs, view_at
from tiers.shm.checksums import page_sums, sums_flat


class PageRuns(NamedTuple):
    """Page p is the next counts[p] runs of (addr, length): addresses of this process, or offsets from a
    base the copy is given."""

    addr: np.ndarray  # uint64 [runs]
    length: np.ndarray  # uint64 [runs]
    counts: np.ndarray  # int64 [pages]

    @classmethod
    def of_lists(cls, pages: Sequence[Sequence[Tuple[int, int]]], base: int = 0) -> "PageRuns":
        """From a list of (address, length) runs a page (callers that still hold lists)."""
        counts = np.fromiter(map(len, pages), dtype=np.int64, count=len(pages))
        flat = np.array([run for page in pages for run in page], dtype=np.uint64).reshape(-1, 2)
        addr = flat[:, 0] + np.uint64(base) if base else flat[:, 0].copy()
        return cls(addr, flat[:, 1].copy(), counts)

    @classmethod
    def uniform(cls, addresses: np.ndarray, lengths: np.ndarray) -> "PageRuns":
        """From [pages, regions] arrays (every page the same number of regions: a host pool's layout)."""
        pages = addresses.shape[0]
        per_page = addresses.shape[1] if addresses.ndim > 1 else 1
        return cls(np.ascontiguousarray(addresses, dtype=np.uint64).reshape(-1),
                   np.ascontiguousarray(lengths, dtype=np.uint64).reshape(-1),
                   np.full(pages, per_page, dtype=np.int64))

    def __len__(self) -> int:  # pages
        return len(self.counts)

    def sizes(self) -> List[int]:
        """Each page's bytes."""
        if not len(self.counts):
            return []
        lengths = self.length.astype(np.int64)  # int64 throughout: uint64 mixed with int64 turns to float64
        if bool((self.counts == self.counts[0]).all()) and self.counts[0] > 0:
            return lengths.reshape(len(self.counts), -1).sum(axis=1).tolist()
        ends = np.cumsum(self.counts)
        sums = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(lengths)))
        return (sums[ends] - sums[ends - self.counts]).tolist()

    def nbytes(self) -> int:
        return int(self.length.sum())

    def pages(self, start: int, stop: int) -> "PageRuns":
        """Pages [start, stop), views of these arrays."""
        first = int(self.counts[:start].sum())
        last = first + int(self.counts[start:stop].sum())
        return PageRuns(self.addr[first:last], self.length[first:last], self.counts[start:stop])

    def take(self, indices: Sequence[int]) -> "PageRuns":
        """Pages at these increasing positions, in order (views when they are one range)."""
        if not len(indices):
            return self.pages(0, 0)
        if indices[-1] - indices[0] + 1 == len(indices):
            return self.pages(indices[0], indices[-1] + 1)
        keep = np.zeros(len(self.counts), dtype=bool)
        keep[np.asarray(indices, dtype=np.int64)] = True
        return self.select(keep)

    def select(self, keep: Sequence[bool]) -> "PageRuns":
        """The pages whose flag is set, in order."""
        flags = np.asarray(keep, dtype=bool)
        if flags.all():
            return self
        runs = np.repeat(flags, self.counts)
        return PageRuns(self.addr[runs], self.length[runs], self.counts[flags])

    def whole_pages(self) -> bool:
        """Every page is one piece of memory: its runs (one, or several end to end) are contiguous."""
        if not len(self.counts) or not bool((self.counts > 0).all()):
            return False
        if bool((self.counts == 1).all()):
            return True
        joined = self.addr[:-1] + self.length[:-1] == self.addr[1:]  # run j ends where run j + 1 starts
        joined[np.cumsum(self.counts)[:-1] - 1] = True  # a page's last run need not join the next page's first
        return bool(joined.all())

    def aligned(self, base: int, align: int) -> bool:
        """Every run starts (at base + addr) and ends on an align boundary (a device may read it directly)."""
        a, n = np.uint64(align), np.uint64(base)
        return bool(len(self.addr)) and not ((self.addr + n) % a).any() and not (self.length % a).any()

    def sums(self, base: int = 0) -> List[int]:
        """Each page's xxh3_64, read in place (guarded: MemoryFault when its memory went away)."""
        return sums_flat(self.addr + np.uint64(base), self.length, self.counts) if len(self.counts) else []

    def as_lists(self, base: int = 0) -> List[List[Tuple[int, int]]]:
        flat = list(zip((self.addr + np.uint64(base)).tolist(), self.length.tolist()))
        out, start = [], 0
        for n in self.counts.tolist():
            out.append(flat[start:start + n])
            start += n
        return out


def copy_pages(dst: PageRuns, src: PageRuns, src_base: int = 0, summed: bool = False) -> List[int]:
    """Copy page p of src (offsets from src_base) into page p of dst, every page of the batch, guarded;
    with summed, each page's xxh3_64 at dst, hashed right after its copy (else []).

    A large batch runs in two halves at once (in_halves).  ValueError when the batches differ in pages
    or a page in size (nothing is copied then); MemoryFault when memory went away under the copy."""
    if len(dst) != len(src):
        raise ValueError("page count mismatch")
    if not len(dst):
        return []
    return in_halves(lambda a, b: _copy_some(dst.pages(a, b), src.pages(a, b), src_base, summed), len(dst),
                     dst.nbytes())


def _copy_some(dst: PageRuns, src: PageRuns, src_base: int, summed: bool) -> List[int]:
    guard = guarded()
    if not guard.pages_built or (summed and not guard.sums_built):
        return _copy_slow(dst, src, src_base, summed)
    sums = np.zeros(len(dst), dtype=np.uint64) if summed else None
    done = guard.copy_pages(dst.addr, dst.length, dst.counts, src.addr, src.length, src.counts, src_base, sums)
    if done == -1:
        raise ValueError("page size mismatch")
    if done != len(dst):
        raise MemoryFault(f"a copied region went away during the copy (page {done} of {len(dst)}; truncated memfd?)")
    return sums.tolist() if summed else []


def _copy_slow(dst: PageRuns, src: PageRuns, src_base: int, summed: bool) -> List[int]:
    """Where tiers._guardcopy is not built: cut page by page in Python, copy by process_vm_readv."""
    d_pages, s_pages = dst.as_lists(), src.as_lists(src_base)
    cuts = [scatter_runs(d, s) for d, s in zip(d_pages, s_pages)]  # ValueError on a size mismatch, before copying
    for d_at, s_at, n in cuts:
        copy_runs(d_at, s_at, n)
    return page_sums([[view_at(a, n) for a, n in page] for page in d_pages]) if summed else []
