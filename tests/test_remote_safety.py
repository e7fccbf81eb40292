"""A read given up at its deadline must never write into host memory the engine has reused.

A pool daemon runs as a real process on loopback; this process is the
inference node (an engine, a registered host pool, a RemoteStore).  The pool
is frozen (SIGSTOP) right after it answered a read's ``locate``, so the
read's Transfer Engine transfer hangs: the read must miss by its deadline.
The test then writes a marker where the page would have gone (as the engine
reuses host slots after a miss), thaws the pool, lets the late transfer end,
and checks the marker: intact with staged reads (the default); with
``direct_reads`` (the hazard that option accepts) the late transfer may
overwrite it, and nothing but the marker or the page's bytes is there.  A write given up the
same way keeps its lease (its blocks reserved) until the transfer ended.
"""
import mmap
import os
import signal
import time

import numpy as np
import pytest

# Pools and the Mooncake Store move pages with the Transfer Engine (the remote-cpu extra).
pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from tests.support.nodes import eventually
from tiers.shm.buffers import address_of
from tests.support.remote_staging import freeze_after, held_staging, pool_and_store

PAGE = 1 << 20
PAGES = 16  # host pool: pages written from slots 0-7, read into slots 8-15
MARKER = b"\xa5"


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    # A small landing area (4 pages) so that a batch of 8 goes in two waves.
    with pool_and_store(tmp_path_factory.mktemp("safety"),
                        dict(capacity="64MiB", block_size="256KiB", max_page_bytes="4MiB"),
                        dict(max_page_bytes=4 * PAGE, landing_bytes=4 * PAGE), PAGES * PAGE, PAGE) as made:
        yield made


def slot(view: memoryview, i: int) -> memoryview:
    return view[i * PAGE:(i + 1) * PAGE]


def write(store, view, keys, seeds):
    for i, seed in enumerate(seeds):
        slot(view, i)[:] = page(seed)
    halves = [[slot(view, i)[:PAGE // 2], slot(view, i)[PAGE // 2:]] for i in range(len(keys))]
    outcomes = store.put_many([("ns", k) for k in keys], halves, [None] * len(keys))
    assert outcomes == [None] * len(keys)


def read(store, view, keys, first=8, deadline=None):
    for i in range(len(keys)):
        slot(view, first + i)[:] = b"\0" * PAGE
    found = store.get_many_into([("ns", k) for k in keys], [[slot(view, first + i)] for i in range(len(keys))],
                                deadline)
    return found, [bytes(slot(view, first + i)) for i in range(len(keys))]


@pytest.mark.parametrize("direct", [False, True])
def test_reads_return_the_exact_bytes(node, direct):
    _pool, store, view = node
    store.direct_reads = direct
    keys = [f"exact-{direct}-{i}" for i in range(8)]  # two waves of the 4-page landing when staged
    write(store, view, keys, range(8))
    found, got = read(store, view, keys)
    assert found == [True] * 8
    assert got == [page(i) for i in range(8)]
    assert store.get_bytes(("ns", keys[3])) == page(3)  # a frame read always lands first
    assert store.get_into(("ns", keys[5]), [slot(view, 8)]) and bytes(slot(view, 8)) == page(5)
    assert store.stats().extra["landing_chunks_free"] == store._landing.n_chunks


@pytest.mark.parametrize("direct", [False, True])
def test_a_read_given_up_never_lands_in_reused_host_memory(node, direct):
    pool, store, view = node
    store.direct_reads = direct
    keys = [f"late-{direct}-{i}" for i in range(2)]
    write(store, view, keys, [10, 11])
    pid = pool.pid("pool0")
    freeze_after(store, pid, "locate")
    try:
        start = time.monotonic()
        found, _ = read(store, view, keys, deadline=time.time() + 0.6)
        elapsed = time.monotonic() - start
        assert found == [False, False], "a frozen pool's pages must miss"
        assert elapsed < 1.0, f"the read took {elapsed:.2f}s, past its deadline"
        if not direct:  # the given-up transfers' chunks are out of use while they may still write
            assert store._landing.held_chunks() == 2 * PAGE // store._landing.chunk
        # The engine treats the miss as such and reuses the host slots.
        for i in (8, 9):
            slot(view, i)[:] = MARKER * PAGE
    finally:
        os.kill(pid, signal.SIGCONT)
    if not direct:
        # The late transfers end (the engine says so) and only then give their landing chunks back.
        assert eventually(lambda: store._landing.held_chunks() == 0, 10)
        time.sleep(0.2)
        assert bytes(slot(view, 8)) == MARKER * PAGE and bytes(slot(view, 9)) == MARKER * PAGE
        # The late transfers did complete: into the landing chunks, where nothing looked.
        landing, chunk = bytes(store._landing._view), store._landing.chunk
        assert all(page(seed)[i:i + chunk] in landing for seed in (10, 11) for i in range(0, PAGE, chunk))
    else:
        # The hazard direct_reads accepts: the abandoned transfer may complete into reused memory.  Whether
        # it does is the engine's (its TCP transport may time the frozen peer out first, as on a loaded CI
        # machine), so the test waits for the engine to say the transfers ended and then holds each slot
        # to the two outcomes there are: every byte the marker or the page's own, nothing else.
        assert eventually(lambda: store._abandoned.pending() == 0, 15)
        for i, seed in ((8, 10), (9, 11)):
            got = np.frombuffer(slot(view, i), dtype=np.uint8)
            want = np.frombuffer(page(seed), dtype=np.uint8)
            assert bool(np.all((got == MARKER[0]) | (got == want))), f"slot {i} holds bytes of neither"
    # The thawed pool serves again, byte for byte.
    assert eventually(lambda: read(store, view, keys)[0] == [True, True], 10, 0.2)
    assert read(store, view, keys)[1] == [page(10), page(11)]


def test_a_write_given_up_keeps_its_blocks_reserved_until_it_ends(node):
    pool, store, view = node
    store.direct_reads = False
    pid = pool.pid("pool0")
    freeze_after(store, pid, "alloc")
    try:
        for i in range(2):
            slot(view, i)[:] = page(20 + i)
        start = time.monotonic()
        # A deadline a loaded machine still meets up to the transfer's start (the test is about
        # the transfer given up after it started, not about a batch refused before it).
        outcomes = store.put_many([("ns", "torn-0"), ("ns", "torn-1")], [[slot(view, 0)], [slot(view, 1)]],
                                  [None, None], deadline=time.time() + 1.5)
        assert time.monotonic() - start < 2.5
        assert all(o is not None for o in outcomes)
        # Not released yet: the pool must not hand these blocks to another page while late bytes may come.
        assert store._abandoned.pending() >= 1
    finally:
        os.kill(pid, signal.SIGCONT)
    assert eventually(lambda: store._abandoned.pending() == 0, 10)
    assert eventually(lambda: store.contains([("ns", "torn-0")]) == [False], 10, 0.2)  # never committed
    keys = ["after-0", "after-1"]
    assert eventually(lambda: store.put_many([("ns", k) for k in keys], [[slot(view, 2)], [slot(view, 3)]],
                                             [None, None]) == [None, None], 10, 0.2)
    slot(view, 2)[:] = page(30)
    slot(view, 3)[:] = page(31)
    assert store.put_many([("ns", k) for k in keys], [[slot(view, 2)], [slot(view, 3)]], [None, None]) == [None, None]
    found, got = read(store, view, keys)
    assert found == [True, True] and got == [page(30), page(31)]


def test_a_read_into_held_staging_lands_in_place_and_holds_what_it_gave_up(node):
    """Staging blocks the daemon holds on request (hold_blocks): reads land in them directly, no landing copy;
    a read given up at its deadline holds its blocks out of use until the engine says the transfer ended."""
    pool, store, view = node
    store.direct_reads = False
    keys = [f"held-{i}" for i in range(2)]
    write(store, view, keys, [20, 21])
    with held_staging(store, 4 * PAGE, 256 << 10, PAGE, keys, "test-staging") as staging:
        free_before = store.stats().extra["landing_chunks_free"]
        sums = staging.read()
        assert all(s is not None for s in sums) and staging.held == []
        assert staging.pages() == [page(20), page(21)]
        assert store.stats().extra["landing_chunks_free"] == free_before  # nothing went through the landing
        pid = pool.pid("pool0")
        freeze_after(store, pid, "locate")
        try:
            sums = staging.read(deadline=time.time() + 0.6)
            assert sums == [None, None], "a frozen pool's pages must miss"
            assert sorted(staging.held) == [0, 1]
            staging.give_back()
            free = staging.arena.free_blocks()
            assert free == staging.all_blocks() - 2 * (PAGE // staging.arena.block_size)  # ...parked
        finally:
            os.kill(pid, signal.SIGCONT)
        # Once the engine reports the late transfers ended, the blocks are free again.
        assert eventually(lambda: staging.arena.free_blocks() == staging.all_blocks(), 15)
        assert staging.arena.lease_count() == 0


def test_a_write_given_up_keeps_its_source_mapped_until_it_ends(node):
    """A put sent straight out of a host pool (the tier daemon's _put_from_region) whose transfer is given up:
    the store keeps the pages' views, so the mapping they lie in, until the engine says the transfer ended:
    the late transfer never reads an address unmapped, or mapped again for other memory, meanwhile."""
    pool, store, view = node
    write(store, view, ["mapped-warm"], [40])  # the pool's client exists (this test may run alone)
    host = mmap.mmap(-1, 2 * PAGE)
    store.region_mapped(memoryview(host))
    assert eventually(lambda: store._registrations.covers(address_of(memoryview(host)), 2 * PAGE), 10)
    pid = pool.pid("pool0")
    freeze_after(store, pid, "alloc")
    try:
        whole = memoryview(host)
        pages = [[whole[i * PAGE:(i + 1) * PAGE]] for i in range(2)]
        outcomes = store.put_many([("ns", "kept-0"), ("ns", "kept-1")], pages, [None, None],
                                  deadline=time.time() + 1.5)
        assert all(o is not None for o in outcomes)
        store.region_unmapped(whole)  # the engine detaches: the daemon forgets the region, then unmaps it
        del pages, whole
        with pytest.raises(BufferError):  # the store still holds views of it for the transfer given up
            host.close()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert eventually(lambda: store._abandoned.pending() == 0, 10)

    def closed() -> bool:
        try:
            host.close()
            return True
        except BufferError:
            return False
    assert eventually(closed, 10), "the views of an ended transfer were never let go"
    assert eventually(lambda: store.contains([("ns", "kept-0")]) == [False], 10, 0.2)  # never committed
