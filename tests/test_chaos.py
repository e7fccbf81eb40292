"""Chaos: daemons SIGKILLed and restarted under four rank processes (scripts/chaos.py), and the bugs it found."""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time


from tests.support.nodes import dram_tier, eventually, node_toml, nvme_tier, start_node
from tiers.wire import protocol as P
from tiers.shm.buffers import address_of
from tiers.wire.client import Deadlines, TierClient

ENGINE_SIDE = True  # runs the SGLang backend in a subprocess (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = Deadlines(base=1.0, lookup=0.5, connect_wait=0.1, backoff_min=0.05, backoff_max=0.2)

DRAM = dram_tier("8MiB")
NVME = nvme_tier(fsync=True)
NVME_CHAIN = node_toml(DRAM, NVME, write_policy="write_through")


def test_region_transfers_recover_after_a_restart_without_a_lookup(tmp_path):
    """A put/get naming the host-pool region must not carry the region of the session that died with the daemon."""
    runner = start_node(tmp_path, node_toml(NVME))
    fd = os.memfd_create("pool")
    os.ftruncate(fd, 1 << 16)
    view = mmap.mmap(fd, 1 << 16)
    view[:4096] = b"r" * 4096
    client = TierClient("nvme", runner.config.tier("nvme").endpoint, "recover", deadlines=FAST, attach=True)
    try:
        client.attach_region(fd, 1 << 16)
        assert client.lookup(["x"]) == b"\x00"  # hello + region registration
        desc, counts = P.encode_descriptors([[(0, 4096)]])
        assert client.put_region(["a"], desc, counts, 4096) == [True]
        runner.kill("nvme")
        runner.start("nvme")
        # Only transfers from here on, as the engine's backup thread does; like the router, pages travel
        # as frames while the client has no region (a registration that timed out on a loaded machine).
        def put_b():
            if client.region_id is None:
                return client.put_frames(["b"], [[memoryview(view)[:4096]]], 4096)
            return client.put_region(["b"], desc, counts, 4096)

        def get_ab():
            if not client.can_lease():
                found, frames = client.get_frames(["a", "b"], 8192)
                return found == [True, True] and all(f.bytes == b"r" * 4096 for f in frames)
            base = address_of(memoryview(view))
            return client.get_leased(["a", "b"], [[(base + 8192, 4096)], [(base + 12288, 4096)]]) == [True, True] \
                and view[8192:16384] == b"r" * 8192

        assert eventually(lambda: put_b() == [True], 5.0)
        assert eventually(get_ab, 5.0)
    finally:
        client.close()
        view.close()
        os.close(fd)
        runner.stop()


def test_a_tier_with_a_tier_below_acknowledges_writes(tmp_path):
    """write_through over dram -> nvme: the DRAM daemon (which has a tier below) must store pages."""
    runner = start_node(tmp_path, NVME_CHAIN)
    client = TierClient("dram", runner.config.tier("dram").endpoint, "chain", deadlines=FAST)
    try:
        for mode in ("through", "back", "selective"):
            assert client.put_frames([f"k-{mode}"], [[b"c" * 4096]], 4096, mode=mode) == [True], mode
    finally:
        client.close()
        runner.stop()


def run_chaos(tmp_path, *args) -> dict:
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "chaos.py"), "--json", str(out),
                           "--workdir", str(tmp_path / "work"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    if not out.exists():
        raise AssertionError(f"chaos.py wrote no summary (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    summary = json.loads(out.read_text())
    print(f"\nchaos {' '.join(args)}: " + json.dumps({k: summary[k] for k in (
        "kills_by_tier", "recovery_s", "wrong_pages", "acked_pages", "lost_pages", "writes", "reads")}))
    return summary


def test_chaos_short(tmp_path):
    """Four ranks, dram + nvme (fsync) write_through, random SIGKILLs: the promises of docs/RELIABILITY.md."""
    summary = run_chaos(tmp_path, "--seconds", "12", "--hold", "2.5", "--max-down", "0.5", "--seed", "3")
    assert summary["kills"] >= 2
    assert summary["wrong_pages"] == 0
    assert summary["exceptions"] == []
    assert summary["acked_pages"] > 0
    assert summary["lost_pages"] == 0, (summary["lost_examples"], summary.get("lost_diagnosis"),
                                        summary["tier_counters"])
    measured = [r for r in summary["recovery_s"] if r is not None]
    assert measured and max(measured) <= 2.0, summary["recovery_s"]


def test_service_is_back_within_two_seconds_after_a_long_outage(tmp_path):
    """A daemon down long enough for the client's back-off to reach its longest (an NVMe index
    rebuild of 100,000 chunks takes ~9 s): once it answers again, calls must succeed within 2 s."""
    runner = start_node(tmp_path, node_toml(DRAM))
    client = TierClient("dram", runner.config.tier("dram").endpoint, "outage", deadlines=Deadlines())  # defaults
    try:
        assert client.lookup(["k"]) == b"\x00"
        runner.kill("dram")
        # An engine keeps calling while the tier is down for longer than the longest back-off; the
        # client's prober thread keeps saying hello meanwhile, off every engine call.
        end = time.monotonic() + Deadlines().backoff_max + 1.0
        while time.monotonic() < end:
            known_down, started = client.is_down(), time.monotonic()
            assert client.lookup(["k"]) is None
            if known_down:
                assert time.monotonic() - started < 0.05  # a tier known down costs an engine call nothing
            time.sleep(0.05)
        runner.start("dram")
        answering = time.monotonic()
        while client.lookup(["k"]) is None:
            assert time.monotonic() - answering < 10
            time.sleep(0.05)
        back = time.monotonic() - answering
        print(f"\nback {back:.2f} s after the daemon answered")
        assert back <= 2.0
    finally:
        client.close()
        runner.stop()
