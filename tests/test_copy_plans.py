"""The cuts a batched copy is made of: scatter_pages (numpy for a batch, page by page for a small group)
against scatter_runs (page by page).

Every copy between a host pool and an arena is planned by scatter_pages;
a wrong cut copies the wrong bytes into another tenant's page, so it is
held to the page-by-page reference on random run layouts, and real bytes
are copied with the plan and compared.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.node import buffers
from tiers.node.buffers import copy_runs, scatter_pages, scatter_runs

@st.composite
def layouts(draw):
    """Pages as (dst runs, src runs) of equal totals, each side cut at random places."""
    pages = []
    for _ in range(draw(st.integers(1, 6))):
        total = draw(st.integers(1, 64))
        sides = []
        for _side in range(2):
            cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=4)))) if total > 1 else []
            bounds = [0, *cuts, total]
            sides.append([(draw(st.integers(0, 1 << 20)) * 64, b - a) for a, b in zip(bounds, bounds[1:])])
        pages.append(sides)
    return [d for d, _s in pages], [s for _d, s in pages]

@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(0, 4096))
def test_the_batch_cut_is_the_page_by_page_cut(layout, base):
    dst, src = layout
    reference = ([], [], [])
    for d, s in zip(dst, src):
        for into, part in zip(reference, scatter_runs(d, [(base + a, n) for a, n in s])):
            into.extend(part)
    small = buffers.SMALL_BATCH
    try:
        for threshold in (0, 1 << 30):  # the whole batch in numpy, then page by page in Python
            buffers.SMALL_BATCH = threshold
            assert scatter_pages(dst, src, base) == reference
    finally:
        buffers.SMALL_BATCH = small

@settings(max_examples=100, deadline=None)
@given(layouts())
def test_a_page_of_another_size_is_refused(layout):
    dst, src = layout
    src = [list(p) for p in src]
    src[-1].append((0, 1))
    small = buffers.SMALL_BATCH
    try:
        for threshold in (0, 1 << 30):
            buffers.SMALL_BATCH = threshold
            try:
                scatter_pages(dst, src)
            except ValueError:
                continue
            raise AssertionError("a page one byte longer on one side was planned")
    finally:
        buffers.SMALL_BATCH = small

def test_copying_with_the_plan_moves_each_page_into_its_own_runs():
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = np.zeros(4096, dtype=np.uint8)
    s0, t0 = source.ctypes.data, target.ctypes.data
    # Page 0: two source runs into one target run; page 1: one source run into three target runs.
    src = [[(100, 300), (1000, 200)], [(2000, 600)]]
    dst = [[(t0 + 0, 500)], [(t0 + 3000, 100), (t0 + 600, 250), (t0 + 1500, 250)]]
    copy_runs(*scatter_pages(dst, src, s0))
    assert bytes(target[0:500]) == bytes(source[100:400]) + bytes(source[1000:1200])
    assert bytes(target[3000:3100]) + bytes(target[600:850]) + bytes(target[1500:1750]) == bytes(source[2000:2600])
    assert not target[500:600].any() and not target[850:1500].any()


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
        assert buffers.in_halves(copy, len(runs), size) == [size // 2, size // 2]
        assert dst.tobytes() == src[:]
        os.ftruncate(fd, size // 4)  # the first half's tail and all of the second half are gone
        with pytest.raises(buffers.MemoryFault):
            buffers.in_halves(copy, len(runs), size)
        src.close()
    finally:
        os.close(fd)
