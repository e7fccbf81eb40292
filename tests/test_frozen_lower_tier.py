"""A frozen lower tier never slows the top tier: lookups, write-back writes and evictions go on."""
from __future__ import annotations

import os
import signal
import time

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, node_toml, nvme_tier, start_node, thaw
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


def test_write_back_past_its_bound_with_nvme_frozen_is_refused_not_promised(tmp_path):
    """write_back promises a crash loses at most max_dirty_pages acknowledged pages: past the bound a put
    writes the oldest dirty pages below first (pinned in DRAM's arena, no copy). With NVMe frozen that
    fails, so those puts are not acknowledged: the first waits one deadline, the next fail at once (the
    link is down), the pages not yet below never exceed the bound, and every pin is released. Thawed,
    write-back puts are acknowledged again."""
    chain = node_toml(dram_tier(32 * PAGE_BYTES), nvme_tier(), write_policy="write_back",
                      demotion_queue_bytes=16 * PAGE_BYTES, max_dirty_pages=4)
    runner = start_node(tmp_path, chain)
    engine = Engine(runner, pages=64, write_policy="write_back", model="pinned-below")
    nvme = runner.pid("nvme")
    try:
        assert engine.write(make_keys(8, salt=1, page_size=16), 0, seed=1)[0] == 8
        dram = _admin_stats(runner, "dram")
        assert dram["write_back_written_down"] == 4 and dram["demotions_by_region"] >= 4  # pinned, no copy
        assert dram["write_back_unsafe_pages"] == 4
        os.kill(nvme, signal.SIGSTOP)
        writes, acknowledged = [], []
        for batch in range(4):
            keys = make_keys(8, salt=200 + batch, page_size=16)
            started = time.perf_counter()
            acknowledged.append(engine.write(keys, 8 + (batch % 4) * 8, seed=batch)[0])
            writes.append(time.perf_counter() - started)
            assert _admin_stats(runner, "dram")["write_back_unsafe_pages"] <= 4
        dram = _admin_stats(runner, "dram")
        print(f"\nfrozen NVMe: write-back batches acknowledged {acknowledged} of 8, took "
              f"{[round(w * 1e3) for w in writes]} ms; {dram['write_back_refused']} pages refused, "
              f"{dram['leases']} pinned")
        assert acknowledged == [0, 0, 0, 0] and dram["write_back_refused"] >= 32
        assert writes[0] < 5.0 and max(writes[1:]) < 0.5, writes
        assert dram["leases"] == 0  # the pins of the failed write-down were released
        os.kill(nvme, signal.SIGCONT)
        end = time.monotonic() + 15
        done = 0
        while time.monotonic() < end and done < 8:
            done = engine.write(make_keys(8, salt=300, page_size=16), 40, seed=9)[0]
            time.sleep(0.2)
        assert done == 8  # thawed (and the link back up): acknowledged again
        dram = _admin_stats(runner, "dram")
        assert dram["write_back_unsafe_pages"] <= 4 and dram["leases"] == 0
    finally:
        thaw(nvme)
        engine.close()
        runner.stop()
