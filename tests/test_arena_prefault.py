"""A daemon serves at once and faults its staging arena in behind it; its stats say when that is done.

Benchmarks wait for ``arena_prefaulted`` (hicache_ext/lab/bench/rig.py Node): a copy into blocks not
yet faulted in runs ~10x slower, and a measurement then times the faults, not the daemon.
"""
import time

from tiers.shm.arena import BlockArena
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import TierClient
from tests.support.nodes import eventually


def test_an_arena_says_when_it_is_faulted_in():
    lazy = BlockArena(1 << 20, 64 << 10, "lazy", prefault=False)
    now = BlockArena(1 << 20, 64 << 10, "now", prefault=True)
    behind = BlockArena(64 << 20, 64 << 10, "behind", prefault=True, background=True)
    try:
        assert lazy.prefaulted.is_set() and now.prefaulted.is_set()
        assert behind.prefaulted.wait(30)
    finally:
        for arena in (lazy, now, behind):
            arena.close()


def test_a_daemon_reports_its_staging_faulted_in(tmp_path):
    config = f"""
[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "64MiB"
staging_bytes = "64MiB"
path = "{tmp_path / 'nvme'}"
"""
    with NodeRunner(config, str(tmp_path / "run"), str(tmp_path / "data")) as node:
        client = TierClient("nvme", node.config.tier("nvme").endpoint, "probe")
        try:
            stats = client.stats()
            assert stats is not None and stats["arena_prefaulted"] in (0.0, 1.0)
            assert eventually(lambda: client.stats()["arena_prefaulted"] == 1.0, 30)
        finally:
            client.close()
