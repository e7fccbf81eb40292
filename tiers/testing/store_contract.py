"""The page-store contract: what every tier's store, built-in or plug-in, must satisfy.

A plug-in's tests subclass it and build the store under test:

    from tiers.testing import StoreContract

    class TestTmpfsStore(StoreContract):
        def make_store(self, path, capacity, policy, max_page_bytes, evictions=None):
            return TmpfsStore(path, capacity, policy, max_page_bytes, evictions)

        def corrupt(self, store, key):         # optional: damage a stored page
            ...; return True

It checks the rules of tiers/stores/base.py: exact bytes through split buffers,
misses that are misses, overwrite, the capacity bound, eviction by the
store's policy (LRU here), evicted pages handed to the EvictionListener (the
daemon's demotion) with their exact bytes, per-namespace delete and clear,
refusals with nothing visible, counters, concurrent calls for stores with
``parallel_io``, batches and their deadlines for ``batched`` stores (a call
past its deadline lands no byte), a restart that keeps pages for persistent
stores, corrupt data read as a miss, and page checksums kept and returned by
stores that declare ``keeps_checksums`` (0, unknown, from the rest), streamed reads that tell of each page once;
and for a store that shares its
memory (``export_arena``), writes in three steps (reserve, the daemon's copy, commit or abort) and a batch's,
and leased reads that show each page's own bytes until the lease ends.  The built-ins pass it
(tests/test_store_contract.py, tests/test_remote_contract.py).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import xxhash

from tiers.shm.buffers import scatter_copy
from tiers.stores.base import EvictionListener, PageKey, PageStore, StoreError


def page(seed: int, size: int) -> bytes:
    """Deterministic page bytes (no two seeds alike)."""
    import numpy as np
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def split(data: bytes, parts: int = 3):
    """The page as several views, as SGLang's layouts give it (K and V, or one per layer)."""
    view = memoryview(data)
    cuts = [len(data) * i // parts for i in range(parts + 1)]
    return [view[cuts[i]:cuts[i + 1]] for i in range(parts)]


def read(store: PageStore, key, size: int) -> Optional[bytes]:
    """get_into through split buffers; None on a miss."""
    out = bytearray(size)
    return bytes(out) if store.get_into(key, split(memoryview(out), 2)) else None


class RecordingListener(EvictionListener):
    """Keeps what a store says it evicted: (key, bytes, reads), and each evicted page's checksum."""

    def __init__(self):
        self.evicted: List[Tuple[PageKey, bytes, int]] = []
        self.sums: Dict[PageKey, int] = {}

    def page_evicted(self, key: PageKey, views: Sequence[memoryview], reads: int, checksum: int = 0) -> None:
        self.evicted.append((key, b"".join(bytes(v) for v in views), reads))
        self.sums[key] = checksum


class StoreContract:
    """Subclass as Test...; override make_store (and reopen/corrupt where they apply)."""

    page_bytes = 16 << 10
    capacity = 64 * (16 << 10)  # room for about 64 pages, less what the store spends per page
    max_page_bytes = 1 << 20
    persistent: Optional[bool] = None  # None: what the store declares (PageStore.persistent)
    reports_evictions = True  # False for a store whose evictions happen elsewhere (the remote tier's pools)

    # ------------------------------------------------------------ to override
    def make_store(self, path: str, capacity: int, policy: str, max_page_bytes: int,
                   evictions: Optional[EvictionListener] = None) -> PageStore:
        raise NotImplementedError("return the store under test, keeping its data under path, telling evictions")

    def corrupt(self, store: PageStore, key) -> bool:
        """Damage key's stored bytes behind the store's back; False: this store has nothing to corrupt."""
        return False

    # ---------------------------------------------------------------- helpers
    @pytest.fixture
    def store_path(self, tmp_path) -> str:
        return str(tmp_path / "store")

    @pytest.fixture
    def store(self, store_path):
        store = self.make_store(store_path, self.capacity, "lru", self.max_page_bytes)
        yield store
        store.close()

    # ------------------------------------------------------------------ tests
    def test_is_a_page_store(self, store):
        assert isinstance(store, PageStore)

    def test_exact_bytes_through_split_buffers(self, store):
        data = page(1, self.page_bytes)
        store.put(("ns", "k"), split(data, 3), parent=None)
        assert read(store, ("ns", "k"), len(data)) == data
        assert bytes(store.get_bytes(("ns", "k"))) == data
        assert store.contains([("ns", "k"), ("ns", "other")]) == [True, False]
        assert store.held("ns", ["k", "other"]) == b"\x01\x00"

    def test_a_miss_is_a_miss(self, store):
        store.put(("ns", "k"), [memoryview(page(2, self.page_bytes))])
        assert read(store, ("ns", "absent"), self.page_bytes) is None
        assert store.get_bytes(("other-ns", "k")) is None  # namespaces never meet
        assert read(store, ("ns", "k"), self.page_bytes - 1) is None  # another size is a miss, not a short read

    def test_overwrite_replaces(self, store):
        store.put(("ns", "k"), [memoryview(page(3, self.page_bytes))])
        store.put(("ns", "k"), [memoryview(page(4, self.page_bytes))])
        assert read(store, ("ns", "k"), self.page_bytes) == page(4, self.page_bytes)
        assert store.stats().pages == 1

    def test_capacity_is_a_bound(self, store):
        for i in range(3 * self.capacity // self.page_bytes):
            store.put(("ns", f"k{i}"), [memoryview(page(i, self.page_bytes))])
            stats = store.stats()
            assert stats.used_bytes <= self.capacity, (i, stats)
        stats = store.stats()
        assert stats.evictions > 0
        held = sum(store.contains([("ns", f"k{i}") for i in range(3 * self.capacity // self.page_bytes)]))
        assert held == stats.pages and 0 < held <= self.capacity // self.page_bytes

    def test_lru_keeps_what_was_read(self, store):
        """The store evicts by its policy: with LRU, a page read after every write outlives the rest."""
        store.put(("ns", "hot"), [memoryview(page(0, self.page_bytes))])
        i = 0
        while store.stats().evictions == 0:
            i += 1
            assert i < 4 * self.capacity // self.page_bytes, "never evicted: is capacity enforced?"
            store.put(("ns", f"k{i}"), [memoryview(page(i, self.page_bytes))])
            assert read(store, ("ns", "hot"), self.page_bytes) == page(0, self.page_bytes)
        assert store.contains([("ns", "hot"), ("ns", "k1")]) == [True, False]

    def test_evicted_pages_reach_the_listener(self, store_path):
        """What the daemon demotes: each evicted page once, exact bytes; deletes and overwrites are not evictions."""
        if not self.reports_evictions:
            pytest.skip("this store's evictions happen outside it")
        listener = RecordingListener()
        store = self.make_store(store_path, self.capacity, "lru", self.max_page_bytes, evictions=listener)
        try:
            store.put(("ns", "gone"), [memoryview(page(0, self.page_bytes))])
            store.put(("ns", "over"), [memoryview(page(1, self.page_bytes))])
            store.put(("ns", "over"), [memoryview(page(2, self.page_bytes))])
            store.delete([("ns", "gone")])
            assert listener.evicted == []
            n = 3 * self.capacity // self.page_bytes
            for i in range(n):
                store.put(("ns", f"k{i}"), [memoryview(page(10 + i, self.page_bytes))])
            keys = [key for key, _data, _reads in listener.evicted]
            assert keys and len(keys) == len(set(keys)) == store.stats().evictions
            assert not any(store.contains(keys))
            written = {("ns", "over"): page(2, self.page_bytes)}
            written.update({("ns", f"k{i}"): page(10 + i, self.page_bytes) for i in range(n)})
            assert all(data == written[key] for key, data, _reads in listener.evicted)
        finally:
            store.close()

    def test_delete_and_clear_per_namespace(self, store):
        for ns in ("a", "b"):
            for i in range(3):
                store.put((ns, f"k{i}"), [memoryview(page(i, self.page_bytes))])
        assert store.delete([("a", "k0"), ("a", "absent")]) == 1
        assert store.clear("a") == 2
        assert store.held("a", ["k0", "k1", "k2"]) == b"\x00\x00\x00"
        assert store.held("b", ["k0", "k1", "k2"]) == b"\x01\x01\x01"
        assert store.clear() == 3 and store.stats().pages == 0

    def test_lookups_by_digest_answer_as_by_key(self, store):
        if not store.answers_digests:
            pytest.skip("answers lookups by key only (answers_digests = False)")
        from tiers.wire.protocol import pack_key_digests
        for ns in ("a", "b"):
            store.put((ns, f"d-{ns}"), [memoryview(page(3, self.page_bytes))])
        store.put(("a", "d-2"), [memoryview(page(4, self.page_bytes))])
        keys = ["d-a", "d-b", "d-2", "d-absent"]
        for ns in ("a", "b"):
            assert store.held_digests(ns, pack_key_digests(ns, keys)) == store.held(ns, keys)
        assert store.held("a", keys) == b"\x01\x00\x01\x00"
        store.delete([("a", "d-2")])
        assert store.held_digests("a", pack_key_digests("a", keys)) == b"\x01\x00\x00\x00"

    def test_a_refused_page_leaves_nothing_visible(self, store):
        too_big = page(9, self.max_page_bytes + 1)
        with pytest.raises(StoreError):
            store.put(("ns", "big"), [memoryview(too_big)])
        assert store.contains([("ns", "big")]) == [False]

    def test_counters(self, store):
        store.put(("ns", "k"), [memoryview(page(5, self.page_bytes))])
        before = store.stats()
        read(store, ("ns", "k"), self.page_bytes)
        read(store, ("ns", "absent"), self.page_bytes)
        after = store.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
        assert after.capacity_bytes == self.capacity and after.pages == 1

    def test_concurrent_calls(self, store):
        if not store.parallel_io:
            pytest.skip("the daemon calls this store from one thread (parallel_io = False)")
        errors = []

        def worker(w: int) -> None:
            try:
                for i in range(8):
                    key, data = ("ns", f"w{w}-{i}"), page(100 * w + i, self.page_bytes)
                    store.put(key, split(data, 2))
                    got = read(store, key, len(data))
                    assert got is None or got == data  # evicted by another thread is fine; wrong bytes are not
            except BaseException as exc:  # collected: a thread's assert is not the test's
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]

    def test_batches_round_trip(self, store):
        if not store.batched:
            pytest.skip("moves pages one at a time (batched = False)")
        keys = [("ns", f"b{i}") for i in range(4)]
        pages = [page(40 + i, self.page_bytes) for i in range(4)]
        assert store.put_many(keys, [split(p, 2) for p in pages], [None] * 4, time.time() + 30) == [None] * 4
        outs = [bytearray(self.page_bytes) for _ in range(5)]
        found = store.get_many_into(keys + [("ns", "absent")], [split(memoryview(o), 2) for o in outs],
                                    time.time() + 30)
        assert found == [True] * 4 + [False]
        assert [bytes(o) for o in outs[:4]] == pages

    def test_streamed_reads_tell_of_every_page_once(self, store):
        """get_many_streamed (every store has it; streams_reads ones tell as each read ends) reports each page
        exactly once, with what get_many_into_with_sums answers, and its bytes are in place when told."""
        keys = [("ns", f"s{i}") for i in range(6)]
        pages = [page(60 + i, self.page_bytes) for i in range(5)]
        for key, data in zip(keys, pages):
            store.put(key, split(data, 2))
        outs = [bytearray(self.page_bytes) for _ in keys]
        told: Dict[int, Optional[int]] = {}
        bytes_when_told: Dict[int, bytes] = {}
        lock = threading.Lock()

        def on_final(positions: List[int], sums: List[Optional[int]]) -> None:
            with lock:
                for position, checksum in zip(positions, sums):
                    assert position not in told, f"page {position} told of twice"
                    told[position] = checksum
                    bytes_when_told[position] = bytes(outs[position])
        store.get_many_streamed(keys, [split(memoryview(o), 2) for o in outs], time.time() + 30, on_final)
        assert sorted(told) == list(range(len(keys)))
        assert told[5] is None  # the page never written
        assert all(told[i] is not None for i in range(5))
        assert [bytes_when_told[i] for i in range(5)] == pages
        plain = [store.get_into_with_sum(key, split(memoryview(bytearray(self.page_bytes)), 2)) for key in keys]
        assert [told[i] for i in range(len(keys))] == plain

    def test_batches_past_their_deadline_land_nothing(self, store):
        """A call whose deadline passed refuses or misses: the engine stopped waiting for it."""
        if not store.batched:
            pytest.skip("moves pages one at a time (batched = False)")
        key, data = ("ns", "late"), page(50, self.page_bytes)
        outcome = store.put_many([key], [[memoryview(data)]], [None], time.time() - 1)
        assert outcome[0] is not None and store.contains([key]) == [False]
        assert store.put_many([key], [[memoryview(data)]], [None], time.time() + 30) == [None]
        marker = bytearray(b"\xa5" * self.page_bytes)
        assert store.get_many_into([key], [[memoryview(marker)]], time.time() - 1) == [False]
        assert marker == b"\xa5" * self.page_bytes  # not one byte landed

    def test_restart_keeps_pages(self, store, store_path):
        if not (store.persistent if self.persistent is None else self.persistent):
            pytest.skip("not a persistent store")
        data = page(6, self.page_bytes)
        store.put(("ns", "k"), [memoryview(data)])
        store.close()
        again = self.make_store(store_path, self.capacity, "lru", self.max_page_bytes)
        try:
            assert read(again, ("ns", "k"), len(data)) == data
        finally:
            again.close()

    def test_checksums_are_kept_with_pages(self, store):
        """A page keeps its writer's checksum on every read path (0, unknown, from a store that keeps none)."""
        data, other = page(60, self.page_bytes), page(61, self.page_bytes)
        kept = xxhash.xxh3_64_intdigest(data) if store.keeps_checksums else 0
        store.put_with_sum(("ns", "summed"), split(data, 3), None, xxhash.xxh3_64_intdigest(data))
        store.put(("ns", "plain"), [memoryview(other)])  # an older writer's page: unknown
        out = bytearray(self.page_bytes)
        assert store.get_into_with_sum(("ns", "summed"), split(memoryview(out), 2)) == kept and out == data
        assert store.get_into_with_sum(("ns", "plain"), [memoryview(out)]) == 0 and out == other
        assert store.get_into_with_sum(("ns", "absent"), [memoryview(out)]) is None
        got, checksum = store.get_bytes_with_sum(("ns", "summed"))
        assert bytes(got) == data and checksum == kept
        assert store.get_bytes_with_sum(("ns", "absent")) == (None, 0)
        if store.batched:
            assert store.put_many_with_sums([("ns", "b")], [[memoryview(other)]], [None], time.time() + 30,
                                            [xxhash.xxh3_64_intdigest(other)]) == [None]
            outs = [bytearray(self.page_bytes) for _ in range(2)]
            got = store.get_many_into_with_sums([("ns", "b"), ("ns", "absent")], [[memoryview(o)] for o in outs],
                                                time.time() + 30)
            assert got == [xxhash.xxh3_64_intdigest(other) if store.keeps_checksums else 0, None]

    def test_evicted_pages_keep_their_checksums(self, store_path):
        """What the daemon demotes carries the page's checksum to the tier below."""
        if not self.reports_evictions:
            pytest.skip("this store's evictions happen outside it")
        listener = RecordingListener()
        store = self.make_store(store_path, self.capacity, "lru", self.max_page_bytes, evictions=listener)
        try:
            pages = {f"k{i}": page(80 + i, self.page_bytes) for i in range(3 * self.capacity // self.page_bytes)}
            for name, data in pages.items():
                store.put_with_sum(("ns", name), [memoryview(data)], None, xxhash.xxh3_64_intdigest(data))
            assert listener.sums
            for (_ns, name), checksum in listener.sums.items():
                assert checksum == (xxhash.xxh3_64_intdigest(pages[name]) if store.keeps_checksums else 0)
        finally:
            store.close()

    def test_corrupt_data_is_a_miss(self, store):
        data = page(7, self.page_bytes)
        store.put(("ns", "k"), [memoryview(data)])
        if not self.corrupt(store, ("ns", "k")):
            pytest.skip("this store keeps nothing a test can corrupt behind its back")
        assert read(store, ("ns", "k"), len(data)) is None
        assert store.contains([("ns", "k")]) == [False]


    # ----------------------------------------- stores that share their memory (export_arena)
    def _arena(self, store: PageStore):
        arena = store.export_arena()
        if arena is None:
            pytest.skip("exports no arena (the daemon stages this store's pages in its own)")
        return arena

    def test_arena_pages_are_written_in_three_steps(self, store):
        """reserve, the daemon's copy into the blocks, commit (or abort): what a shared-memory put does."""
        arena = self._arena(store)
        data = page(90, self.page_bytes)
        free = arena.free_blocks()
        alloc = store.reserve(("ns", "k"), len(data))
        assert alloc is not None and store.contains([("ns", "k")]) == [False]  # reserved is not yet stored
        _fill(arena, alloc, data)
        store.commit(("ns", "k"), alloc, None, xxhash.xxh3_64_intdigest(data))
        assert read(store, ("ns", "k"), len(data)) == data
        aborted = store.reserve(("ns", "gone"), len(data))
        _fill(arena, aborted, page(91, self.page_bytes))
        store.abort(aborted)
        assert store.contains([("ns", "gone")]) == [False]
        assert arena.free_blocks() == free - arena.blocks_for(len(data))  # the aborted blocks came back

    def test_arena_batches_are_reserved_and_committed_together(self, store):
        arena = self._arena(store)
        names = [f"b{i}" for i in range(4)]
        pages = [page(100 + i, self.page_bytes) for i in range(4)]
        allocs = store.reserve_many("ns", names, [self.page_bytes] * 4)
        assert len(allocs) == 4
        for alloc, data in zip(allocs, pages):
            _fill(arena, alloc, data)
        store.commit_many("ns", names, allocs, [None] * 4, [xxhash.xxh3_64_intdigest(d) for d in pages])
        assert [read(store, ("ns", n), self.page_bytes) for n in names] == pages

    def test_a_leased_page_is_what_was_written_until_its_lease_ends(self, store):
        """lease_pages hands out each page's blocks (the engine copies from its own mapping); a page deleted
        while leased keeps its bytes whatever is written next, until the lease is released."""
        arena = self._arena(store)
        data = page(110, self.page_bytes)
        store.put_with_sum(("ns", "k"), [memoryview(data)], None, xxhash.xxh3_64_intdigest(data))
        store.put(("ns", "k2"), [memoryview(page(111, self.page_bytes))])
        lease, extents, sums = store.lease_pages([("ns", "k"), ("ns", "absent"), ("ns", "k2")],
                                                 [self.page_bytes] * 3, 7, time.monotonic() + 60,
                                                 self.page_bytes)  # room for one page only
        assert lease is not None and extents[1] is None and extents[2] is None
        assert sums[0] == (xxhash.xxh3_64_intdigest(data) if store.keeps_checksums else 0)
        assert _extent_bytes(arena, extents[0]) == data
        store.delete([("ns", "k")])
        for i in range(2 * self.capacity // self.page_bytes):  # every other block written over, twice
            store.put(("ns", f"f{i}"), [memoryview(page(120 + i, self.page_bytes))])
        assert _extent_bytes(arena, extents[0]) == data
        assert arena.release(lease, 7) and not arena.release(lease, 7)
        assert store.lease_pages([("ns", "k")], [self.page_bytes], 7, time.monotonic() + 60,
                                 self.page_bytes)[1] == [None]


def _fill(arena, alloc, data: bytes) -> None:
    """The daemon's copy into reserved blocks."""
    scatter_copy(arena.views(alloc), [memoryview(data)])


def _extent_bytes(arena, extents) -> bytes:
    return b"".join(bytes(arena.view[offset:offset + length]) for offset, length in extents)


def flip_bits(path: str, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of a file in place (offset < 0 counts from the end): the corrupt hooks' damage."""
    with open(path, "r+b") as fh:
        whence = os.SEEK_SET if offset >= 0 else os.SEEK_END
        fh.seek(offset, whence)
        byte = fh.read(1)
        fh.seek(offset, whence)
        fh.write(bytes([byte[0] ^ mask]))
