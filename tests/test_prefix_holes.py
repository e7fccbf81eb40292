"""Prefix lookups and reads across tiers with holes in each, against a brute-force model of the same state."""
import random

import pytest

from hicache_ext.lab.sglang_harness import make_keys, page_bytes
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, node_toml, nvme_tier, start_node
from tiers.wire.client import TierClient

CHAIN = node_toml(dram_tier("16MiB"), nvme_tier(), write_policy="write_through")
N = 16


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    runner = start_node(tmp_path_factory.mktemp("holes"), CHAIN)
    engine = Engine(runner, model="holes", promote=False, pages=2 * N)
    yield runner, engine
    engine.close()
    runner.stop()


def page_bytes_of(engine, first: int, n: int):
    """Each page's bytes as the tiers store it: its host-pool regions concatenated."""
    return page_bytes(engine.pool, engine.indices(first, n))


@pytest.mark.parametrize("trial", range(8))
def test_lookup_and_read_match_the_brute_force_model(chain, trial):
    runner, engine = chain
    rng = random.Random(trial)
    keys = make_keys(N, salt=500 + trial, page_size=16)
    engine.write(keys, 0, seed=trial)  # write_through: fills both tiers...
    contents = page_bytes_of(engine, 0, N)
    clients = {t.name: TierClient(t.name, t.endpoint, engine.backend.namespace) for t in runner.config.tiers}
    try:
        # ...then punch holes: each page ends up in DRAM only, NVMe only, both, or neither.
        placement = {k: rng.choice(["dram", "nvme", "both", "none"]) for k in keys}
        for tier, client in clients.items():
            drop = [k for k, where in placement.items() if where not in (tier, "both")]
            assert client.delete(drop) == len(drop)
        held = [placement[k] != "none" for k in keys]
        expected_prefix = next((i for i, h in enumerate(held) if not h), N)
        assert engine.driver.exists(keys) == expected_prefix
        assert engine.backend.batch_exists(keys) == expected_prefix
        # A read takes each page from whichever tier has it, bytes exact, up to the first hole.
        done, _ = engine.read(keys, N)
        assert done == expected_prefix
        assert page_bytes_of(engine, N, expected_prefix) == contents[:expected_prefix]
        # Per-tier view of the same state, as the daemons report it.
        for tier, client in clients.items():
            flags = client.lookup(keys)
            assert [f == 1 for f in flags] == [placement[k] in (tier, "both") for k in keys]
    finally:
        for client in clients.values():
            client.close()
