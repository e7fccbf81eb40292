"""Pages adjacent on both ends move as one Transfer Engine transfer, and what is given up stays held.

A batch of small pages written together sits in adjacent pool blocks, and a
read lands them in adjacent staging or landing chunks: the engine then moves
several pages in one transfer (tiers/stores/remote/engine.py merge_pieces,
up to MERGE_BYTES).  A transfer given up at its deadline may still write
every page it carries, so each of those pages stays out of use until the
engine reports that transfer ended (abandoned_groups).  The pool is a real
daemon on loopback, frozen with SIGSTOP right after it answered the read's
locate, as in tests/test_remote_safety.py.
"""
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from tiers.stores.remote.engine import MERGE_BYTES, abandoned_batches, abandoned_groups, merge_pieces
from tests.support.nodes import eventually
from tests.support.remote_staging import freeze_after, held_staging, pool_and_store

PAGE = 64 << 10
PAGES = 8  # a read of 8 pages of 64 KiB: MERGE_BYTES / PAGE pages a transfer when both ends are adjacent


def test_adjacent_pieces_merge_up_to_the_limit_and_keep_their_pages():
    # Two pages of two halves each, all adjacent on both ends: one transfer carrying both pages.
    pages = [[(1000, 5000, 10), (1010, 5010, 10)], [(1020, 5020, 20)]]
    assert merge_pieces(pages, 1 << 20) == [(1000, 5000, 40, [0, 1])]
    # Adjacent locally but not remotely (another pool block), and the limit: separate transfers.
    pages = [[(1000, 5000, 10)], [(1010, 9000, 10)], [(1020, 9010, 10)], [(1030, 9020, 10)]]
    assert merge_pieces(pages, 20) == [(1000, 5000, 10, [0]), (1010, 9000, 20, [1, 2]), (1030, 9020, 10, [3])]
    # A page without pieces carries nothing and is in no transfer.
    assert merge_pieces([[], [(0, 0, 5)]], 100) == [(0, 0, 5, [1])]


def test_given_up_transfers_group_pages_so_none_is_held_or_watched_twice():
    # Batch 7 carried pages 0 and 1, batch 8 pages 1 and 2; batch 9 page 5 alone.
    abandoned = [(0, 7), (1, 7), (1, 8), (2, 8), (5, 9)]
    assert abandoned_batches(abandoned) == [7, 8, 9]
    groups = sorted((sorted(p), sorted(b)) for p, b in abandoned_groups(abandoned))
    assert groups == [([0, 1, 2], [7, 8]), ([5], [9])]
    assert abandoned_groups([]) == []


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with pool_and_store(tmp_path_factory.mktemp("merged"),
                        dict(capacity="16MiB", block_size="64KiB", max_page_bytes="1MiB"),
                        dict(max_page_bytes=PAGE, landing_bytes=2 * PAGES * PAGE, landing_chunk=PAGE),
                        2 * PAGES * PAGE, PAGE) as made:
        yield made


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def slot(view: memoryview, i: int) -> memoryview:
    return view[i * PAGE:(i + 1) * PAGE]


def write_batch(store, view, keys, seed):
    for i in range(len(keys)):
        slot(view, i)[:] = page(seed + i)
    halves = [[slot(view, i)[:PAGE // 2], slot(view, i)[PAGE // 2:]] for i in range(len(keys))]
    assert store.put_many([("ns", k) for k in keys], halves, [None] * len(keys)) == [None] * len(keys)


class CountingEngine:
    """The store's engine, counting the transfers submitted through it (the real engine moves them)."""

    def __init__(self, engine):
        self.engine, self.submitted = engine, []
        self.raw_te = engine._te

    def __enter__(self):
        te = self.raw_te

        def counted(call):
            def submit(segment, local, remote, lengths):
                self.submitted.append(sum(lengths))
                return call(segment, local, remote, lengths)
            return submit
        self.engine._te = _Proxy(te, read=counted(te.batch_transfer_async_read),
                                 write=counted(te.batch_transfer_async_write))
        return self

    def __exit__(self, *exc):
        self.engine._te = self.raw_te


class _Proxy:
    def __init__(self, te, read, write):
        self._te, self.batch_transfer_async_read, self.batch_transfer_async_write = te, read, write

    def __getattr__(self, name):
        return getattr(self._te, name)


def test_a_batch_of_small_pages_moves_in_few_transfers_byte_for_byte(node):
    pool, store, view = node
    store.direct_reads = False
    keys = [f"few-{i}" for i in range(PAGES)]
    write_batch(store, view, keys, 100)
    for i in range(PAGES):
        slot(view, PAGES + i)[:] = b"\0" * PAGE
    engine = store.engine
    with CountingEngine(engine) as counting:
        found = store.get_many_into([("ns", k) for k in keys], [[slot(view, PAGES + i)] for i in range(PAGES)])
    assert found == [True] * PAGES
    assert [bytes(slot(view, PAGES + i)) for i in range(PAGES)] == [page(100 + i) for i in range(PAGES)]
    # 8 pages of 64 KiB in adjacent blocks at both ends: fewer transfers than pages, none over the limit.
    assert sum(counting.submitted) == PAGES * PAGE
    assert len(counting.submitted) < PAGES and max(counting.submitted) <= MERGE_BYTES


def test_pages_are_told_once_in_passes_each_only_once_all_its_bytes_are_there(node):
    """A streamed read (held buffers, the daemon's path) hears of the pages whose transfers completed once a
    polling pass: each page once, as part of a list, and only when every byte of it has landed."""
    pool, store, view = node
    keys = [f"told-{i}" for i in range(PAGES)]
    write_batch(store, view, keys, 300)
    for i in range(PAGES):
        slot(view, PAGES + i)[:] = b"\0" * PAGE
    told, whole_when_told = [], []

    def on_final(positions, sums):
        told.append(list(positions))
        whole_when_told.extend(bytes(slot(view, PAGES + p)) == page(300 + p) for p, s in zip(positions, sums)
                               if s is not None)
    halves = [[slot(view, PAGES + i)[:PAGE // 2], slot(view, PAGES + i)[PAGE // 2:]] for i in range(PAGES)]
    store.get_many_streamed([("ns", k) for k in keys], halves, time.time() + 30, on_final, hold=lambda p: None)
    assert sorted(p for call in told for p in call) == list(range(PAGES))  # each page told once
    assert whole_when_told == [True] * PAGES  # told only once both halves had landed
    assert len(told) < PAGES  # in lists, a polling pass at a time, not one call a page


def test_a_merged_read_given_up_holds_every_page_it_carries(node):
    """Held staging (the daemon's leased reads): one transfer carries several pages; given up, every one of
    them stays out of use until the engine reports that transfer ended, and is then given back once."""
    pool, store, view = node
    store.direct_reads = False
    keys = [f"held-{i}" for i in range(PAGES)]
    write_batch(store, view, keys, 200)
    with held_staging(store, 2 * PAGES * PAGE, PAGE, PAGE, keys, "test-merged-staging") as staging:
        with CountingEngine(store.engine) as counting:
            sums = staging.read()
        assert all(s is not None for s in sums) and staging.held == []
        assert len(counting.submitted) < PAGES  # merged: the case this test is about
        assert staging.pages() == [page(200 + i) for i in range(PAGES)]
        pid = pool.pid("pool0")
        freeze_after(store, pid, "locate")
        try:
            sums = staging.read(deadline=time.time() + 0.6)
            assert sums == [None] * PAGES, "a frozen pool's pages must miss"
            assert sorted(staging.held) == list(range(PAGES)), "every page a given-up transfer carries is held, once"
            staging.give_back()  # parked
            assert staging.arena.free_blocks() == staging.all_blocks() - PAGES
        finally:
            os.kill(pid, signal.SIGCONT)
        assert eventually(lambda: staging.arena.free_blocks() == staging.all_blocks(), 15)
        assert staging.arena.lease_count() == 0
        assert eventually(lambda: store._abandoned.pending() == 0, 15)
    # The thawed pool serves the batch again, byte for byte.
    assert eventually(lambda: store.get_many_into([("ns", k) for k in keys],
                                                  [[slot(view, PAGES + i)] for i in range(PAGES)]) == [True] * PAGES,
                      10, 0.2)
    assert [bytes(slot(view, PAGES + i)) for i in range(PAGES)] == [page(200 + i) for i in range(PAGES)]


def test_a_merged_read_into_landing_given_up_holds_its_chunks_until_it_ended(node):
    pool, store, view = node
    store.direct_reads = False
    keys = [f"landed-{i}" for i in range(PAGES)]
    write_batch(store, view, keys, 300)
    landing = store._landing
    free_before = landing.free_chunks()
    pid = pool.pid("pool0")
    freeze_after(store, pid, "locate")
    try:
        for i in range(PAGES):
            slot(view, PAGES + i)[:] = b"\xa5" * PAGE
        found = store.get_many_into([("ns", k) for k in keys], [[slot(view, PAGES + i)] for i in range(PAGES)],
                                    time.time() + 0.6)
        assert found == [False] * PAGES
        assert landing.held_chunks() == PAGES and landing.free_chunks() == free_before - PAGES
    finally:
        os.kill(pid, signal.SIGCONT)
    assert eventually(lambda: landing.held_chunks() == 0 and landing.free_chunks() == free_before, 15)
    time.sleep(0.2)  # nothing of the late transfers reached the host slots
    assert all(bytes(slot(view, PAGES + i)) == b"\xa5" * PAGE for i in range(PAGES))
