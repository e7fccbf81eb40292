"""Hits that pay: a lookup reports only the leading pages whose read beats their recompute.

The rule's arithmetic on exact figures, the read speeds it keeps current, and
the real chain: DRAM and NVMe daemons, the backend from SGLang's factory, an
NVMe tier slowed down by freezing its daemon most of the time (SIGSTOP/SIGCONT
duty cycle, no hook in the product): once a read measured it slow, a lookup
stops reporting the pages only it holds; when it is fast again and its speed
went stale, they are hits again.
"""
import time

import pytest

from hicache_ext.break_even import BreakEven, ReadSpeeds

MB = 1_000_000


def speeds(*rates):
    s = ReadSpeeds(len(rates))
    for tier, rate in enumerate(rates):
        s.observe(tier, int(rate), 1.0)
    return s


def test_every_held_page_is_a_hit_without_a_recompute_cost():
    rule = BreakEven(speeds(1 * MB), recompute_us_per_token=0)
    assert not rule.enabled
    assert rule.paying_pages(b"\x00" * 8, 8, page_bytes=10 * MB, page_tokens=16) == 8


def test_pages_from_a_tier_slower_than_recompute_are_not_hits():
    # 1 MB pages of 16 tokens; recompute 1,000 us a token = 16 ms a page.
    rule = BreakEven(speeds(1000 * MB, 10 * MB), recompute_us_per_token=1000)
    fast, slow = b"\x00", b"\x01"
    assert rule.paying_pages(fast * 4, 4, page_bytes=MB, page_tokens=16) == 4  # 1 ms a page: pays
    assert rule.paying_pages(slow * 4, 4, page_bytes=MB, page_tokens=16) == 0  # 100 ms a page: never
    # The hit stops where the savings stop growing: two fast pages, then only slow ones.
    assert rule.paying_pages(fast * 2 + slow * 6, 8, page_bytes=MB, page_tokens=16) == 2
    # One slow page between fast ones is worth reading when the pages after it pay it back:
    # savings: +15, +30, -54, then +15 a page: six pages later the total (36) is above +30.
    assert rule.paying_pages(fast * 2 + slow + fast * 6, 9, page_bytes=MB, page_tokens=16) == 9
    assert rule.paying_pages(fast * 2 + slow + fast * 5, 8, page_bytes=MB, page_tokens=16) == 2


def test_recompute_grows_with_the_context_so_late_pages_pay_for_a_slow_tier():
    # 50 ms a page from the slow tier; a token costs 100 us + 1,000 us per 1,024 tokens before it.
    rule = BreakEven(speeds(20 * MB), recompute_us_per_token=100, recompute_growth_us_per_ki_token=1000)
    pages = 64
    assert rule.paying_pages(b"\x00" * pages, pages, page_bytes=MB, page_tokens=16, first_token=0) == 0
    # Deep into a long context the same pages cost more to recompute than to read.
    assert rule.paying_pages(b"\x00" * pages, pages, page_bytes=MB, page_tokens=16, first_token=4096) == pages


def test_an_unknown_or_stale_speed_counts_as_free_so_the_next_read_measures_it():
    s = ReadSpeeds(2, stale_s=0.2)
    rule = BreakEven(s, recompute_us_per_token=1000)
    assert rule.paying_pages(b"\x01" * 4, 4, page_bytes=MB, page_tokens=16) == 4  # never measured
    s.observe(1, MB, 1.0)  # 1 MB/s: a page costs 1 s to read, 16 ms to recompute
    assert rule.paying_pages(b"\x01" * 4, 4, page_bytes=MB, page_tokens=16) == 0
    time.sleep(0.3)
    assert s.current()[1] == 0.0
    assert rule.paying_pages(b"\x01" * 4, 4, page_bytes=MB, page_tokens=16) == 4


def test_speeds_average_what_a_byte_costs_so_one_stall_weighs_as_long_as_it_took():
    s = ReadSpeeds(1, weight=0.5)
    s.observe(0, 100, 1.0)  # 0.01 s a byte
    s.observe(0, 100, 3.0)  # 0.03 s a byte
    assert s.current() == [pytest.approx(50.0)]  # 0.02 s a byte
    s.observe(0, 0, 1.0)  # nothing found: no sample
    assert s.current() == [pytest.approx(50.0)]


def test_a_tier_that_reads_slower_than_recompute_stops_giving_hits_until_it_is_fast_again(tmp_path):
    import os
    import signal
    import threading

    from tests.support.backend_env import Engine, make_keys
    from tests.support.nodes import dram_tier, eventually, node_toml, nvme_tier, start_node, thaw

    runner = start_node(tmp_path / "node", node_toml(dram_tier("8MiB"), nvme_tier(fsync=False),
                                                     write_policy="write_through"))
    # 32 KiB pages of 16 tokens; recomputing one costs 16 x 200 us = 3.2 ms (10 MB/s). An unhindered
    # NVMe read of a page here takes well under that (0.1-0.9 ms on this shared virtio disk); a read
    # that waits out a 400 ms stall takes 12 ms a page.
    engine = Engine(runner, model="pays", pages=64, promote=False, recompute_us_per_token=200,
                    read_speed_stale_s=1.0)
    try:
        keys = make_keys(32, salt=9, page_size=16)
        written, sums = engine.write(keys, 0, seed=4)
        assert written == 32
        runner.kill("dram")
        runner.start("dram")  # back empty: only NVMe holds the pages
        assert eventually(lambda: engine.backend.tier_stats()["dram"] is not None, 10)

        assert engine.driver.exists(keys) == 32  # NVMe's speed is not known yet: every page counts
        done, got = engine.read(keys, 32)
        assert done == 32 and got == sums  # and this read measured it: fast
        assert engine.driver.exists(keys) == 32

        nvme = runner.pid("nvme")
        os.kill(nvme, signal.SIGSTOP)
        threading.Timer(0.4, thaw, args=(nvme,)).start()
        done, got = engine.read(keys, 32)  # stalls 400 ms: 1 MiB in > 0.4 s is slower than recomputing
        assert done == 32 and got == sums
        assert engine.driver.exists(keys) == 0, "pages slower to read than to recompute were reported as hits"
        assert engine.backend.router_stats()["unpaid_pages"] == 32

        # Once the slow measurement is stale the pages count again, and a fast read keeps them counting.
        assert eventually(lambda: engine.driver.exists(keys) == 32, 5)
        done, got = engine.read(keys, 32)
        assert done == 32 and got == sums
        assert engine.driver.exists(keys) == 32
    finally:
        thaw(runner.pid("nvme"))
        engine.close()
        runner.stop()


def test_a_read_that_gets_no_reply_in_time_counts_as_slow_once_the_tier_answers_again(tmp_path):
    """A tier frozen past a read's deadline: the read finds nothing, yet it measured the tier (no faster than
    the bytes asked for over the deadline).  When the tier's probe finds it up again, its pages are not hits
    until that speed goes stale: each prefetch would otherwise wait out the deadline once more."""
    import os
    import signal
    import threading

    from tests.support.backend_env import Engine, make_keys
    from tests.support.nodes import eventually, node_toml, nvme_tier, start_node, thaw

    runner = start_node(tmp_path / "node", node_toml(nvme_tier(fsync=False)))
    # 32 KiB pages of 16 tokens, 3.2 ms to recompute each; 1 MiB not read in 0.3 s is 30x slower.
    engine = Engine(runner, model="late", pages=64, promote=False, recompute_us_per_token=200,
                    read_speed_stale_s=3.0, deadline_base_s=0.3)
    nvme = runner.pid("nvme")
    try:
        keys = make_keys(32, salt=11, page_size=16)
        written, sums = engine.write(keys, 0, seed=5)
        assert written == 32
        assert engine.driver.exists(keys) == 32

        os.kill(nvme, signal.SIGSTOP)
        threading.Timer(1.0, thaw, args=(nvme,)).start()
        done, _ = engine.read(keys, 32)
        assert done == 0, "a frozen tier's read was served"
        assert eventually(lambda: engine.backend.tier_stats()["nvme"] is not None, 5), "the tier never came back"
        assert engine.driver.exists(keys) == 0, "the pages of a tier whose read timed out were reported as hits"
        assert engine.backend.router_stats()["unpaid_pages"] == 32

        # The timed-out read's speed goes stale: the pages count again and read back whole.
        assert eventually(lambda: engine.driver.exists(keys) == 32, 6)
        done, got = engine.read(keys, 32)
        assert done == 32 and got == sums
    finally:
        thaw(nvme)
        engine.close()
        runner.stop()
