"""NvmeStore on real files in temporary directories: contract, eviction, restart, concurrency."""
from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from tiers.ops.config import parse_config
from tiers.stores.nvme import NvmeStore, ceiling
from tiers.stores.nvme.chunkfile import HEADER_SIZE
from tiers.plugins import policy_names
from tiers.stores.base import PageTooLarge, StoreIOError
from tiers.testing import RecordingListener
from tests.support.nvme_scan import held_back_scan

PAGE = 1000
CHUNK = HEADER_SIZE + PAGE  # on-disk bytes of an uncompressed PAGE


def page(seed: int, size: int = PAGE) -> bytes:
    """Deterministic page bytes."""
    return random.Random(seed).randbytes(size)


def split(data, cuts):
    """memoryviews of data cut at the given offsets."""
    view = memoryview(data)
    bounds = [0, *cuts, len(data)]
    return [view[a:b] for a, b in zip(bounds, bounds[1:])]


def chunk_files(root):
    """Every file under the fan-out directories (chunks and leftovers)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        if dirpath != str(root):
            out.extend(os.path.join(dirpath, f) for f in files)
    return sorted(out)


@pytest.fixture
def make_store(tmp_path, monkeypatch):
    # The usage ceiling in steps of capacity / 32, as a large tier's: a tier this small would keep it at its
    # capacity, and take no write during a restart's scan (tiers/stores/nvme/ceiling.py MIN_STEP_BYTES).
    monkeypatch.setattr(ceiling, "MIN_STEP_BYTES", 0)
    stores = []

    def make(capacity=1 << 20, **kw):
        kw.setdefault("fsync", False)  # durability has its own tests; keep the rest fast
        store = NvmeStore(str(kw.pop("path", tmp_path / "nvme")), capacity, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_round_trip_with_odd_splits(make_store):
    store = make_store()
    data = page(1, 10007)
    store.put(("ns", "k"), split(data, [3, 5000, 5001]))
    out = bytearray(len(data))
    assert store.get_into(("ns", "k"), split(out, [1, 2, 9000]))
    assert out == data
    assert bytes(store.get_bytes(("ns", "k"))) == data
    assert store.contains([("ns", "k"), ("ns", "x"), ("other", "k")]) == [True, False, False]
    st = store.stats()
    assert (st.pages, st.hits, st.inserts, st.used_bytes) == (1, 2, 1, HEADER_SIZE + len(data))


def test_miss_and_wrong_size(make_store):
    store = make_store()
    store.put(("ns", "k"), [memoryview(page(1))])
    assert not store.get_into(("ns", "k"), [memoryview(bytearray(PAGE - 1))])
    assert not store.get_into(("ns", "absent"), [memoryview(bytearray(PAGE))])
    assert store.get_bytes(("ns", "absent")) is None
    assert store.stats().misses == 3
    assert store.contains([("ns", "k")]) == [True]  # a size mismatch is not corruption


def test_refusals(make_store):
    store = make_store(capacity=3 * CHUNK, max_page_bytes=4096)
    with pytest.raises(PageTooLarge):
        store.put(("ns", "big"), [memoryview(bytes(4097))])
    with pytest.raises(PageTooLarge):
        store.put(("ns", "empty"), [memoryview(b"")])
    assert chunk_files(store.root) == []


def test_overwrite_replaces(make_store):
    store = make_store()
    store.put(("ns", "k"), [memoryview(page(1))])
    store.put(("ns", "k"), [memoryview(page(2, 1500))])
    assert bytes(store.get_bytes(("ns", "k"))) == page(2, 1500)
    st = store.stats()
    assert (st.pages, st.used_bytes) == (1, HEADER_SIZE + 1500)
    assert len(chunk_files(store.root)) == 1


EXPECTED_VICTIMS = {"lru": ["k0", "k2"], "fifo": ["k0", "k1"], "lfu": ["k1", "k4"]}


@pytest.mark.parametrize("policy", policy_names())
def test_eviction_order_by_policy(make_store, policy):
    store = make_store(capacity=4 * CHUNK + 100, policy=policy)
    for i in range(4):
        store.put(("ns", f"k{i}"), [memoryview(page(i))])
    for _ in range(3):
        store.get_bytes(("ns", "k0"))
    for k in ("k1", "k2", "k3"):
        store.get_bytes(("ns", k))
    present = lambda: {f"k{i}" for i in range(6) if store.contains([("ns", f"k{i}")])[0]}  # noqa: E731
    before = present()
    store.put(("ns", "k4"), [memoryview(page(4))])
    first = before - present()
    store.get_bytes(("ns", "k1"))
    before = present()
    store.put(("ns", "k5"), [memoryview(page(5))])
    second = before - present()
    assert len(first) == len(second) == 1
    if policy in EXPECTED_VICTIMS:
        assert [*first, *second] == EXPECTED_VICTIMS[policy]
    st = store.stats()
    assert (st.evictions, st.pages, st.used_bytes) == (2, 4, 4 * CHUNK)
    assert len(chunk_files(store.root)) == 4


def test_byte_limit_holds_on_disk(make_store):
    store = make_store(capacity=10 * CHUNK)
    rng = random.Random(7)
    for i in range(60):
        store.put(("ns", f"k{i}"), [memoryview(page(i, rng.randint(1, 3 * PAGE)))])
        on_disk = sum(os.path.getsize(p) for p in chunk_files(store.root))
        assert on_disk == store.stats().used_bytes <= 10 * CHUNK


def test_restart_rebuilds_index_and_recency(make_store, tmp_path):
    store = make_store(capacity=5 * CHUNK)
    for i in range(5):
        store.put(("ns", f"k{i}"), [memoryview(page(i))])
    store.close()
    # Recency comes from mtimes: make k3 the oldest and k0 the newest.
    paths = {}
    for p in chunk_files(store.root):
        with open(p, "rb") as fh:
            key = fh.read(HEADER_SIZE)[48:].split(b"\0")[0].decode()[len("ns"):]
        paths[key] = p
    for age, key in enumerate(["k0", "k4", "k2", "k1", "k3"]):
        os.utime(paths[key], ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    store = make_store(capacity=5 * CHUNK, index_snapshot=False)  # as after a crash: from the names
    st = store.stats()
    assert (st.pages, st.used_bytes, st.extra["rebuild_files"]) == (5, 5 * CHUNK, 5)
    assert all(bytes(store.get_bytes(("ns", f"k{i}"))) == page(i) for i in (0, 2, 4))
    store.put(("ns", "new"), [memoryview(page(9))])  # evicts the oldest untouched: k3
    assert store.contains([("ns", f"k{i}") for i in range(5)]) == [True, True, True, False, True]


def test_restart_lowered_capacity_evicts_oldest(make_store):
    store = make_store(capacity=4 * CHUNK)
    for i in range(4):
        store.put(("ns", f"k{i}"), [memoryview(page(i))])
    store.close()
    store = make_store(capacity=2 * CHUNK)
    assert store.stats().pages == 2 and len(chunk_files(store.root)) == 2


def test_temp_files_cleaned_on_restart(make_store):
    store = make_store()
    store.put(("ns", "k"), [memoryview(page(1))])
    leaf = os.path.dirname(chunk_files(store.root)[0])
    store.close()
    # What a kill -9 between write and rename leaves: a complete or partial temp file.
    with open(os.path.join(leaf, ".x.kv.123.0.tmp"), "wb") as fh:
        fh.write(b"partial")
    with open(os.path.join(store.root, ".direct-probe.tmp"), "wb") as fh:
        fh.write(b"x")
    with open(os.path.join(leaf, "0" * 16 + "-" + "1" * 32 + ".kv"), "wb") as fh:
        fh.write(b"short")  # shorter than a header: a torn file
    store = make_store(index_snapshot=False)  # as after the kill: the start scans
    st = store.stats()
    assert (st.extra["temp_removed"], st.extra["torn_removed"], st.pages) == (2, 1, 1)
    assert len(chunk_files(store.root)) == 1
    assert bytes(store.get_bytes(("ns", "k"))) == page(1)


def test_second_store_on_same_dir_refused(make_store):
    make_store()
    with pytest.raises(StoreIOError):
        make_store()


def test_delete_and_clear_after_restart(make_store):
    store = make_store()
    for ns in ("a", "b"):
        for i in range(3):
            store.put((ns, f"k{i}"), [memoryview(page(i))])
    store.close()
    store = make_store()
    assert store.delete([("a", "k0"), ("a", "nope")]) == 1
    assert store.clear("a") == 2
    assert store.contains([("b", "k0"), ("a", "k1")]) == [True, False]
    assert store.clear() == 3
    assert chunk_files(store.root) == [] and store.stats().used_bytes == 0


def test_evictions_reach_the_listener_with_their_reads(make_store):
    listener = RecordingListener()
    store = make_store(capacity=2 * CHUNK, evictions=listener)
    store.put(("ns", "k0"), [memoryview(page(0))])
    store.get_bytes(("ns", "k0"))
    store.put(("ns", "k1"), [memoryview(page(1))])
    store.put(("ns", "k2"), [memoryview(page(2))])
    assert listener.evicted == [(("ns", "k0"), page(0), 1)]


def test_concurrent_puts_and_gets(make_store):
    store = make_store(capacity=12 * (HEADER_SIZE + 4096))
    keys = [f"k{i}" for i in range(20)]

    def content(key, version):
        return (f"{key}:{version}:".encode() * 400)[:4096]

    errors = []

    def worker(seed):
        rng = random.Random(seed)
        buf = bytearray(4096)
        for n in range(60):
            key = rng.choice(keys)
            try:
                if rng.random() < 0.5:
                    store.put(("ns", key), split(content(key, seed * 1000 + n), [rng.randint(1, 4095)]))
                elif store.get_into(("ns", key), split(buf, [rng.randint(1, 4095)])):
                    tag = bytes(buf[:20]).split(b":")
                    if tag[0].decode() != key or bytes(buf) != content(key, int(tag[1])):
                        errors.append((key, bytes(buf[:20])))
            except Exception as exc:  # noqa: BLE001  (any failure fails the test below)
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = store.stats()
    files = chunk_files(store.root)
    assert st.pages == len(files) and st.used_bytes == sum(os.path.getsize(p) for p in files)
    assert st.used_bytes <= store.capacity and st.extra["reserved_bytes"] == 0


def bf16_like(seed: int, n_bytes: int) -> bytes:
    """KV-like data: normal floats truncated to bf16 (the top 16 bits of float32)."""
    f32 = np.random.default_rng(seed).normal(0, 1, n_bytes // 2).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-shuffle"])
def test_compression_round_trip(make_store, codec):
    store = make_store(compression=codec, compression_level=3)
    data = bf16_like(3, 64 << 10) + b"\x07"  # odd length exercises the shuffle tail
    store.put(("ns", "k"), split(data, [5, 40000]))
    out = bytearray(len(data))
    assert store.get_into(("ns", "k"), split(out, [77]))
    assert out == data
    ratio = store.stats().extra["compression_ratio"]
    assert ratio == 1.0 if codec == "none" else ratio > 1.1
    assert store.stats().used_bytes == sum(os.path.getsize(p) for p in chunk_files(store.root))
    store.close()
    store = make_store(compression="none")  # a restarted store reads any codec
    assert bytes(store.get_bytes(("ns", "k"))) == data


def test_incompressible_page_stored_raw(make_store):
    store = make_store(compression="zstd")
    store.put(("ns", "k"), [memoryview(page(1, 8192))])
    assert store.stats().used_bytes == HEADER_SIZE + 8192
    assert bytes(store.get_bytes(("ns", "k"))) == page(1, 8192)


def test_from_config(tmp_path):
    config = parse_config(f"""
[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "1MiB"
policy = "fifo"
path = "{tmp_path / 'cfg'}"
compression = "zstd-shuffle"
""", "test.toml")
    store = NvmeStore.from_config(config.tier("nvme"))
    try:
        assert (store.capacity, store.fsync, store.root) == (1 << 20, True, str(tmp_path / "cfg"))
        store.put(("ns", "k"), [memoryview(bf16_like(1, 8192))])
        assert bytes(store.get_bytes(("ns", "k"))) == bf16_like(1, 8192)
    finally:
        store.close()


def test_a_restart_serves_at_once_while_the_index_is_rebuilt_behind_it(make_store, monkeypatch):
    """The scan is held back; meanwhile the store serves writes, and what it decides wins over the scan:
    a page written since keeps its new bytes, one deleted or of a cleared namespace stays gone (its old
    file is removed when the scan meets it), the rest appears once the scan has passed."""
    store = make_store(capacity=64 * CHUNK)
    for i in range(6):
        store.put(("a", f"old{i}"), [memoryview(page(i))])
    for i in range(3):
        store.put(("b", f"old{i}"), [memoryview(page(100 + i))])
    store.close()
    files_before = len(chunk_files(store.root))
    release = held_back_scan(monkeypatch)
    store = make_store(capacity=64 * CHUNK, policy="fifo", index_snapshot=False)  # reads do not reorder it
    try:
        assert store.stats().extra["index_building"] == 1.0
        assert store.contains([("a", "old0")]) == [False]  # not reached yet: a miss, never a wrong page
        store.put(("a", "new"), [memoryview(page(50))])
        store.put(("a", "old1"), [memoryview(page(51))])  # rewritten while the scan has the older file
        assert store.delete([("a", "old2")]) == 0  # not indexed yet, but must stay deleted
        store.clear("b")
        assert bytes(store.get_bytes(("a", "new"))) == page(50)
    finally:
        release.set()
    assert store._build.done.wait(30)
    st = store.stats()
    assert st.extra["index_building"] == 0.0 and st.extra["stale_removed"] == 4  # old2 and b's three
    assert bytes(store.get_bytes(("a", "old1"))) == page(51)
    assert all(bytes(store.get_bytes(("a", f"old{i}"))) == page(i) for i in (0, 3, 4, 5))
    assert store.contains([("a", "old2"), ("b", "old0"), ("b", "old1"), ("b", "old2")]) == [False] * 4
    assert len(chunk_files(store.root)) == files_before - 4 + 1  # stale files gone, "new" added
    assert st.pages == 6 and st.used_bytes == 6 * CHUNK
    # The eviction order was rebuilt oldest first: the scanned pages go before the ones written meanwhile
    # (in insertion order, the scan's parts would come after them).
    evicted, _ = store.evict(4 * CHUNK)
    assert evicted == 4
    assert store.contains([("a", "new"), ("a", "old1")]) == [True, True]



def test_what_the_store_does_while_the_eviction_order_is_rebuilt_is_replayed_onto_it(make_store, monkeypatch):
    """A Python policy's new eviction order is built outside the ledger lock (at 1,000,000 chunks that took
    seconds under it, stalling writes and stats); writes, deletes and evictions made meanwhile are journaled
    and replayed, so the order ends holding exactly the indexed pages, the ones written meanwhile last.
    (LRU and FIFO keep their order in the native index, which places the scanned chunks itself.)"""
    from tiers.stores.nvme import ledger_rebuild, rebuild
    store = make_store(capacity=64 * CHUNK)
    for i in range(6):
        store.put(("a", f"old{i}"), [memoryview(page(i))])
    store.close()

    reached, release = threading.Event(), threading.Event()
    real = ledger_rebuild.begin_reorder

    def held(ledger):
        fresh = real(ledger)
        reached.set()
        release.wait(30)
        return fresh
    monkeypatch.setattr(ledger_rebuild, "begin_reorder", held)
    monkeypatch.setattr(rebuild, "START_WAIT_S", 0.0)
    store = make_store(capacity=64 * CHUNK, policy="lfu", index_snapshot=False)  # ordered in Python
    try:
        assert reached.wait(30)
        started = time.monotonic()
        store.put(("a", "late"), [memoryview(page(60))])
        store.put(("c", "late"), [memoryview(page(61))])  # a namespace the scan never saw
        assert store.delete([("a", "old3")]) == 1
        assert store.stats().extra["index_building"] == 1.0
        assert time.monotonic() - started < 5  # nothing waited for the reorder
    finally:
        release.set()
    assert store._build.done.wait(30)
    st = store.stats()
    assert st.extra["index_building"] == 0.0 and st.pages == 7
    tenants = store._ledger.tenants.by_hash.values()
    assert sum(len(t.policy) for t in tenants) == 7  # no deleted page left in an order, none missing
    evicted, _ = store.evict(5 * CHUNK, namespace="a")
    assert evicted == 5
    assert store.contains([("a", f"old{i}") for i in (0, 1, 2, 4, 5)] + [("a", "late"), ("c", "late")]) == \
        [False] * 5 + [True, True]
    assert bytes(store.get_bytes(("a", "late"))) == page(60)


@pytest.mark.parametrize("codec", ["none", "zstd-shuffle"])
def test_the_writers_checksum_is_kept_in_the_header_and_checked(make_store, codec):
    """The page checksum (tiers/wire/protocol.py sums) rides in the chunk header, flag 1; for a raw page it is the
    payload checksum.  Bytes that do not match the writer's sum are refused at the write, and a compressed page
    whose decoded bytes do not match it is never served."""
    import xxhash
    from tiers.stores.nvme import chunkfile as cf
    store = make_store(compression=codec, compression_level=3)
    data = bf16_like(4, 64 << 10)
    checksum = xxhash.xxh3_64_intdigest(data)
    store.put_with_sum(("ns", "k"), split(data, [4096]), None, checksum)
    (path,) = chunk_files(store.root)
    hdr = cf.read_header(path)
    assert hdr.page_sum == checksum and (hdr.codec != 0 or hdr.payload_hash == checksum)
    out = bytearray(len(data))
    assert store.get_into_with_sum(("ns", "k"), [memoryview(out)]) == checksum and out == data
    with pytest.raises(StoreIOError, match="checksum"):
        store.put_with_sum(("ns", "bad"), [memoryview(data)], None, checksum ^ 1)
    assert store.contains([("ns", "bad")]) == [False] and store.stats().extra["checksum_refused"] == 1
    if codec != "none":  # a sound payload that decodes to other bytes than the writer hashed: removed, a miss
        block = memoryview(bytearray(cf.HEADER_SIZE))
        with open(path, "r+b") as fh:
            fh.readinto(block)
            fh.seek(0)
            fh.write(cf.pack_header(block, "ns", "k", hdr.codec, hdr.raw_len, hdr.payload_len, hdr.payload_hash,
                                    checksum ^ 1))
        assert store.get_into_with_sum(("ns", "k"), [memoryview(out)]) is None
        assert store.contains([("ns", "k")]) == [False] and store.stats().extra["corrupt_removed"] == 1


def test_chunks_without_a_page_checksum_still_read(make_store):
    """Files written before page checksums (flags 0, version 1) read as before, with checksum 0 (unknown);
    a raw chunk whose page checksum differs from its payload checksum is corrupt."""
    from tiers.stores.nvme import chunkfile as cf
    store = make_store()
    store.put(("ns", "old"), [memoryview(page(1))])
    (path,) = chunk_files(store.root)
    hdr = cf.read_header(path)
    assert hdr.page_sum == 0
    with open(path, "rb") as fh:
        raw = fh.read(cf.HEADER_SIZE)
    assert raw[8:10] == (1).to_bytes(2, "little") and raw[11] == 0  # version 1, no flag
    assert store.get_into_with_sum(("ns", "old"), [memoryview(bytearray(PAGE))]) == 0
    block = memoryview(bytearray(cf.HEADER_SIZE))
    cf.pack_header(block, "ns", "old", 0, PAGE, PAGE, hdr.payload_hash, hdr.payload_hash ^ 1)
    with pytest.raises(cf.CorruptChunk, match="page checksum"):
        cf.parse_header(block)


def test_a_scan_estimated_large_is_not_waited_for_and_runs_below_the_serving_threads(make_store, monkeypatch):
    """The store waits up to START_WAIT_S for a small directory's scan, but not for one its first fan-out
    directories estimate at LARGE_SCAN_CHUNKS or more: it serves at once (here the wait is 30 s and the
    directories past the first four are held back, so only the estimate can end it).  The scan's threads
    run at nice SCAN_NICE, below the threads that serve."""
    from tiers.stores.nvme import index, rebuild
    store = make_store(capacity=256 * CHUNK)
    keys = [("a", f"k{i}") for i in range(64)]
    for i, key in enumerate(keys):
        store.put(key, [memoryview(page(i))])
    store.close()

    release, lock, started, nice = threading.Event(), threading.Lock(), [0], []
    real_top = index._scan_top

    def held_back(top):
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        with lock:
            started[0] += 1
            first = started[0] <= 4
        if not first:
            release.wait(30)
        return real_top(top)
    monkeypatch.setattr(index, "_scan_top", held_back)
    monkeypatch.setattr(rebuild, "START_WAIT_S", 30.0)
    monkeypatch.setattr(rebuild, "LARGE_SCAN_CHUNKS", 10)  # 64 chunks over ~55 fan-out directories
    began = time.monotonic()
    store = make_store(capacity=256 * CHUNK, index_snapshot=False)
    try:
        assert time.monotonic() - began < 10, "the store waited for a scan it knew to be large"
        assert store.stats().extra["index_building"] == 1.0
    finally:
        release.set()
    assert store._build.done.wait(30)
    assert store.contains(keys) == [True] * len(keys)
    assert bytes(store.get_bytes(keys[7])) == page(7)
    assert nice and set(nice) == {os.getpriority(os.PRIO_PROCESS, 0) + index.SCAN_NICE}


def test_writes_during_a_restart_scan_never_take_the_disk_past_capacity(make_store, monkeypatch):
    """A full tier restarts without its snapshot (as after a crash): the chunks the scan has not counted yet
    are still on disk, so a write that would need their room is refused (StoreFull, naming the rebuild)
    instead of taking the disk past capacity; once the scan has counted them, writes evict as usual."""
    from tiers.stores.base import StoreFull
    capacity = 32 * CHUNK
    store = make_store(capacity=capacity)
    for i in range(32):
        store.put(("a", f"old{i}"), [memoryview(page(i))])
    store.close()
    release = held_back_scan(monkeypatch)
    store = make_store(capacity=capacity, index_snapshot=False)
    try:
        assert store.stats().extra["unscanned_bytes"] >= 32 * CHUNK
        for i in range(8):
            with pytest.raises(StoreFull, match="index rebuild"):
                store.put(("a", f"new{i}"), [memoryview(page(100 + i))])
            assert sum(os.path.getsize(p) for p in chunk_files(store.root)) <= capacity
    finally:
        release.set()
    assert store._build.done.wait(30)
    assert store.stats().extra["unscanned_bytes"] == 0
    for i in range(8):
        store.put(("a", f"new{i}"), [memoryview(page(100 + i))])
        assert sum(os.path.getsize(p) for p in chunk_files(store.root)) <= capacity
    assert all(bytes(store.get_bytes(("a", f"new{i}"))) == page(100 + i) for i in range(8))
    held_old = [i for i in range(32) if store.contains([("a", f"old{i}")])[0]]
    assert len(held_old) == 24 and all(bytes(store.get_bytes(("a", f"old{i}"))) == page(i) for i in held_old)


def test_a_tier_not_full_takes_writes_during_its_restart_scan_within_its_ceiling(make_store, monkeypatch):
    """The usage ceiling on disk (tiers/stores/nvme/ceiling.py) tells a restart how much the unscanned chunks
    can add up to: a quarter-full tier takes writes during its scan without evicting anything, raising the
    ceiling durably as it goes, and the disk stays within capacity throughout (steps of capacity / 32: a
    tier this small would otherwise step by its whole capacity)."""
    from tiers.stores.nvme.ceiling import UsageCeiling
    capacity = 64 * CHUNK
    store = make_store(capacity=capacity)
    for i in range(16):
        store.put(("a", f"old{i}"), [memoryview(page(i))])
    store.close()
    left = UsageCeiling(store.root, capacity)
    assert 16 * CHUNK <= left.load() <= 16 * CHUNK + left.step
    release = held_back_scan(monkeypatch)
    store = make_store(capacity=capacity, index_snapshot=False)
    try:
        for i in range(40):
            store.put(("a", f"new{i}"), [memoryview(page(100 + i))])
            assert sum(os.path.getsize(p) for p in chunk_files(store.root)) <= capacity
        # Raised on disk before the bytes went there: a crash now would assume them.
        assert UsageCeiling(store.root, capacity).load() >= 56 * CHUNK
    finally:
        release.set()
    assert store._build.done.wait(30)
    st = store.stats()
    assert st.evictions == 0 and st.pages == 56 and st.extra["foreign_files"] == 0
    assert all(bytes(store.get_bytes(("a", f"old{i}"))) == page(i) for i in range(16))
    assert all(bytes(store.get_bytes(("a", f"new{i}"))) == page(100 + i) for i in range(40))
    assert st.extra["usage_ceiling"] <= 56 * CHUNK + UsageCeiling(None, capacity).step  # settled at the scan's end


def test_a_clear_brings_the_usage_ceiling_down_and_single_deletes_do_not_rewrite_it(make_store):
    """A full tier cleared leaves a ceiling near zero on disk (a crash then does not make the restart assume
    a full tier and refuse writes during its scan); deleting pages one at a time rewrites it only once it
    is two steps slack, not at every delete."""
    from tiers.stores.nvme.ceiling import NAME, UsageCeiling
    capacity = 64 * CHUNK
    store = make_store(capacity=capacity)
    for i in range(64):
        store.put(("a", f"k{i}"), [memoryview(page(i))])
    step = UsageCeiling(None, capacity).step
    assert UsageCeiling(store.root, capacity).load() == capacity
    path = os.path.join(store.root, NAME)
    before = os.stat(path).st_mtime_ns
    assert store.delete([("a", "k0")]) == 1
    assert os.stat(path).st_mtime_ns == before  # one page less: not worth an fsync
    store.clear("a")
    assert UsageCeiling(store.root, capacity).load() == step
    assert store.stats().extra["usage_ceiling"] == step


def test_the_usage_ceilings_step_is_coarse_for_small_tiers():
    """A raise costs two fsyncs on a writer's way: capacity / 32 at a time, but 256 MiB at least, and a
    tier under that keeps its ceiling at its capacity (one raise, ever)."""
    from tiers.stores.nvme.ceiling import MIN_STEP_BYTES, UsageCeiling
    assert MIN_STEP_BYTES == 256 << 20
    assert UsageCeiling(None, 64 << 20).step == 64 << 20
    assert UsageCeiling(None, 4 << 30).step == 256 << 20
    assert UsageCeiling(None, 64 << 30).step == 2 << 30
