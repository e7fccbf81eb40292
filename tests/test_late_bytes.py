"""No byte lands in engine memory after the engine stopped waiting, whatever moment a daemon freezes.

Each trial reads a batch through the real backend (SGLang's page functions,
a real memfd host pool) while another thread SIGSTOPs the tier daemon at a
random moment.  When the call returns, the test does what SGLang does next:
it reuses the slots (writes a pattern of its own), thaws the daemon, lets it
finish whatever it was doing, and checks the slots still hold that pattern
byte for byte.  Pages the call reported loaded must be the written bytes.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from hicache_ext.lab.sglang_harness import fill_pages, page_checksums
from tests.support.backend_env import Engine, make_keys
from tests.support.nodes import dram_tier, node_toml, nvme_tier, remote_node, start_node

SHAPE = dict(layers=8, kv_heads=2, head_dim=128, page_size=32)  # 256 KiB pages
PAGES = 48
TRIALS = 12
MAX_TRIALS = 40

def _config(tiers: str) -> str:
    # The DRAM tier's reads through its page directory never wait on the daemon (tests/test_page_directory.py
    # freezes it under them): here every read is a leased one, the path a freeze can cut short.
    chain = [dram_tier("64MiB", block_size="64KiB", engine_reads=False)] if "dram" in tiers else []
    chain += [nvme_tier("256MiB", staging_bytes="64MiB")] if "nvme" in tiers else []
    return node_toml(*chain, write_policy="write_through")


def _wait_up(engine: Engine, keys, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine.backend.batch_exists(keys[:1]) == 1:
            return
        time.sleep(0.05)
    raise AssertionError("the tier did not come back after SIGCONT")


@pytest.mark.parametrize("tiers, frozen", [("dram", "dram"), ("nvme", "nvme"), ("remote", "remote"),
                                           ("remote", "pool0")])
def test_a_frozen_daemon_never_writes_after_the_engine_gave_up(tmp_path, tiers, frozen):
    rng = random.Random(1234)
    pool = None
    if tiers == "remote":
        runner, pool = remote_node(tmp_path)
    else:
        runner = start_node(tmp_path, _config(tiers))
    owner = pool if frozen.startswith("pool") else runner
    # A remote read crosses two daemons and the Transfer Engine: a looser (still short) deadline.
    base = 0.6 if tiers == "remote" else 0.15
    engine = Engine(runner, pages=2 * PAGES, shape=SHAPE, deadline_base_s=base, deadline_min_gbps=50.0,
                    lookup_timeout_s=1.0)
    try:
        keys = make_keys(PAGES, 5)
        written, expected = engine.write(keys, 0, seed=11)
        assert written == PAGES
        pid = owner.pid(frozen)
        # Freezes land anywhere in the first half of a read (the daemon's part comes first).
        spans = []
        for _ in range(3):
            # A whole read's time: the deadline is short on purpose, so on a loaded machine (another test
            # worker beside this one) a read may pass it and miss; only whole reads are timed.
            for _attempt in range(5):
                started = time.perf_counter()
                if engine.driver.prefetch(keys, engine.indices(PAGES, PAGES)) == PAGES:
                    spans.append(time.perf_counter() - started)
                    break
                _wait_up(engine, keys)
        assert len(spans) == 3, "the tier never served a whole read within its deadline"
        window = sorted(spans)[1] / 2
        cut_short = late = wrong = trials = 0
        # At least TRIALS freezes, more (up to MAX_TRIALS) until 3 of them cut a read short: with DRAM
        # the daemon's part of a read is a millisecond, so many freezes land after it.
        for trial in range(MAX_TRIALS):
            if trial >= TRIALS and cut_short >= 3:
                break
            trials += 1
            if trial >= TRIALS:
                window = max(window / 2, 0.001)
            _wait_up(engine, keys)
            idx = engine.indices(PAGES, PAGES)  # the second half of the pool: the read's destination
            fill_pages(engine.pool, idx, seed=1000 + trial)
            delay = rng.uniform(0.0, window)
            stopper = threading.Timer(delay, os.kill, (pid, signal.SIGSTOP))
            stopper.start()
            done = engine.driver.prefetch(keys, idx)
            stopper.join()
            loaded = page_checksums(engine.pool, idx)
            wrong += sum(1 for i in range(done) if loaded[i] != expected[i])
            cut_short += done < PAGES
            # SGLang reuses the slots at once: the engine's own bytes go there now.
            fill_pages(engine.pool, idx, seed=5000 + trial)
            mine = page_checksums(engine.pool, idx)
            os.kill(pid, signal.SIGCONT)
            # Let the thawed daemon finish whatever it was doing: once it answers a lookup its loop runs again,
            # and a read's copy into the slots (12 MiB) takes a few ms after that.
            _wait_up(engine, keys)
            time.sleep(0.1)
            late += sum(1 for a, b in zip(page_checksums(engine.pool, idx), mine) if a != b)
        print(f"\n{tiers}, {frozen} frozen: {trials} trials, {cut_short} cut short, {trials * PAGES} slots checked, "
              f"{late} changed late, {wrong} wrong")
        assert wrong == 0, f"{wrong} pages reported loaded held other bytes"
        assert late == 0, f"{late} pages changed after the engine stopped waiting"
        # The freezes must have cut calls short, or the test proved nothing.
        assert cut_short >= 3, f"only {cut_short} of {trials} reads were cut short by a freeze"
    finally:
        try:
            os.kill(owner.pid(frozen), signal.SIGCONT)
        except (OSError, KeyError):
            pass
        engine.close()
        runner.stop()
        if pool is not None:
            pool.stop()
