"""SGLang's failure injector around the backend, and buffer_only host mode's storage-existence beliefs."""
from sglang.srt.mem_cache.buffer_mode.storage_existence_cache import ChainPagesPolicy, StorageExistenceCache
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector, PoolName

from hicache_ext.lab.sglang_harness import make_keys, page_checksums
from tests.support.backend_env import Engine
from tests.support.nodes import module_node
from tiers.wire.client import TierClient


node = module_node("modes")


def test_random_failures_and_delays_from_sglangs_injector_lose_nothing_written(node, monkeypatch):
    # What SGLang's CI sets: StorageBackendFactory wraps the backend, which then
    # sees only the ABC's calls, some delayed, some replaced by a failure.
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    engine = Engine(node, model="injector", pages=16)
    assert isinstance(engine.backend, HiCacheStorageFailureInjector)
    written, read = [], []
    try:
        for trial in range(30):
            keys = make_keys(4, salt=3000 + trial, page_size=16)
            done, sums = engine.write(keys, 0, seed=trial)
            assert done in (0, 4)  # one call per batch: all of it or, injected, nothing
            got, got_sums = engine.read(keys, 4)
            assert got <= done and got_sums[:got] == sums[:got]
            written.append(done)
            read.append(got)
        assert 0 in written and 4 in written and 0 in read and 4 in read  # both outcomes were exercised
        assert engine.backend.get_stats() is not None  # forwarded by the injector
    finally:
        engine.close()
    # Without the injector every acknowledged page is there, bytes exact.
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE")
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY")
    check = Engine(node, model="injector", pages=16)
    try:
        for trial, done in enumerate(written):
            keys = make_keys(4, salt=3000 + trial, page_size=16)
            assert check.driver.exists(keys) == done
    finally:
        check.close()


def test_buffer_only_beliefs_heal_when_the_tiers_lost_pages(node):
    """buffer_only keeps no host copy and trusts an LRU of hashes believed stored
    (StorageExistenceCache); a hit-query shortfall from the backend is what heals a
    stale belief, so the backend must never report a page it no longer has."""
    engine = Engine(node, model="buffer-only", pages=16)
    beliefs = StorageExistenceCache().pool(PoolName.KV)
    policy = ChainPagesPolicy()
    keys = make_keys(8, salt=4000, page_size=16)
    try:
        assert engine.write(keys, 0, seed=1)[0] == 8
        beliefs.add(keys)  # the storage ack feeds the beliefs
        sums = page_checksums(engine.pool, engine.indices(0, 8))
        assert beliefs.covered(keys)  # a re-insert now skips the write
        # The tiers lose the tail (eviction, a restart, another tenant's pressure).
        client = TierClient("dram", node.config.tiers[0].endpoint, engine.backend.namespace)
        try:
            assert client.delete(keys[5:]) == 3
        finally:
            client.close()
        hits = engine.driver.exists(keys)
        assert hits == 5
        policy.heal_from_query(beliefs, keys, keys, hits, evidence=True)
        assert beliefs.covered(keys[:5]) and not beliefs.covered(keys)
        missing = [k for k in keys if not beliefs.covered([k])]
        assert missing == keys[5:]
        # The next insert writes back only what is not believed stored, prefix-linked to the rest.
        assert engine.driver.backup(missing, engine.indices(5, 3), prefix_keys=keys[:5]) == 3
        beliefs.add(missing)
        assert engine.driver.exists(keys) == 8
        assert engine.read(keys, 8) == (8, sums)
    finally:
        engine.close()
