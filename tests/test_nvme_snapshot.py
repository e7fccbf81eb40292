"""The NVMe index saved at a clean close and loaded at the next start (tiers/stores/nvme/snapshot.py).

A start from the snapshot must be indistinguishable from the store before
it closed: the same pages, bytes, namespaces and eviction order.  It is used
once (gone before the store serves, so a later crash scans), and a snapshot
that is not sound, or written under another policy, falls back to the scan
with nothing lost.
"""
import logging
import os
import random

import pytest

from tiers.stores.nvme import NvmeStore, snapshot
from tiers.stores.nvme.chunkfile import HEADER_SIZE

PAGE = 8192
CHUNK = HEADER_SIZE + PAGE


def page(seed: int) -> bytes:
    return random.Random(seed).randbytes(PAGE)


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(capacity=64 * CHUNK, **kw):
        kw.setdefault("fsync", False)
        store = NvmeStore(str(tmp_path / "nvme"), capacity, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def fill(store, namespaces=("a", "b"), n=5):
    for ns in namespaces:
        for i in range(n):
            store.put((ns, f"k{i}"), [memoryview(page(hash((ns, i)) & 0xFFFF))])


def eviction_order(store, namespace, n):
    """Evict one page at a time; the keys in the order they went."""
    gone = []
    keys = [(namespace, f"k{i}") for i in range(n)]
    for _ in range(n):
        held = store.contains(keys)
        store.evict(1, namespace=namespace)
        after = store.contains(keys)
        gone += [k[1] for k, was, now in zip(keys, held, after) if was and not now]
    return gone


def test_a_clean_restart_loads_the_index_with_its_order_and_serves_the_same_bytes(make_store):
    store = make_store()
    fill(store)
    for i in (2, 0, 4):  # LRU order of a: k1, k3, k2, k0, k4
        assert store.get_bytes(("a", f"k{i}")) is not None
    before = store.stats()
    store.close()
    assert os.path.exists(snapshot.path_of(store.root))
    store = make_store()
    st = store.stats()
    assert st.extra["snapshot_loaded"] == 1.0 and st.extra["rebuild_files"] == 10
    assert not os.path.exists(snapshot.path_of(store.root))  # used once: a crash from now on scans
    assert (st.pages, st.used_bytes) == (before.pages, before.used_bytes)
    assert set(st.per_namespace) == {"a", "b"}  # names kept, not only their hashes
    assert all(bytes(store.get_bytes(("b", f"k{i}"))) == page(hash(("b", i)) & 0xFFFF) for i in range(5))
    assert eviction_order(store, "a", 5) == ["k1", "k3", "k2", "k0", "k4"]


def test_what_is_written_after_a_load_is_in_the_next_snapshot(make_store):
    store = make_store()
    fill(store, ("a",), 3)
    store.close()
    store = make_store()
    store.put(("a", "late"), [memoryview(page(99))])
    assert store.delete([("a", "k0")]) == 1
    store.close()
    store = make_store()
    assert store.stats().extra["snapshot_loaded"] == 1.0
    assert store.contains([("a", "k0"), ("a", "k1"), ("a", "late")]) == [False, True, True]
    assert bytes(store.get_bytes(("a", "late"))) == page(99)


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "rows"])
def test_a_snapshot_that_is_not_sound_is_dropped_and_the_directory_scanned(make_store, damage, caplog):
    store = make_store()
    fill(store)
    store.close()
    path = snapshot.path_of(store.root)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if damage == "flip":
            data[-40] ^= 0x01  # a byte of the last row: the checksum no longer adds up
        elif damage == "truncate":
            data = data[:-32]
        elif damage == "version":
            data[8] = 99
        else:  # a header that claims 2**40 rows: refused before anything is allocated for them
            data[16:24] = (1 << 40).to_bytes(8, "little")
        f.seek(0)
        f.truncate()
        f.write(data)
    with caplog.at_level(logging.WARNING, logger="hicache.nvme"):
        store = make_store()
    assert "not sound" in caplog.text
    assert store._build.done.wait(30)
    st = store.stats()
    assert "snapshot_loaded" not in st.extra and st.extra["rebuild_files"] == 10 and st.pages == 10
    assert not os.path.exists(path)
    assert all(bytes(store.get_bytes(("a", f"k{i}"))) == page(hash(("a", i)) & 0xFFFF) for i in range(5))


@pytest.mark.parametrize("first, then", [("lru", "fifo"), ("lfu", "lfu")])
def test_another_policy_or_a_python_policy_scans(make_store, first, then):
    store = make_store(policy=first)
    fill(store)
    store.close()
    assert os.path.exists(snapshot.path_of(store.root)) == (first == "lru")  # lfu orders in Python: no snapshot
    store = make_store(policy=then)
    assert store._build.done.wait(30)
    st = store.stats()
    assert "snapshot_loaded" not in st.extra and st.pages == 10


def test_a_lowered_capacity_evicts_the_coldest_at_load(make_store):
    store = make_store()
    fill(store, ("a",), 6)
    store.get_bytes(("a", "k0"))  # k0 the most recent
    store.close()
    store = make_store(capacity=2 * CHUNK)
    st = store.stats()
    assert st.extra["snapshot_loaded"] == 1.0 and st.pages == 2
    assert store.contains([("a", f"k{i}") for i in range(6)]) == [True, False, False, False, False, True]
    files = [f for _d, _s, names in os.walk(store.root) for f in names if f.endswith(".kv")]
    assert len(files) == 2


def test_snapshots_can_be_turned_off(make_store):
    store = make_store(index_snapshot=False)
    fill(store, ("a",), 2)
    store.close()
    assert not os.path.exists(snapshot.path_of(store.root))
