"""The page checksums hashed in C (tiers/shm/checksums.py): the same sums as python-xxhash, copies that
hash each page as they go, and a truncated mapping raising MemoryFault instead of killing the process."""
import mmap
import os
import random

import numpy as np
import pytest
import xxhash

from tiers.shm.buffers import MemoryFault, address_of
from tiers.shm.checksums import native, page_sums, page_sums_at
from tiers.shm.page_runs import PageRuns, copy_pages


def test_built_where_xxhash_h_is_installed():
    """install.sh installs libxxhash-dev; the build then compiles the hashing in (else sums come from Python)."""
    if not os.path.exists("/usr/include/xxhash.h"):
        pytest.skip("xxhash.h is not installed here (scripts/install-system-deps.sh installs it)")
    assert native()


def _pool(pages: int, regions: int, region: int, seed: int):
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, size=pages * regions * region, dtype=np.uint8)
    base = buf.ctypes.data
    # regions of a page lie apart, as in a layer-first host pool: region r of page p at (r * pages + p)
    pointers = np.array([[base + (r * pages + p) * region for r in range(regions)] for p in range(pages)],
                        dtype=np.uint64)
    return buf, pointers, np.full((pages, regions), region, dtype=np.uint64)


@pytest.mark.parametrize("regions", [1, 2, 16])
def test_sums_at_match_python_xxhash(regions):
    buf, pointers, lengths = _pool(pages=9, regions=regions, region=4096 + 64, seed=regions)
    mem = memoryview(buf)
    expected = []
    for p in range(9):
        h = xxhash.xxh3_64()
        for r in range(regions):
            start = int(pointers[p, r]) - buf.ctypes.data
            h.update(mem[start:start + int(lengths[p, r])])
        expected.append(h.intdigest())
    assert page_sums_at(pointers, lengths) == expected
    views = [[mem[int(a) - buf.ctypes.data:int(a) - buf.ctypes.data + int(n)] for a, n in zip(pp, ll)]
             for pp, ll in zip(pointers, lengths)]
    assert page_sums(views) == expected
    assert page_sums_at(pointers[:0], lengths[:0]) == []


@pytest.mark.parametrize("pages, region", [(12, 3000), (3, 300_007)])
def test_copy_hashes_each_page_as_copied(pages, region):
    """Pages copied out of an arena whose extents cut them differently than the destination's regions: the
    bytes land exactly, and each sum is the destination page's.  Every page is hashed a 4 KiB piece at a time
    while it is copied (non-temporal stores, after an unaligned head): the pieces cross the regions' and
    extents' bounds at odd places, and regions start at addresses of every alignment."""
    rng = random.Random(7)
    regions = 4
    dst_buf, pointers, lengths = _pool(pages, regions, region, seed=1)
    dst_buf[:] = 0
    page_bytes = regions * region
    arena = np.frombuffer(os.urandom(pages * page_bytes * 2), dtype=np.uint8).copy()
    extents = []  # each page in 1-3 arena pieces at random places
    spots = rng.sample(range(2 * pages), pages)
    for p in range(pages):
        start = spots[p] * page_bytes
        cut = sorted(rng.sample(range(1, page_bytes), rng.randint(0, 2)))
        bounds = [0] + cut + [page_bytes]
        extents.append([(start + a, b - a) for a, b in zip(bounds, bounds[1:])])
    sums = copy_pages(PageRuns.uniform(pointers, lengths), PageRuns.of_lists(extents), arena.ctypes.data,
                      summed=True)
    for p in range(pages):
        want = b"".join(arena[a:a + n].tobytes() for a, n in extents[p])
        got = b"".join(dst_buf[int(a) - dst_buf.ctypes.data:int(a) - dst_buf.ctypes.data + int(n)].tobytes()
                       for a, n in zip(pointers[p], lengths[p]))
        assert got == want
        assert sums[p] == xxhash.xxh3_64_intdigest(want)
    assert sums == page_sums_at(pointers, lengths)


def test_truncated_mapping_is_a_fault_not_a_crash():
    """A memfd someone truncated under our mapping (a hostile or buggy engine): hashing it, or copying and
    hashing it, raises MemoryFault."""
    fd = os.memfd_create("sums-truncated")
    try:
        os.ftruncate(fd, 1 << 20)
        mapping = mmap.mmap(fd, 1 << 20)
        view = memoryview(mapping)
        base = address_of(view)
        pointers = np.array([[base + i * 65536] for i in range(16)], dtype=np.uint64)
        lengths = np.full((16, 1), 65536, dtype=np.uint64)
        assert len(page_sums_at(pointers, lengths)) == 16
        target = np.zeros(1 << 20, dtype=np.uint8)
        into = PageRuns.uniform(pointers - np.uint64(base) + np.uint64(target.ctypes.data), lengths)
        assert copy_pages(into, PageRuns.uniform(pointers, lengths), summed=True) == page_sums_at(pointers, lengths)
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(MemoryFault):
            copy_pages(into, PageRuns.uniform(pointers, lengths))
        if native():
            with pytest.raises(MemoryFault):
                page_sums_at(pointers, lengths)
        view.release()
        mapping.close()
    finally:
        os.close(fd)
