"""Reads through the DRAM tier's page directory: found without asking the daemon, never a wrong page.

The store and the directory in this process (the daemon's side), read through
read-only mappings of their memfds as an engine maps them; then the real
backend against a real DRAM daemon, frozen or churning under its reads.
"""
from __future__ import annotations

import mmap
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

from tiers.shm.buffers import address_of
from tiers.shm.directory import DirectoryView
from tiers.shm.page_runs import PageRuns
from tiers.stores.dram import DramStore
from tiers.wire.protocol import pack_key_digests
from tests.support.backend_env import Engine, make_keys
from tests.support.nodes import dram_tier, node_toml, start_node

BLOCK = 4096


class EngineSide:
    """The arena and its directory mapped read-only, and a destination buffer, as an engine holds them."""

    def __init__(self, store: DramStore, pages: int, page_bytes: int):
        self.store, self.page_bytes = store, page_bytes
        fd = store.arena.export_fd()
        self.arena = mmap.mmap(fd, store.arena.size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        fd = store.directory.export_fd()
        self.view = DirectoryView(mmap.mmap(fd, store.directory.size, mmap.MAP_SHARED, mmap.PROT_READ),
                                  store.arena.size)
        os.close(fd)
        self.arena_base = address_of(memoryview(self.arena))
        self.dst = mmap.mmap(-1, pages * page_bytes)
        base = address_of(memoryview(self.dst))
        self.runs = PageRuns(np.arange(pages, dtype=np.uint64) * np.uint64(page_bytes) + np.uint64(base),
                             np.full(pages, page_bytes, dtype=np.uint64), np.ones(pages, dtype=np.int64))

    def read(self, namespace: str, keys, summed: bool = True, number: int = 0):
        number = number or self.store.directory_namespace(namespace)
        return self.view.read(number, pack_key_digests(namespace, keys), self.page_bytes,
                              self.runs.pages(0, len(keys)), self.arena_base, summed)

    def page(self, i: int) -> bytes:
        return self.dst[i * self.page_bytes:(i + 1) * self.page_bytes]


def _pattern(key: str, size: int) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(size)


def _put(store: DramStore, namespace: str, key: str, size: int, checksum: int = 0) -> None:
    store.put_with_sum((namespace, key), [memoryview(_pattern(key, size))], None, checksum)


def test_a_page_is_found_in_its_own_namespace_at_its_own_size():
    size = 3 * BLOCK  # three blocks, not necessarily adjacent
    store = DramStore(64 * BLOCK, block_size=BLOCK, prefault=False)
    engine = EngineSide(store, 4, size)
    try:
        for key, ns in (("a", "ns1"), ("b", "ns1"), ("a", "ns2")):
            _put(store, ns, key, size, checksum=len(key) + len(ns))
        flags, sums, copied = engine.read("ns1", ["a", "zz", "b"])
        assert flags == [True, False, True]
        assert engine.page(0) == _pattern("a", size) and engine.page(2) == _pattern("b", size)
        assert sums == [4, 0, 4]
        assert copied[0] != 0 and copied[1] == 0
        # A number the directory never gave ns2's pages, a wrong size: misses, nothing read.
        other = store.directory_namespace("ns2")
        assert engine.read("ns1", ["a"], number=other)[0] == [False]
        assert engine.view.read(store.directory_namespace("ns1"), pack_key_digests("ns1", ["a"]), size - 1,
                                engine.runs.pages(0, 1), engine.arena_base, False)[0] == [False]
        # Deleted or replaced: gone from the directory before its blocks are free.
        store.delete([("ns1", "a")])
        assert engine.read("ns1", ["a", "b"])[0] == [False, True]
        assert store.directory.count() == 2
    finally:
        store.close()


def test_no_engine_can_map_the_directory_writable():
    store = DramStore(16 * BLOCK, block_size=BLOCK, prefault=False)
    fd = store.directory.export_fd()
    try:
        with pytest.raises(OSError):
            mmap.mmap(fd, store.directory.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
        store.close()


def test_a_damaged_page_copies_with_a_sum_other_than_its_own():
    size = 2 * BLOCK
    store = DramStore(16 * BLOCK, block_size=BLOCK, prefault=False)
    engine = EngineSide(store, 1, size)
    try:
        flags, sums, copied = engine.read("ns", ["k"])
        assert flags == [False]
        from tiers.shm.checksums import page_sums
        _put(store, "ns", "k", size, checksum=page_sums([[memoryview(_pattern("k", size))]])[0])
        flags, sums, copied = engine.read("ns", ["k"])
        assert flags == [True] and copied == sums  # intact: the engine's check passes
        offset = store.export_arena().views(store._index[("ns", "k")].alloc)[0]
        offset[100] ^= 0xFF  # a bit flip in the daemon's memory
        flags, sums, copied = engine.read("ns", ["k"])
        assert flags == [True] and copied != sums  # the engine's check (hicache_ext/page_sums.py) makes it a miss
    finally:
        store.close()


def test_a_reader_racing_evictions_keeps_only_whole_pages():
    """Pages evicted and their blocks rewritten by other pages while an engine copies them: every page the
    read keeps holds its own bytes, byte for byte."""
    size, keys = 2 * BLOCK, [f"k{i}" for i in range(64)]
    store = DramStore(24 * BLOCK, block_size=BLOCK, prefault=False)  # 12 of 64 pages fit: constant eviction
    engine = EngineSide(store, len(keys), size)
    stop = threading.Event()
    writes = [0]

    def churn():
        rng = random.Random(7)
        while not stop.is_set():
            _put(store, "ns", rng.choice(keys), size)
            writes[0] += 1
    writer = threading.Thread(target=churn)
    writer.start()
    kept = wrong = reads = 0
    rng = random.Random(11)
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline or kept < 200:
            batch = rng.sample(keys, 16)
            flags, _sums, _copied = engine.read("ns", batch, summed=False)
            reads += 1
            for i, (key, ok) in enumerate(zip(batch, flags)):
                if ok:
                    kept += 1
                    wrong += engine.page(i) != _pattern(key, size)
            if time.monotonic() > deadline + 30:
                break
    finally:
        stop.set()
        writer.join()
        store.close()
    print(f"\n{reads} reads, {kept} pages kept, {wrong} wrong, {writes[0]} writes beside them")
    assert kept >= 200, "the reads found too few pages to prove anything"
    assert writes[0] >= 1000, "the writer did not churn while the reads ran"
    assert wrong == 0


SHAPE = dict(layers=4, kv_heads=2, head_dim=64, page_size=16)  # 32 KiB pages
PAGES = 16


def _node(tmp_path, capacity: str = "4MiB"):
    return start_node(tmp_path, node_toml(dram_tier(capacity, block_size="16KiB"), write_policy="write_through"))


def test_hits_are_found_and_read_while_the_daemon_is_frozen(tmp_path):
    runner = _node(tmp_path)
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE, deadline_base_s=0.2, lookup_timeout_s=0.5)
    pid = runner.pid("dram")
    try:
        keys = make_keys(PAGES, 3)
        written, expected = engine.write(keys, 0, seed=5)
        assert written == PAGES
        os.kill(pid, signal.SIGSTOP)
        try:
            assert engine.backend.batch_exists(keys) == PAGES  # the lookup too: the directory holds them all
            for _ in range(3):
                done, got = engine.read(keys, PAGES)
                assert done == PAGES and got == expected
        finally:
            os.kill(pid, signal.SIGCONT)
        assert engine.backend.router_stats()["direct_pages"] >= 3 * PAGES
    finally:
        engine.close()
        runner.stop()


def _hits(engine) -> int:
    return engine.backend.tier_stats()["dram"]["hits"]


def test_reads_through_the_directory_count_for_eviction(tmp_path):
    """LRU: pages read through the directory are recent for the daemon too (their touch arrives after the
    read), so a later write evicts the pages nobody read."""
    runner = _node(tmp_path, capacity="1MiB")  # 32 pages of 32 KiB
    engine = Engine(runner, pages=48, shape=SHAPE)
    try:
        first, second, third = make_keys(16, 1), make_keys(16, 2), make_keys(16, 3)
        assert engine.write(first, 0, seed=1)[0] == 16
        assert engine.write(second, 16, seed=2)[0] == 16
        before = _hits(engine)
        direct = engine.backend.router_stats()["direct_pages"]
        assert engine.read(first, 32)[0] == 16
        assert engine.backend.router_stats()["direct_pages"] == direct + 16  # not asked of the daemon
        end = time.monotonic() + 5
        while _hits(engine) < before + 16 and time.monotonic() < end:
            time.sleep(0.02)
        assert _hits(engine) == before + 16, "the daemon never counted the reads"
        assert engine.write(third, 32, seed=3)[0] == 16
        assert engine.backend.batch_exists(first) == 16, "pages just read were evicted"
        assert engine.backend.batch_exists(second) == 0, "the pages nobody read are still held"
    finally:
        engine.close()
        runner.stop()


def test_a_namespace_renumbered_is_read_through_the_directory_again(tmp_path):
    """A namespace that held nothing gives its number up (the daemon's housekeeping); the engine's next
    read asks the daemon, whose lease reply carries the new number, and the read after is direct again."""
    runner = _node(tmp_path)
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE)
    try:
        keys = make_keys(PAGES, 9)
        assert engine.write(keys, 0, seed=9)[0] == PAGES
        engine.backend.clear()
        time.sleep(1.5)  # housekeeping ticks every 0.5 s: the empty namespace is pruned
        written, expected = engine.write(keys, 0, seed=9)
        assert written == PAGES
        stats = engine.backend.router_stats
        direct = stats()["direct_pages"]
        done, got = engine.read(keys, PAGES)
        assert done == PAGES and got == expected
        assert stats()["direct_pages"] == direct, "read through a number the daemon had given up"
        done, got = engine.read(keys, PAGES)
        assert done == PAGES and got == expected
        assert stats()["direct_pages"] == direct + PAGES
    finally:
        engine.close()
        runner.stop()


def test_touches_ride_on_requests_or_go_alone_after_a_moment():
    from tiers.wire import direct_reads
    from tiers.wire import protocol as P
    sent = []
    toucher = direct_reads.Toucher("t", sent.append)
    try:
        big = [f"k{i}" for i in range(P.MAX_BATCH + 10)]
        toucher.touch(big, 4096)
        fields: dict = {}
        toucher.take(fields)  # a request sent now carries them, at most MAX_BATCH a request
        assert fields["touched"] == big[:P.MAX_BATCH]
        assert P.decode_sizes(fields["touched_sizes"], P.MAX_BATCH, 4096) == [4096] * P.MAX_BATCH
        end = time.monotonic() + 5
        while not sent and time.monotonic() < end:  # the rest: alone, once no request took it in time
            time.sleep(0.01)
        assert [f["touched"] for f in sent] == [big[P.MAX_BATCH:]]
        time.sleep(3 * direct_reads.TOUCH_DELAY_S)
        assert len(sent) == 1  # nothing more to send: nothing sent
        toucher.touch(["late"], 8192)
        end = time.monotonic() + 5
        while len(sent) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert sent[1]["touched"] == ["late"]
    finally:
        toucher.close()


def test_a_client_touches_only_its_own_namespace(tmp_path):
    """`touched` keys are read in the sender's session's namespace: a client naming another namespace's
    keys (a flood of them) counts nothing there, and the daemon answers every message."""
    from tiers.wire.client import TierClient
    from tiers.wire import direct_reads
    runner = _node(tmp_path)
    endpoint = runner.config.tier("dram").endpoint
    owner, other = TierClient("dram", endpoint, "victim"), TierClient("dram", endpoint, "intruder")
    try:
        keys = [f"k{i}" for i in range(64)]
        assert all(owner.put_frames(keys, [[b"x" * 4096] for _ in keys], 64 * 4096, None))
        before = owner.stats()["per_namespace"]["victim"].get("hits", 0)
        for _ in range(200):  # a flood of touches naming the victim's keys, from another namespace's session
            toucher = direct_reads.Toucher("t", lambda fields: None)
            toucher.touch(keys, 4096)
            fields: dict = {}
            toucher.take(fields)
            toucher.close()
            assert other.call("touch", 1.0, **fields) is not None
        assert owner.stats()["per_namespace"]["victim"].get("hits", 0) == before
        assert owner.lookup(keys) == b"\x01" * len(keys)
    finally:
        owner.close()
        other.close()
        runner.stop()


def test_a_restarted_daemon_takes_the_next_write_at_once(tmp_path):
    """The directory of a daemon that exited is not read, and the engine attaches to its successor on the
    next call, as after any restart: a write right after a lookup that found the old daemon gone is not a
    failed put (SGLang stops backing up at one)."""
    runner = _node(tmp_path)
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE)
    try:
        keys = make_keys(PAGES, 4)
        assert engine.write(keys, 0, seed=4)[0] == PAGES
        assert engine.read(keys, PAGES)[0] == PAGES  # through the directory
        runner.kill("dram")
        runner.start("dram")
        assert engine.backend.batch_exists(keys) == 0  # the new daemon holds nothing; the old one is not read
        fresh = make_keys(PAGES, 5)
        written, expected = engine.write(fresh, 0, seed=5)
        assert written == PAGES
        done, got = engine.read(fresh, PAGES)
        assert done == PAGES and got == expected
    finally:
        engine.close()
        runner.stop()
