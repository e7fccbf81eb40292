"""Reads planned from the lookup before them, and promotion after the read returned.

Unit tests of the plan and the promoter, then the real chain: DRAM and NVMe
daemons, the backend from SGLang's factory, pages only NVMe holds (DRAM was
restarted empty).  With DRAM frozen after the lookup, the read of those
pages must not wait for it: the lookup said DRAM does not hold them.
"""
import os
import signal
import threading
import time

from hicache_ext.lab.sglang_harness import make_keys
from hicache_ext.read_plan import UNKNOWN, LookupHints, Promoter, fastest_tiers
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, eventually, node_toml, nvme_tier, start_node


def test_a_read_of_a_run_of_looked_up_keys_gets_each_keys_fastest_tier():
    hints = LookupHints(tiers=3, ttl=60)
    keys = [f"k{i}" for i in range(8)]
    hints.remember(keys, fastest_tiers([b"\x01\x01\x00\x00\x00\x00\x01\x00", None,
                                        b"\x01\x00\x01\x01\x00\x00\x01\x00"], len(keys)))
    assert hints.plan(keys) == bytes([0, 0, 2, 2, UNKNOWN, UNKNOWN, 0, UNKNOWN])
    assert hints.plan(keys[2:5]) == bytes([2, 2, UNKNOWN])  # SGLang reads in chunks
    assert hints.plan(["k3", "k5"]) is None  # not a run of the lookup: no plan, the read walks the chain
    assert hints.plan(["other"]) is None


def test_a_plan_expires_and_the_newest_lookup_wins():
    hints = LookupHints(tiers=2, ttl=0.2)
    keys = ["a", "b"]
    hints.remember(keys, fastest_tiers([b"\x00\x00", b"\x01\x01"], 2))
    hints.remember(keys, fastest_tiers([b"\x01\x00", b"\x01\x01"], 2))
    assert hints.plan(keys) == b"\x00\x01"
    time.sleep(0.3)
    assert hints.plan(keys) is None


def test_promotions_past_the_bound_are_dropped_and_counted():
    release = threading.Event()
    stored = []

    def put(keys, copies):
        release.wait(5)
        stored.append((keys, copies))
        return [True] * len(keys)

    promoter = Promoter(max_bytes=3000)
    try:
        page = bytearray(b"x" * 1000)
        assert promoter.submit(["a", "b"], [[memoryview(page)], [memoryview(page)]], put)
        page[:] = b"y" * 1000  # the engine reuses its slot once the read returned: the copy keeps the old bytes
        assert not promoter.submit(["c", "d"], [[memoryview(page)], [memoryview(page)]], put)  # 4000 > 3000
        release.set()
        assert promoter.drain(5)
        assert stored == [(["a", "b"], [[b"x" * 1000], [b"x" * 1000]])]
        assert promoter.counters() == {"promotions_queued": 2, "promotions_done": 2, "promotions_dropped": 2,
                                       "promotions_failed": 0, "promotion_bytes_in_flight": 0}
    finally:
        release.set()
        promoter.close()


def _only_nvme_holds_six_pages(runner, engine, salt: int, seed: int):
    """Six pages written through DRAM and NVMe, then DRAM restarted empty: (keys, their checksums),
    after a lookup that found all six (NVMe holds them, DRAM none)."""
    keys = make_keys(6, salt=salt, page_size=16)
    written, sums = engine.write(keys, 0, seed=seed)
    assert written == 6
    runner.kill("dram")
    runner.start("dram")  # back, empty: only NVMe holds the pages
    assert eventually(lambda: engine.backend.tier_stats()["dram"] is not None, 10)
    assert engine.driver.exists(keys) == 6  # the lookup: NVMe holds all six, DRAM none
    return keys, sums


def test_a_read_asks_only_the_tier_the_lookup_named_and_promotes_afterwards(tmp_path):
    config = node_toml(dram_tier("8MiB"), nvme_tier(fsync=False), write_policy="write_through")
    runner = start_node(tmp_path / "node", config)
    engine = Engine(runner, model="plan", pages=16, deadline_base_s=2.0, promote_min_reads=1)
    try:
        keys, sums = _only_nvme_holds_six_pages(runner, engine, salt=5, seed=3)
        dram = runner.pid("dram")
        os.kill(dram, signal.SIGSTOP)
        try:
            start = time.monotonic()
            done, got = engine.read(keys, 8)
            elapsed = time.monotonic() - start
            assert done == 6 and got == sums
            # Asking the frozen DRAM tier first would have cost its whole deadline (2 s) before NVMe.
            assert elapsed < 1.0, f"the read waited {elapsed:.2f}s for a tier the lookup said holds nothing"
        finally:
            os.kill(dram, signal.SIGCONT)
        # The promotion ran after the read, from copies; once DRAM thawed it holds the pages.
        def ended():
            counts = engine.backend.router_stats()
            return counts["promotions_done"] + counts["promotions_failed"] == 6
        assert eventually(ended, 15)
        stats = engine.backend.router_stats()
        assert stats["promotions_queued"] == 6 and stats["promotions_dropped"] == 0
        if stats["promotions_done"] == 6:  # the put waited out the freeze within its deadline
            assert eventually(lambda: engine.backend.tier_stats()["dram"]["pages"] == 6, 10)
        else:
            assert stats["promotions_failed"] == 6
    finally:
        engine.close()
        runner.stop()


def test_a_promotion_copied_after_the_engine_reused_its_slots_is_refused_not_stored(tmp_path):
    """The top tier copies a promotion out of the host pool itself, after the read returned, and keeps a
    page only if its bytes still match the checksum the read verified: here the engine overwrote the
    slots first (DRAM frozen until then), so DRAM refuses all six and holds nothing wrong. Then the same
    read with the slots left alone: DRAM takes the six and serves the exact bytes."""
    from hicache_ext.lab.sglang_harness import fill_pages
    config = node_toml(dram_tier("8MiB"), nvme_tier(fsync=False), write_policy="write_through")
    runner = start_node(tmp_path / "node", config)
    engine = Engine(runner, model="checked", pages=16, deadline_base_s=5.0, promote_min_reads=1)
    try:
        keys, sums = _only_nvme_holds_six_pages(runner, engine, salt=9, seed=4)
        dram = runner.pid("dram")
        os.kill(dram, signal.SIGSTOP)
        try:
            done, got = engine.read(keys, 8)
            assert done == 6 and got == sums
            # The promotion is queued (a checked put from the host pool), not yet copied by DRAM.
            assert eventually(lambda: engine.backend.router_stats()["promotions_queued"] == 6, 5)
            time.sleep(0.2)  # past the promotion's delay: its put is on DRAM's socket
            fill_pages(engine.pool, engine.indices(8, 6), seed=99)  # the engine reuses the slots
        finally:
            os.kill(dram, signal.SIGCONT)

        def ended(total):
            counts = engine.backend.router_stats()
            return counts["promotions_done"] + counts["promotions_failed"] == total
        assert eventually(lambda: ended(6), 15)
        stats = engine.backend.router_stats()
        assert stats["promotions_done"] == 0 and stats["promotions_failed"] == 6, stats
        dram_stats = engine.backend.tier_stats()["dram"]
        assert dram_stats["sum_refused"] == 6 and dram_stats["pages"] == 0, dram_stats

        assert engine.driver.exists(keys) == 6
        done, got = engine.read(keys, 8)
        assert done == 6 and got == sums
        assert eventually(lambda: ended(12), 15)
        assert engine.backend.router_stats()["promotions_done"] == 6
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["pages"] == 6, 10)
        runner.kill("nvme")  # now only DRAM can serve them: the exact bytes written
        assert engine.driver.exists(keys) == 6
        done, got = engine.read(keys, 0)
        assert done == 6 and got == sums
    finally:
        engine.close()
        runner.stop()


def test_a_page_is_admitted_to_the_top_tier_on_its_min_reads_th_read_from_below():
    from tiers.policies.admission import ReadAdmission
    every = ReadAdmission(1)
    assert every.admit(["a", "a", "b"]) == [True, True, True] and len(every) == 0  # remembers nothing
    second = ReadAdmission(2)
    assert second.admit(["a", "b"]) == [False, False]
    assert second.admit(["b", "c"]) == [True, False]
    assert second.admit(["b"]) == [True]  # read from below again after its promotion: promoted again
    assert second.not_admitted == 3
    third = ReadAdmission(3)
    assert [third.admit(["x"])[0] for _ in range(4)] == [False, False, True, True]


def test_read_counts_are_bounded_and_the_least_recently_read_are_forgotten():
    import pytest

    from tiers.policies.admission import ReadAdmission
    bounded = ReadAdmission(2, remember=3)
    bounded.admit(["a", "b", "c"])
    bounded.admit(["a"])  # a promoted; read last, it is the most recent
    bounded.admit(["d", "e"])  # past 3 remembered: b and c, the least recently read, go
    assert len(bounded) == 3
    assert bounded.admit(["b", "a"]) == [False, True]  # b counts as read for the first time
    big = ReadAdmission(2, remember=1000)
    big.admit(f"k{i}" for i in range(10_000))
    assert len(big) == 1000
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ReadAdmission(bad)


def test_a_page_read_from_below_once_is_not_promoted_and_its_second_read_promotes_it(tmp_path):
    """The default promote_min_reads = 2 on the real chain: the first read from NVMe leaves DRAM as it was
    (counted as not admitted), the second promotes every page, and DRAM then serves the exact bytes."""
    config = node_toml(dram_tier("8MiB"), nvme_tier(fsync=False), write_policy="write_through")
    runner = start_node(tmp_path / "node", config)
    engine = Engine(runner, model="second", pages=16)
    try:
        keys, sums = _only_nvme_holds_six_pages(runner, engine, salt=13, seed=6)
        assert engine.read(keys, 8) == (6, sums)
        stats = engine.backend.router_stats()
        assert stats["promotions_not_admitted"] == 6 and stats["promotions_queued"] == 0, stats
        time.sleep(0.3)  # past a promotion's start (20 ms after its read): none was sent
        assert engine.backend.tier_stats()["dram"]["pages"] == 0

        assert engine.driver.exists(keys) == 6
        assert engine.read(keys, 8) == (6, sums)
        assert eventually(lambda: engine.backend.router_stats()["promotions_done"] == 6, 10)
        assert engine.backend.router_stats()["promotions_not_admitted"] == 6
        assert eventually(lambda: engine.backend.tier_stats()["dram"]["pages"] == 6, 10)
        runner.kill("nvme")  # only DRAM can serve them now: the exact bytes written
        assert engine.driver.exists(keys) == 6
        assert engine.read(keys, 0) == (6, sums)
    finally:
        engine.close()
        runner.stop()
