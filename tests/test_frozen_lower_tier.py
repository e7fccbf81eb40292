"""A frozen lower tier never slows the top tier: lookups, write-back writes and evictions go on."""
from __future__ import annotations

import os
import signal
import time

from hicache_ext.lab.sglang_harness import make_keys
from tests.backend_env import Engine
from tests.nodes import dram_tier, node_toml, nvme_tier, start_node, thaw
from tiers.wire.client import TierClient

PAGE_BYTES = 32 << 10  # the SMALL_SHAPE page

CHAIN = node_toml(dram_tier(32 * PAGE_BYTES), nvme_tier(), write_policy="write_back",
                  demotion_queue_bytes=16 * PAGE_BYTES)


def _admin_stats(runner, tier: str) -> dict:
    client = TierClient(tier, runner.config.tier(tier).endpoint, "_admin", "test")
    try:
        return client.stats()
    finally:
        client.close()


def test_frozen_nvme_leaves_dram_lookups_and_write_back_fast(tmp_path):
    runner = start_node(tmp_path, CHAIN)
    engine = Engine(runner, pages=64, write_policy="write_back", model="frozen-below")
    nvme = runner.pid("nvme")
    try:
        held = make_keys(16, salt=1, page_size=16)
        assert engine.write(held, 0, seed=1)[0] == 16
        assert engine.driver.exists(held) == 16  # both tiers answer while NVMe is alive
        os.kill(nvme, signal.SIGSTOP)
        lookups = []
        for _ in range(40):
            started = time.perf_counter()
            assert engine.driver.exists(held) == 16
            lookups.append(time.perf_counter() - started)
        # Write-back batches that evict (32 pages of DRAM): nothing of them waits on NVMe.
        writes = []
        for batch in range(6):
            keys = make_keys(8, salt=100 + batch, page_size=16)
            started = time.perf_counter()
            assert engine.write(keys, 16 + (batch % 4) * 8, seed=batch)[0] == 8
            writes.append(time.perf_counter() - started)
        dram = _admin_stats(runner, "dram")
        assert dram["evictions"] >= 16
        queued, dropped = dram["demotion_queued_pages"], dram["demotion_dropped"]
        assert queued >= 1 and queued + dropped >= dram["evictions"] - 1
        print(f"\nfrozen NVMe: lookup max {max(lookups) * 1e3:.1f} ms, write-back batch max "
              f"{max(writes) * 1e3:.1f} ms; {queued} pages queued for NVMe, {dropped} dropped (counted)")
        assert max(lookups) < 0.1, f"a DRAM-covered lookup took {max(lookups) * 1e3:.0f} ms"
        assert max(writes) < 0.5, f"a write-back batch took {max(writes) * 1e3:.0f} ms"
        os.kill(nvme, signal.SIGCONT)
        # Thawed: what was queued reaches NVMe.
        end = time.monotonic() + 15
        while _admin_stats(runner, "dram")["demotion_queued_pages"] and time.monotonic() < end:
            time.sleep(0.1)
        after = _admin_stats(runner, "dram")
        assert after["demotion_queued_pages"] == 0 and after["demotions"] >= queued
    finally:
        thaw(nvme)
        engine.close()
        runner.stop()


def test_pages_pinned_for_a_frozen_nvme_stay_bounded_and_are_released(tmp_path):
    """Dirty pages over the bound go down pinned in DRAM's arena (no copy): with NVMe frozen they stay
    pinned, at most a quarter of the arena (the queue would take half of it here), and DRAM writes keep
    succeeding fast around them; thawed, they reach NVMe and every pin is released."""
    chain = node_toml(dram_tier(32 * PAGE_BYTES), nvme_tier(), write_policy="write_back",
                      demotion_queue_bytes=16 * PAGE_BYTES, max_dirty_pages=4)
    runner = start_node(tmp_path, chain)
    engine = Engine(runner, pages=64, write_policy="write_back", model="pinned-below")
    nvme = runner.pid("nvme")
    try:
        assert engine.write(make_keys(8, salt=1, page_size=16), 0, seed=1)[0] == 8
        end = time.monotonic() + 10
        while _admin_stats(runner, "dram")["demotions_by_region"] < 4 and time.monotonic() < end:
            time.sleep(0.05)
        assert _admin_stats(runner, "dram")["demotions_by_region"] >= 4  # the pinned path is in use
        os.kill(nvme, signal.SIGSTOP)
        writes = []

        def write(batch: int) -> None:
            keys = make_keys(8, salt=200 + batch, page_size=16)
            started = time.perf_counter()
            assert engine.write(keys, 8 + (batch % 4) * 8, seed=batch)[0] == 8  # never refused for pins
            writes.append(time.perf_counter() - started)
        for batch in range(2):  # 24 pages in a 32-page DRAM: nothing evicted, 20 over the dirty bound
            write(batch)
        end = time.monotonic() + 5
        while _admin_stats(runner, "dram")["leases"] == 0 and time.monotonic() < end:
            time.sleep(0.05)  # the flusher pins them for NVMe, which does not answer
        time.sleep(0.3)
        dram = _admin_stats(runner, "dram")
        print(f"\nfrozen NVMe: {dram['leases']} pages pinned, {dram['demotion_queued_pages']} queued")
        assert 1 <= dram["leases"] <= 8  # pinned pages: a quarter of the 32-page arena (a lease a page)
        assert dram["demotion_queued_bytes"] <= 16 * PAGE_BYTES
        for batch in range(2, 8):  # now writes must evict around the pinned blocks
            write(batch)
        assert _admin_stats(runner, "dram")["evictions"] >= 16
        assert max(writes) < 0.5, f"a write-back batch took {max(writes) * 1e3:.0f} ms"
        os.kill(nvme, signal.SIGCONT)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            dram = _admin_stats(runner, "dram")
            if dram["demotion_queued_pages"] == 0 and dram["leases"] == 0:
                break
            time.sleep(0.1)
        assert dram["demotion_queued_pages"] == 0 and dram["leases"] == 0  # every pin released
    finally:
        thaw(nvme)
        engine.close()
        runner.stop()
