"""A batch copy: every page of a batch cut, copied (and hashed) in one C call (tiers/shm/page_runs.py
copy_pages), and the two halves a large batch is copied in at once (in_halves).

Every copy between a host pool and an arena is one such call; a wrong cut
copies the wrong bytes into another tenant's page, so it is held to the
page-by-page reference (scatter_runs, the Python path where the C copy is not
built) on random run layouts in real memory, byte for byte.
"""

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.shm import buffers
from tiers.shm.buffers import copy_runs, scatter_runs
from tiers.shm.page_runs import PageRuns, _copy_slow, copy_pages

SPAN = 1 << 16  # bytes of each side's buffer: the runs of a layout lie apart inside it


@st.composite
def layouts(draw):
    """Pages as (dst runs, src runs) of equal totals, each side cut at random places; runs as offsets into
    a buffer of SPAN bytes a side, in a random order and never overlapping."""
    pages = []
    for _ in range(draw(st.integers(1, 6))):
        total = draw(st.integers(1, 512))
        sides = []
        for _side in range(2):
            cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=4)))) if total > 1 else []
            bounds = [0, *cuts, total]
            sides.append([b - a for a, b in zip(bounds, bounds[1:])])
        pages.append(sides)
    placed = []
    for side in range(2):
        lengths = [n for page in pages for n in page[side]]
        slots = draw(st.permutations(range(len(lengths))))  # the runs' order in the buffer
        offsets, at = [0] * len(lengths), 0
        for slot in slots:
            offsets[slot] = at
            at += lengths[slot] + draw(st.integers(0, 64))
        it = iter(zip(offsets, lengths))
        placed.append([[next(it) for _n in page[side]] for page in pages])
    return placed[0], placed[1]


def _buffers(seed: int):
    src = np.random.default_rng(seed).integers(0, 256, SPAN, dtype=np.uint8)
    return src, np.zeros(SPAN, dtype=np.uint8)


def _page_bytes(buf: np.ndarray, runs) -> bytes:
    return b"".join(buf[o:o + n].tobytes() for o, n in runs)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.booleans())
def test_each_page_lands_in_its_own_runs_as_the_page_by_page_copy_puts_it(layout, summed):
    dst, src = layout
    source, target = _buffers(1)
    reference = np.zeros(SPAN, dtype=np.uint8)
    d_at = [[(target.ctypes.data + o, n) for o, n in page] for page in dst]
    r_at = [[(reference.ctypes.data + o, n) for o, n in page] for page in dst]
    sums = copy_pages(PageRuns.of_lists(d_at), PageRuns.of_lists(src), source.ctypes.data, summed)
    ref_sums = _copy_slow(PageRuns.of_lists(r_at), PageRuns.of_lists(src), source.ctypes.data, summed)
    assert target.tobytes() == reference.tobytes()  # the C cut is the Python cut, gaps left untouched
    for page_d, page_s in zip(dst, src):
        assert _page_bytes(target, page_d) == _page_bytes(source, page_s)
    assert sums == ref_sums == ([xxhash.xxh3_64_intdigest(_page_bytes(source, p)) for p in src] if summed else [])


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_a_page_of_another_size_is_refused_before_anything_is_copied(layout):
    dst, src = layout
    source, target = _buffers(2)
    src = [list(p) for p in src]
    src[-1].append((SPAN - 1, 1))  # the last page one byte longer on one side
    d_at = PageRuns.of_lists([[(target.ctypes.data + o, n) for o, n in page] for page in dst])
    with pytest.raises(ValueError, match="size mismatch"):
        copy_pages(d_at, PageRuns.of_lists(src), source.ctypes.data)
    assert not target.any()


def test_batches_of_pages_are_taken_and_sized_as_arrays():
    runs = PageRuns.of_lists([[(0, 5), (10, 7)], [(3, 4)], [(1, 1), (2, 2), (3, 3)]], base=100)
    assert runs.sizes() == [12, 4, 6] and all(type(n) is int for n in runs.sizes())
    assert runs.addr.tolist() == [100, 110, 103, 101, 102, 103]
    assert runs.take([0, 2]).sizes() == [12, 6] and runs.take([1, 2]).sizes() == [4, 6]
    assert runs.select([False, True, False]).as_lists() == [[(103, 4)]]
    assert runs.pages(1, 3).as_lists() == [[(103, 4)], [(101, 1), (102, 2), (103, 3)]]
    uniform = PageRuns.uniform(np.array([[0, 64], [128, 192]]), np.array([[64, 64], [64, 64]]))
    assert uniform.sizes() == [128, 128] and uniform.counts.tolist() == [2, 2]
    with pytest.raises(ValueError, match="page count"):
        copy_pages(runs, runs.pages(0, 2))


def test_copying_pages_moves_each_page_into_its_own_runs():
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    s0, t0 = source.ctypes.data, target.ctypes.data
    # Page 0: two source runs into one target run; page 1: one source run into three target runs.
    src = [[(100, 300), (1000, 200)], [(2000, 600)]]
    dst = [[(t0 + 0, 500)], [(t0 + 3000, 100), (t0 + 600, 250), (t0 + 1500, 250)]]
    copy_pages(PageRuns.of_lists(dst), PageRuns.of_lists(src), s0)
    assert bytes(target[0:500]) == bytes(source[100:400]) + bytes(source[1000:1200])
    assert bytes(target[3000:3100]) + bytes(target[600:850]) + bytes(target[1500:1750]) == bytes(source[2000:2600])
    assert not target[500:600].any() and not target[850:1500].any()
    assert scatter_runs(dst[1], [(s0 + 2000, 600)])[2] == [100, 250, 250]  # the page-by-page plan agrees


def test_large_batches_are_done_in_two_halves_at_once_and_in_order():
    import threading
    threads = []

    def work(a, b):
        threads.append(threading.current_thread().name)
        return list(range(a, b))
    assert buffers.in_halves(work, 10, buffers.PARALLEL_BYTES - 1) == list(range(10))
    assert len(threads) == 1  # small: one call on this thread
    threads.clear()
    assert buffers.in_halves(work, 10, buffers.PARALLEL_BYTES) == list(range(10))
    assert len(set(threads)) == 2  # large: the second half on the helper thread

    def nested(a, b):  # work that itself cuts in halves, on the helper thread too: runs there whole
        return buffers.in_halves(work, b - a, buffers.PARALLEL_BYTES)
    assert buffers.in_halves(nested, 4, buffers.PARALLEL_BYTES) == [0, 1, 0, 1]

    def fails_late(a, b):
        if a:
            raise buffers.MemoryFault("second half")
        return [a]
    with pytest.raises(buffers.MemoryFault):
        buffers.in_halves(fails_late, 4, buffers.PARALLEL_BYTES)


def test_a_helper_that_starts_late_is_given_less_and_never_under_three_eighths():
    balance = buffers._HalvesBalance()
    assert balance.helper_share(128) == 64  # nothing learnt: even
    for _ in range(60):  # the helper starts 1 ms late; the caller takes 0.1 ms an item
        balance.learn(1e-3, 64, 64 * 1e-4)
    assert balance.helper_share(128) == 59  # 0.5 ms of the caller's work moved to it: both end together
    for _ in range(60):
        balance.learn(1.0, 64, 64 * 1e-4)  # a helper that starts very late still gets 3/8 of the batch
    assert balance.helper_share(128) == 48
    for _ in range(200):
        balance.learn(0.0, 64, 64 * 1e-4)  # it starts at once again: even
    assert balance.helper_share(128) == 64


def test_a_copy_in_halves_copies_every_byte_and_a_vanished_source_faults_on_either_half():
    """The guarded copy on the helper thread has its own recovery point: a source truncated under the
    second half's runs is a MemoryFault, not a crash; a whole source copies byte for byte."""
    import mmap
    import os
    size = 2 * buffers.PARALLEL_BYTES
    fd = os.memfd_create("halves-test")
    try:
        os.ftruncate(fd, size)
        src = mmap.mmap(fd, size)
        src[:] = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
        dst = np.zeros(size, dtype=np.uint8)
        base_s, base_d, run = buffers.address_of(memoryview(src)), dst.ctypes.data, 1 << 20
        runs = list(range(0, size, run))

        def copy(a, b):
            return [copy_runs([base_d + o for o in runs[a:b]], [base_s + o for o in runs[a:b]], [run] * (b - a))]
        halves = buffers.in_halves(copy, len(runs), size)  # cut where the helper's lateness says
        assert len(halves) == 2 and sum(halves) == size and min(halves) >= size // 4
        assert dst.tobytes() == src[:]
        os.ftruncate(fd, size // 4)  # the first half's tail and all of the second half are gone
        with pytest.raises(buffers.MemoryFault):
            buffers.in_halves(copy, len(runs), size)
        src.close()
    finally:
        os.close(fd)


def test_whole_pages_says_whether_every_page_is_one_piece_of_memory():
    """The remote tier sends such pages in place (tiers/node/transfers.py _put_from_region)."""
    one_run = PageRuns.of_lists([[(0, 4096)], [(8192, 4096)]])
    end_to_end = PageRuns.of_lists([[(0, 2048), (2048, 2048)], [(4096, 1024), (5120, 3072)]])
    k_and_v_apart = PageRuns.of_lists([[(0, 2048), (65536, 2048)], [(2048, 2048), (67584, 2048)]])
    # The runs of page 0 end where page 1's begin: each page is still one piece, whatever lies between them.
    neighbours = PageRuns.of_lists([[(0, 2048), (2048, 2048)], [(4096, 4096)]])
    assert one_run.whole_pages() and end_to_end.whole_pages() and neighbours.whole_pages()
    assert not k_and_v_apart.whole_pages()
    assert not PageRuns.of_lists([]).whole_pages()
    assert not k_and_v_apart.take([1]).whole_pages() and k_and_v_apart.pages(0, 0).whole_pages() is False
