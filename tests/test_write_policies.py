"""Each write policy's promise, checked by stopping tiers of a real DRAM -> NVMe chain."""
import os
import signal
import threading
import time

import pytest

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, node_toml, nvme_tier, start_node
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import TierClient

PAGE_BYTES = 32 << 10  # the SMALL_SHAPE page


def chain_config(dram_pages: int, max_dirty: int = 1024, write_policy: str = "write_through", **nvme) -> str:
    return node_toml(dram_tier(dram_pages * PAGE_BYTES), nvme_tier(fsync=True, **nvme), write_policy=write_policy,
                     max_dirty_pages=max_dirty)


def nvme_held(runner, engine, keys):
    """Which keys the NVMe tier itself holds, asked directly."""
    client = TierClient("nvme", runner.config.tier("nvme").endpoint, engine.backend.namespace)
    try:
        flags = client.lookup(keys)
        assert flags is not None, "the NVMe tier did not answer"
        return [b == 1 for b in flags]
    finally:
        client.close()


def tier_stats(engine):
    return engine.backend.tier_stats()


def settle(check, timeout: float = 10.0):
    """Demotion runs on its own thread, after the write was acknowledged: wait for check() to hold."""
    end = time.monotonic() + timeout
    while not check() and time.monotonic() < end:
        time.sleep(0.05)
    return check()


@pytest.fixture
def make_node(tmp_path):
    runners = []

    def make(**kw):  # dram_pages, max_dirty, write_policy; the rest are NVMe tier options
        runner = start_node(tmp_path / f"n{len(runners)}", chain_config(**kw))
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.stop()


def test_write_through_stores_every_tier_at_once(make_node):
    """A chain pays its slowest tier, not the sum: with DRAM frozen, NVMe has the pages while the
    DRAM put still waits for its deadline (one after the other, NVMe would be asked only after it)."""
    runner = make_node(dram_pages=64)
    engine = Engine(runner, write_policy="write_through", model="wt-concurrent")
    dram = runner.pid("dram")
    keys = make_keys(4, salt=7, page_size=16)
    outcome = {}
    writer = threading.Thread(target=lambda: outcome.update(written=engine.write(keys, 0, seed=7)[0]))
    try:
        assert engine.driver.exists(keys) == 0  # sessions open on both tiers before the freeze
        os.kill(dram, signal.SIGSTOP)
        writer.start()
        assert settle(lambda: nvme_held(runner, engine, keys) == [True] * 4, timeout=0.8)
        assert writer.is_alive(), "the NVMe put waited for the DRAM put"
    finally:
        os.kill(dram, signal.SIGCONT)
        writer.join(30)
        engine.close()
    # Thawed within the DRAM put's deadline the batch is acknowledged; past it, it is not: both are right.
    assert not writer.is_alive() and outcome["written"] in (0, 4)


def test_write_through_survives_the_loss_of_the_dram_tier(make_node):
    runner = make_node(dram_pages=64)
    engine = Engine(runner, write_policy="write_through", model="wt", promote_min_reads=1)
    try:
        keys = make_keys(6, salt=1, page_size=16)
        written, sums = engine.write(keys, 0, seed=1)
        assert written == 6 and nvme_held(runner, engine, keys) == [True] * 6
        runner.kill("dram")
        done, got = engine.read(keys, 8)
        assert done == 6 and got == sums  # served by NVMe while DRAM is gone
        runner.start("dram")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and tier_stats(engine)["dram"] is None:
            time.sleep(0.2)
        done, got = engine.read(keys, 16)  # DRAM came back empty: NVMe serves and promotes
        assert done == 6 and got == sums
        # Promotion runs after the read returned, from copies: the slots were the engine's again at once.
        assert settle(lambda: (tier_stats(engine)["dram"] or {}).get("promotions") == 6)
        # The promoter counts a promotion once its put returned, a moment after DRAM counted it.
        assert settle(lambda: engine.backend.router_stats()["promotions_done"] == 6)
        assert engine.driver.exists(keys) == 6
    finally:
        engine.close()


def test_write_back_reaches_nvme_on_eviction_and_on_graceful_stop(make_node):
    runner = make_node(dram_pages=8)
    engine = Engine(runner, write_policy="write_back", model="wb")
    try:
        keys = make_keys(12, salt=2, page_size=16)
        sums = []
        for first in range(0, 12, 4):
            written, batch_sums = engine.write(keys[first:first + 4], first, seed=first)
            assert written == 4
            sums += batch_sums
        # Acknowledged in DRAM only; the 4 oldest were evicted and demoted (by the demotion thread).
        assert settle(lambda: nvme_held(runner, engine, keys) == [True] * 4 + [False] * 8)
        stats = tier_stats(engine)
        assert stats["dram"]["dirty_pages"] == 8 and stats["dram"]["demotions"] == 4
        assert runner.stop("dram") == {"dram": 0}  # graceful: flushes the dirty pages
        assert nvme_held(runner, engine, keys) == [True] * 12
        done, got = engine.read(keys, 12)
        assert done == 12 and got == sums
    finally:
        engine.close()


@pytest.mark.parametrize("interface_v1", [True, False], ids=["zero-copy", "legacy"])
def test_selective_writes_only_hot_pages_below(make_node, interface_v1):
    """Both controller paths carry the policy's threshold (3 reads here, not the daemon's default 2):
    the legacy path used to drop it, and the parents with it."""
    runner = make_node(dram_pages=8)
    engine = Engine(runner, write_policy="selective", selective_min_reads=3, model=f"sel-{interface_v1}",
                    interface_v1=interface_v1)
    try:
        cold_and_hot = make_keys(8, salt=3, page_size=16)
        assert engine.write(cold_and_hot, 0, seed=3)[0] == 8
        for _ in range(3):
            assert engine.read(cold_and_hot[:3], 10)[0] == 3  # hot: read 3 times
        for _ in range(2):
            assert engine.read(cold_and_hot[:5], 10)[0] == 5  # 3 and 4: read only twice
        assert nvme_held(runner, engine, cold_and_hot) == [False] * 8  # nothing below yet
        newer = make_keys(8, salt=4, page_size=16)
        assert engine.write(newer, 0, seed=4)[0] == 8  # evicts all of the first 8
        assert settle(lambda: nvme_held(runner, engine, cold_and_hot) == [True] * 3 + [False] * 5)
        assert runner.stop("dram") == {"dram": 0}
        assert nvme_held(runner, engine, newer) == [False] * 8  # never read: never written below
    finally:
        engine.close()


def test_the_dirty_set_is_bounded_and_visible(make_node):
    runner = make_node(dram_pages=64, max_dirty=4)
    engine = Engine(runner, write_policy="write_back", model="bound")
    try:
        keys = make_keys(12, salt=5, page_size=16)
        assert engine.write(keys, 0, seed=5)[0] == 12
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and tier_stats(engine)["dram"]["dirty_pages"] > 4:
            time.sleep(0.1)
        stats = tier_stats(engine)["dram"]
        assert stats["dirty_pages"] == 4
        assert settle(lambda: nvme_held(runner, engine, keys) == [True] * 8 + [False] * 4)  # oldest first
    finally:
        engine.close()


def test_dirty_pages_go_down_through_shared_memory_aligned_for_o_direct(make_node):
    """A dirty page flushed while DRAM still holds it is not copied into frames: NVMe's daemon copies it
    out of DRAM's arena (mapped read-only) into aligned staging, so NVMe writes it with O_DIRECT."""
    runner = make_node(dram_pages=64, max_dirty=4, direct_writes=True)
    engine = Engine(runner, write_policy="write_back", model="by-region")
    try:
        keys = make_keys(12, salt=9, page_size=16)
        written, sums = engine.write(keys, 0, seed=9)
        assert written == 12
        assert settle(lambda: tier_stats(engine)["dram"]["demotions"] == 8)
        dram = tier_stats(engine)["dram"]
        assert dram["demotions_by_region"] == 8 and dram["demotion_failures"] == 0
        nvme = tier_stats(engine)["nvme"]
        assert nvme["unaligned_writes"] == 0 and (nvme["direct_writes"] == 1.0 or nvme["direct_io"] == 0.0)
        assert runner.stop("dram") == {"dram": 0}  # the last 4 dirty pages go down the same way
        assert nvme_held(runner, engine, keys) == [True] * 12
        done, got = engine.read(keys, 12)  # from NVMe alone, bit-exact
        assert done == 12 and got == sums
        assert tier_stats(engine)["nvme"]["unaligned_writes"] == 0
    finally:
        engine.close()


def test_a_crash_under_write_back_loses_at_most_max_dirty_pages_acknowledged_pages(make_node):
    """Issue 29, attack 7: SIGKILL of the DRAM daemon under write_back lost 276-325 acknowledged pages with
    max_dirty_pages=16; now a put past the bound writes the oldest below before it is answered."""
    runner = make_node(dram_pages=512, max_dirty=16, write_policy="write_back")
    dram = TierClient("dram", runner.config.tier("dram").endpoint, "crash-wb", "test")
    acknowledged = []
    for batch in range(30):
        keys = [f"p{batch}-{i}" for i in range(10)]
        stored = dram.put_frames(keys, [[bytes([batch]) * PAGE_BYTES]] * 10, 10 * PAGE_BYTES, mode="back")
        acknowledged += [k for k, ok in zip(keys, stored) if ok]
    dram.close()
    os.kill(runner.pid("dram"), signal.SIGKILL)
    nvme = TierClient("nvme", runner.config.tier("nvme").endpoint, "crash-wb", "test")
    try:
        held = nvme.lookup(acknowledged)
        lost = sum(1 for b in held if b == 0)
    finally:
        nvme.close()
    print(f"\nwrite_back, max_dirty_pages 16, SIGKILL after {len(acknowledged)} acknowledged pages: {lost} lost")
    assert len(acknowledged) == 300 and lost <= 16, lost


def test_write_back_of_many_namespaces_goes_down_one_connection_and_stops_gracefully(tmp_path):
    """Issue 29, attack 7: the demotion link kept one client (a connection and an attach) per namespace, so
    a DRAM daemon holding dirty pages of ~1,000 namespaces ran out of descriptors, stopped demoting and
    exited 1 on SIGTERM without its flush. Here both daemons have 256 descriptors and 400 namespaces each
    write one page back: SIGTERM flushes all 400 through one session and exits 0."""
    namespaces = [f"tenant{i:03d}" for i in range(400)]
    runner = NodeRunner(chain_config(dram_pages=1024, write_policy="write_back"), str(tmp_path / "run"),
                        str(tmp_path / "data"))
    runner.limit_fds = (256, 256)
    runner.start()
    try:
        endpoint = runner.config.tier("dram").endpoint
        for ns in namespaces:  # a client a namespace, closed at once: this process keeps its descriptors
            dram = TierClient("dram", endpoint, ns, "test")
            try:
                assert dram.put_frames(["page"], [[ns.encode() * (PAGE_BYTES // 9)]], PAGE_BYTES,
                                       mode="back") == [True]
            finally:
                dram.close()
        nvme = TierClient("nvme", runner.config.tier("nvme").endpoint, "_admin", "test")
        try:
            fds_before = nvme.stats()["open_fds"]
            assert runner.stop("dram") == {"dram": 0}  # the graceful flush: every dirty page goes down
            stats = nvme.stats()
        finally:
            nvme.close()
        print(f"\n400 namespaces written back through the DRAM daemon: NVMe holds {stats['pages']} pages, "
              f"its open descriptors {fds_before} -> {stats['open_fds']}")
        assert stats["pages"] == 400
        assert stats["open_fds"] < fds_before + 8  # one demotion connection and its attach, not 400
        for ns in namespaces[::37]:
            nvme = TierClient("nvme", runner.config.tier("nvme").endpoint, ns, "test")
            try:
                found, frames = nvme.get_frames(["page"], PAGE_BYTES)
                assert found == [True] and bytes(frames[0]) == ns.encode() * (PAGE_BYTES // 9)
            finally:
                nvme.close()
    finally:
        runner.stop()
