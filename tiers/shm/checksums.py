"""The end-to-end page checksum: xxh3_64 of a page's bytes, its regions in order (hicache_ext/page_sums.py).

Writers send it, tiers keep it, readers check it.  A batch is hashed in one C
call without the GIL (tiers/_guardcopy.c, built where xxhash.h was found),
given as addresses and lengths; a copy between a host pool and an arena
hashes each page right after copying it, while it is still in the cache
(tiers/shm/page_runs.py).  Hashing page by
page from Python costs a GIL hand-over a page: in a serving engine, whose
scheduler thread spins on the GIL, that was 0.4-2.9 ms for 128 pages.  Where
the C functions are not built, the same sums come from python-xxhash.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import xxhash

from tiers.shm.buffers import MemoryFault, guarded, in_halves, view_at

__all__ = ["page_sums", "page_sums_at", "native"]


def native() -> bool:
    """True when batches are hashed in C (tiers._guardcopy built with xxhash.h)."""
    return guarded().sums_built


def page_sums(pages: Sequence[Sequence]) -> List[int]:
    """The checksum of each page, given as the buffers that concatenate to it."""
    out = []
    for page in pages:
        if len(page) == 1:
            out.append(xxhash.xxh3_64_intdigest(page[0]))
            continue
        h = xxhash.xxh3_64()
        for part in page:
            h.update(part)
        out.append(h.intdigest())
    return out


def page_sums_at(pointers: np.ndarray, lengths: np.ndarray) -> List[int]:
    """The checksum of each page whose regions are at pointers[p] (addresses of this process) with lengths[p].

    pointers and lengths are [pages, regions] arrays (every page has the same regions, as in a host pool).
    MemoryFault when a region went away during the hash.
    """
    if not len(pointers):
        return []
    pointers = np.ascontiguousarray(pointers, dtype=np.uint64).reshape(len(pointers), -1)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint64).reshape(pointers.shape)
    pages, regions = pointers.shape
    # A large batch hashed in two halves at once (a write's sums come before its put: the whole wait).
    return in_halves(lambda a, b: sums_flat(pointers[a:b].ravel(), lengths[a:b].ravel(),
                                             np.full(b - a, regions, dtype=np.int64)),
                     pages, int(lengths.sum()))


def sums_flat(ptrs: np.ndarray, lens: np.ndarray, runs: np.ndarray) -> List[int]:
    """The checksum of each page p, the next runs[p] regions of (ptrs, lens): one C call, or python-xxhash."""
    if not native():
        ends = np.cumsum(runs).tolist()
        flat = list(zip(ptrs.tolist(), lens.tolist()))
        return page_sums([[view_at(a, n) for a, n in flat[end - count:end]] for end, count in zip(ends, runs.tolist())])
    out = np.zeros(len(runs), dtype=np.uint64)
    done = guarded().sums(ptrs, lens, runs, out)
    if done != len(runs):
        raise MemoryFault(f"a hashed region went away (page {done} of {len(runs)}; truncated memfd?)")
    return out.tolist()
