"""The backend as SGLang builds and drives it: factory, real host pool, controller page functions."""
import pytest

from hicache_ext import TieredHiCacheStorage
from tests.support.backend_env import Engine, make_keys
from tests.support.nodes import dram_config, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    runner = start_node(tmp_path_factory.mktemp("backend"), dram_config(capacity="64MiB"))
    yield runner
    runner.stop()


def _inner(backend):
    """The backend itself, also when SGLang wrapped it in its failure injector."""
    return getattr(backend, "_backend", backend)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("allocator", ["shm", "default"])
@pytest.mark.parametrize("interface_v1", [True, False])
def test_pages_round_trip_byte_for_byte(node, layout, allocator, interface_v1):
    engine = Engine(node, layout=layout, allocator=allocator, interface_v1=interface_v1, model=f"rt-{layout}-{allocator}-{int(interface_v1)}")
    try:
        backend = _inner(engine.backend)
        assert isinstance(backend, TieredHiCacheStorage)
        assert engine.driver.zero_copy == interface_v1
        salt = ["page_first", "layer_first"].index(layout) * 4 + ["shm", "default"].index(allocator) * 2 + interface_v1
        keys = make_keys(20, salt=salt, page_size=16)
        written, sums = engine.write(keys, first_page=0, seed=7)
        assert written == 20
        assert engine.driver.exists(keys) == 20
        assert engine.driver.exists(keys[:5] + make_keys(3, salt=999, page_size=16)) == 5
        done, got = engine.read(keys, first_page=10)
        assert done == 20
        assert got == sums
        # The daemon maps the host pool only when SGLang put it in a memfd.
        region = backend._router.clients[0].region_id
        assert (region is not None) == (allocator == "shm")
        metrics = backend.get_stats()
        assert sum(metrics.backup_pgs) == 20 and sum(metrics.prefetch_pgs) == 20
        assert backend.get_stats().backup_pgs == []  # drained per call
    finally:
        engine.close()


def test_a_partial_hit_reads_only_the_leading_pages(node):
    engine = Engine(node, model="partial")
    try:
        keys = make_keys(8, salt=5, page_size=16)
        assert engine.write(keys[:4], 0, seed=3)[0] == 4
        done, _ = engine.read(keys, first_page=8)
        assert done == 4
    finally:
        engine.close()


def test_models_and_ranks_do_not_see_each_others_pages(node):
    a = Engine(node, model="model-a", tp_rank=0, tp_size=2)
    b = Engine(node, model="model-a", tp_rank=1, tp_size=2)
    c = Engine(node, model="model-b", tp_rank=0, tp_size=2)
    try:
        keys = make_keys(4, salt=11, page_size=16)
        assert a.write(keys, 0, seed=1)[0] == 4
        assert a.driver.exists(keys) == 4
        assert b.driver.exists(keys) == 0
        assert c.driver.exists(keys) == 0
    finally:
        for e in (a, b, c):
            e.close()


def test_daemon_death_gives_misses_and_recovery_needs_no_rebuild(node):
    engine = Engine(node, model="death")
    try:
        keys = make_keys(6, salt=21, page_size=16)
        assert engine.write(keys, 0, seed=2)[0] == 6
        node.kill("dram")
        # Every call returns a miss or False; nothing raises into the engine.
        assert engine.driver.exists(keys) == 0
        assert engine.read(keys, first_page=8)[0] == 0
        assert engine.write(make_keys(2, salt=22, page_size=16), 0, seed=4)[0] == 0
        assert engine.backend.batch_set_v1(keys[:2], engine.indices(0, 2)) == [False, False]
        node.start("dram")
        fresh = make_keys(5, salt=23, page_size=16)
        for _ in range(100):  # the back-off ends within a few seconds
            if engine.driver.exists(fresh) == 0 and engine.write(fresh, 0, seed=9)[0] == 5:
                break
            import time
            time.sleep(0.1)
        written, sums = engine.write(fresh, 0, seed=9)
        assert written == 5
        done, got = engine.read(fresh, first_page=16)
        assert done == 5 and got == sums
        assert _inner(engine.backend)._router.clients[0].region_id is not None  # re-registered the memfd
    finally:
        engine.close()


def test_a_prompt_longer_than_one_lookup_message(node):
    """SGLang asks for a whole prompt at once; a daemon takes P.MAX_BATCH keys a message (head shards
    multiply the keys), so the lookup goes in chunks and still finds every leading page."""
    from tiers.wire import protocol as P
    from tiers.wire.client import TierClient

    pages = P.MAX_BATCH + 100
    engine = Engine(node, model="long-prompt", pages=pages,
                    shape=dict(layers=1, kv_heads=1, head_dim=8, page_size=1))  # 32-byte pages
    try:
        keys = make_keys(pages, salt=21, page_size=1)
        assert engine.write(keys, 0, seed=21)[0] == pages
        assert engine.driver.exists(keys) == pages
        client = TierClient("dram", node.config.tier("dram").endpoint, _inner(engine.backend).namespace)
        try:
            assert client.delete([keys[P.MAX_BATCH + 50]]) == 1  # a hole in the second chunk
            assert engine.driver.exists(keys) == P.MAX_BATCH + 50
            assert client.delete([keys[7]]) == 1  # and one in the first: the second chunk is not asked
            assert engine.driver.exists(keys) == 7
        finally:
            client.close()
    finally:
        engine.close()


def test_a_batch_over_the_parallel_copy_size_round_trips_byte_for_byte(node):
    """16 MiB a batch (over tiers/shm/buffers.py PARALLEL_BYTES): the daemon copies a write's pages into its
    arena and hashes them, and the engine copies a read out of it and hashes it, each in two halves at once."""
    from tiers.shm.buffers import PARALLEL_BYTES
    # 16 tokens a page: 2 x 4 layers x 16 x 8 heads x 128 x 2 bytes = 256 KiB; 64 pages = 16 MiB, a quarter of
    # the module's 64 MiB tier (nothing of it is evicted by what the other tests left there)
    shape = dict(layers=4, kv_heads=8, head_dim=128, page_size=16)
    engine = Engine(node, shape=shape, pages=128, model="parallel-copy")
    try:
        keys = make_keys(64, salt=77, page_size=16)
        assert 64 * 16 * engine.pool.get_size_per_token() == 16 << 20 >= PARALLEL_BYTES
        written, sums = engine.write(keys, first_page=0, seed=11)
        assert written == 64
        done, got = engine.read(keys, first_page=64)
        assert done == 64 and got == sums
    finally:
        engine.close()
