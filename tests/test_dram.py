"""The DRAM tier: exact bytes back, eviction by policy, memory within its bound."""
import threading
import time

import numpy as np
import pytest

from tiers.wire.client import TierClient
from tiers.stores.dram import DramStore
from tiers.stores.base import EvictionListener, PageTooLarge
from tests.support.nodes import dram_config, rss_bytes, start_node


def page(i: int, size: int = 10_000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_round_trip_with_split_buffers():
    store = DramStore(1 << 20, "lru", block_size=4096)
    data = page(1, 10_000)
    parts = [memoryview(data)[:3], memoryview(data)[3:5000], memoryview(data)[5000:]]
    store.put(("ns", "k"), parts)
    out = [bytearray(7), bytearray(9993)]
    assert store.get_into(("ns", "k"), [memoryview(b) for b in out])
    assert bytes(out[0] + out[1]) == data
    assert store.get_bytes(("ns", "k")) == data
    assert not store.get_into(("ns", "k"), [memoryview(bytearray(5))])  # wrong size is a miss
    assert store.get_bytes(("other", "k")) is None


def test_overwrite_replaces_and_frees():
    store = DramStore(64 << 10, "lru", block_size=4096)
    store.put(("ns", "k"), [memoryview(page(1, 30_000))])
    store.put(("ns", "k"), [memoryview(page(2, 30_000))])
    assert store.get_bytes(("ns", "k")) == page(2, 30_000)
    stats = store.stats()
    assert (stats.pages, stats.used_bytes, stats.evictions) == (1, 30_000, 0)


@pytest.mark.parametrize("policy, survivors", [
    ("lru", {0, 3, 4}),   # 0 was read, so 1 and 2 go first
    ("fifo", {2, 3, 4}),  # reads do not matter
    ("lfu", {0, 3, 4}),   # 0 has two reads
])
def test_eviction_follows_policy(policy, survivors):
    store = DramStore(3 * 8192, policy, block_size=8192)
    for i in range(3):
        store.put(("ns", str(i)), [memoryview(page(i, 8192))])
    store.get_bytes(("ns", "0"))
    store.get_bytes(("ns", "0"))
    store.put(("ns", "3"), [memoryview(page(3, 8192))])
    store.get_bytes(("ns", "3"))
    store.put(("ns", "4"), [memoryview(page(4, 8192))])
    held = {i for i in range(5) if store.contains([("ns", str(i))])[0]}
    assert held == survivors
    assert store.stats().evictions == 2
    for i in held:
        assert store.get_bytes(("ns", str(i))) == page(i, 8192)


def test_too_large_page_is_refused():
    store = DramStore(64 << 10, "lru", block_size=4096, max_page_bytes=32 << 10)
    with pytest.raises(PageTooLarge):
        store.put(("ns", "k"), [memoryview(b"x" * (40 << 10))])
    assert store.stats().pages == 0




def test_daemon_writing_twice_its_capacity_evicts_lru_and_stays_bounded(tmp_path):
    capacity = 32 << 20
    runner = start_node(tmp_path, dram_config(capacity="32MiB", policy="lru", block_size="64KiB"))
    try:
        client = TierClient("dram", runner.config.tier("dram").endpoint, "cap-test")
        page_size = 1 << 20
        baseline = rss_bytes(runner.pid("dram"))
        keys = [f"p{i}" for i in range(64)]  # 64 MiB: twice the capacity
        for start in range(0, 64, 8):
            batch = keys[start:start + 8]
            pages = [[memoryview(np.full(page_size, i % 251, np.uint8))] for i in range(start, start + 8)]
            assert client.put_frames(batch, pages, 8 * page_size) == [True] * 8
        held = client.lookup(keys)
        assert held == b"\x00" * 32 + b"\x01" * 32  # LRU kept exactly the newest capacity's worth
        found, frames = client.get_frames(keys[32:], 32 * page_size)
        assert all(found)
        for i, frame in zip(range(32, 64), frames):
            assert bytes(frame.buffer[:1]) == bytes([i % 251]) and len(frame.buffer) == page_size
        stats = client.stats()
        assert stats["evictions"] == 32 and stats["used_bytes"] == capacity
        growth = rss_bytes(runner.pid("dram")) - baseline
        assert growth <= capacity + (16 << 20), f"daemon grew by {growth} bytes for a {capacity}-byte tier"
        client.close()
    finally:
        runner.stop()


def test_a_background_prefault_the_kernel_cannot_do_never_writes_over_stored_pages(monkeypatch):
    """Without MADV_POPULATE_WRITE (Linux < 5.14) a serving arena is left to fault in on first use."""
    import tiers.shm.arena as arena_module
    gate = threading.Event()

    def populate_unsupported(mapping, write=True, step=0):
        gate.wait(10)  # the arena serves meanwhile
        return False
    monkeypatch.setattr(arena_module, "populate", populate_unsupported)
    arena = arena_module.BlockArena(1 << 20, 64 << 10, "stored", prefault=True, background=True)
    try:
        prefault = next(t for t in threading.enumerate() if t.name == "stored-prefault")
        alloc = arena.take(256 << 10)
        data = np.random.default_rng(3).integers(1, 256, 256 << 10, dtype=np.uint8).tobytes()
        at = 0
        for view in arena.views(alloc):
            view[:] = data[at:at + view.nbytes]
            at += view.nbytes
        gate.set()
        prefault.join(10)
        assert not prefault.is_alive() and b"".join(arena.views(alloc)) == data
    finally:
        arena.close()


def _put_page_by_page(store, ns, keys, size):
    for key in keys:
        store.commit((ns, key), store.reserve((ns, key), size), None, 1)


def _put_as_transfers_do(store, ns, keys, size):
    """tiers/node/transfers.py's order: a group reserved at once (evicting where the policy allows), committed,
    then the page that did not fit reserved alone."""
    i = 0
    while i < len(keys):
        allocs = store.reserve_many(ns, keys[i:], [size] * (len(keys) - i), evict=True)
        store.commit_many(ns, keys[i:i + len(allocs)], allocs, [None] * len(allocs), [1] * len(allocs))
        i += len(allocs)
        if i < len(keys):
            store.commit((ns, keys[i]), store.reserve((ns, keys[i]), size), None, 1)
            i += 1


class _Heard(EvictionListener):
    """Every page a store evicted, in order, with its first bytes (what write-back demotion would copy)."""

    def __init__(self):
        self.pages = []

    def page_evicted(self, key, views, reads, checksum=0):
        self.pages.append((key, bytes(views[0][:8]), reads, checksum))


@pytest.mark.parametrize("ahead_pages,ahead_s,blocks", [(None, None, 1), (3, None, 1), (None, 0.0, 1),
                                                        (None, None, 2), (5, None, 2)])
@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "lfu", "radix-lru"])
def test_batch_reserve_evicts_exactly_what_page_by_page_puts_evict(policy, ahead_pages, ahead_s, blocks,
                                                                   monkeypatch):
    """Random batches of two namespaces (fair share), re-puts of held pages, keys twice in a batch, reads, and
    pages leased to readers (their blocks wait for the lease): after every batch both stores hold the same
    pages, counted the same evictions and told their listener of the same victims in the same order
    (ahead_pages / ahead_s: a batch reserve evicts for at most that many pages, where a listener copies
    victims out, / seconds a lock hold, and goes on in the next; blocks: blocks a page)."""
    import tiers.stores.dram as dram
    rng = np.random.default_rng(11)
    block = 4096
    size = blocks * block - 100
    if ahead_pages:
        monkeypatch.setattr(dram, "EVICT_AHEAD_BYTES", ahead_pages * size)
    if ahead_s is not None:
        monkeypatch.setattr(dram, "EVICT_AHEAD_S", ahead_s)
    heard = [_Heard(), _Heard()]
    stores = [DramStore(40 * blocks * block, policy, block_size=block, prefault=False,
                        quotas={"b": 25 * blocks * block}, evictions=heard[i] if ahead_pages else None)
              for i in range(2)]
    made_room_ahead = False
    leases = []
    for step in range(300):
        ns = "ab"[int(rng.integers(0, 2))]
        keys = [f"{ns}{int(k)}" for k in rng.integers(0, 120, int(rng.integers(1, 30)))]  # repeats too
        free_before = stores[1].arena.free_blocks()
        _put_page_by_page(stores[0], ns, keys, size)
        _put_as_transfers_do(stores[1], ns, keys, size)
        made_room_ahead |= len(keys) * blocks > free_before + blocks
        reads = [(ns, f"{ns}{int(k)}") for k in rng.integers(0, 120, 10)]
        for store in stores:
            for key in reads:
                store.get_bytes(key)
        if step % 7 == 0:  # a reader leases two pages for a while: evicted meanwhile, their blocks park
            leased = reads[:2]
            leases.append([(s, s.lease_pages(leased, [size] * 2, 1, time.monotonic() + 60, 1 << 30)[0])
                           for s in stores])
        if len(leases) > 3:
            for store, lease_id in leases.pop(0):
                if lease_id is not None:
                    store.arena.release(lease_id, 1)
        everything = [(n, f"{n}{k}") for n in "ab" for k in range(120)]
        held = [s.contains(everything) for s in stores]
        assert held[0] == held[1], f"step {step}"
        assert stores[0].stats().evictions == stores[1].stats().evictions > 0 or step < 5
        assert heard[0].pages == heard[1].pages, f"step {step}"
    assert made_room_ahead  # batches larger than the free room came, so the batch path evicted ahead
    assert not ahead_pages or len(heard[0].pages) == stores[0].stats().evictions


def test_a_batch_reserve_stops_evicting_ahead_once_its_time_in_the_lock_is_spent(monkeypatch):
    """Each eviction walks every namespace; with many, a whole batch's evictions in one lock hold would stall
    the tier's readers: past EVICT_AHEAD_S the reserve returns what it has, and the writer goes on page by
    page (each eviction in a hold of its own)."""
    import tiers.stores.dram as dram
    size = 4096
    store = DramStore(64 * size, "lru", block_size=size, prefault=False)
    for n in range(64):
        store.put((f"tenant{n}", "k"), [b"x" * size])  # full, one page each of 64 namespaces
    keys = [f"w{i}" for i in range(16)]
    monkeypatch.setattr(dram, "EVICT_AHEAD_S", 0.0)
    assert store.reserve_many("writer", keys, [size] * 16, evict=True) == []
    monkeypatch.setattr(dram, "EVICT_AHEAD_S", 10.0)
    assert len(store.reserve_many("writer", keys, [size] * 16, evict=True)) == 16


def test_namespaces_that_hold_nothing_are_forgotten():
    """Issue 29, attack 6: a tenant opening namespace after namespace leaves no state behind, and stats stay
    linear (10,000 namespaces once took ~5 s of the store's lock)."""
    import time
    store = DramStore(64 * 4096, "lru", block_size=4096)
    store.put(("keep", "k"), [b"k" * 4096])
    for n in range(10_000):
        store.put((f"churn-{n}", "p"), [b"c" * 4096])
        assert store.delete([(f"churn-{n}", "p")]) == 1
    for n in range(2_000):  # evicted rather than deleted: forgotten too
        store.put((f"flood-{n}", "p"), [b"f" * 4096])
    assert store.stats().extra["namespaces"] == 12_001  # until the daemon's housekeeping prunes
    assert store.prune() == 12_001 - store.stats().pages
    began = time.perf_counter()
    stats = store.stats()
    took = time.perf_counter() - began
    # One page a namespace here: every namespace left holds one (12,001 were opened).
    assert 0 < stats.pages <= 64 and stats.extra["namespaces"] == stats.pages, (stats.pages, stats.extra)
    assert took < 0.05, took
    store.close()


_INDEX_COST = """
import gc, json, sys
from tiers.node.memory_guard import anonymous_bytes
from tiers.stores.dram import DramStore
from tiers.stores.remote.pool import PoolStore
pages, kind, policy = 50_000, sys.argv[1], sys.argv[2]
store = {"dram": DramStore, "pool": PoolStore}[kind](capacity=pages * 4096 + (16 << 20), policy=policy,
                                                    block_size=4096)
page = [memoryview(bytes(4096))]
gc.collect()
before, counted = anonymous_bytes(), store.index_bytes()
for i in range(pages):
    store.put_with_sum(("ns", f"{i:064x}"), page, f"{i - 1:064x}" if i else None, i + 1)
gc.collect()
print(json.dumps({"grew": anonymous_bytes() - before, "counted": store.index_bytes() - counted}))
"""


@pytest.mark.parametrize("kind", ["dram", "pool"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_the_index_size_the_memory_guard_allows_for_covers_what_the_pages_cost(kind, policy):
    """index_bytes() (what the daemon's memory bound adds for the store's index) is at least the anonymous
    memory the held pages really take, keys and parents as SGLang sends them: a bound that left them out
    shut idle engines' connections once a tier held a million pages.  The remote pool's daemon (watched since
    its tcp:// endpoint is) keeps the same kind of index.  Measured in a fresh process: one
    whose heap holds memory freed by earlier tests grows by less than the pages cost."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", _INDEX_COST, kind, policy], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    cost = json.loads(out.stdout.strip().splitlines()[-1])
    assert cost["grew"] > 20 << 20, cost  # 50,000 pages: tens of MB
    assert cost["counted"] >= cost["grew"], cost
    assert cost["counted"] < 2 * cost["grew"], cost  # not so loose that it bounds nothing
