"""Hybrid models: side pools through batch_*_v2 with SGLang's real dataclasses and real host pools.

SGLang's own file backend is the reference: given the same pages, both backends
must give the same PoolTransferResult for every hole pattern.
"""
import random

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from hicache_ext.lab.sglang_harness import (build_mha_host_pool, create_backend, fill_pages, host_indices_for_pages,
                                        make_keys, make_storage_config, page_checksums, zero_pages)
from tests.support.backend_env import backend_extra
from tests.support.nodes import dram_config, start_node

PAGE = 16
N = 10


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    runner = start_node(tmp_path_factory.mktemp("v2"), dram_config(capacity="64MiB"))
    yield runner
    runner.stop()


def build(kind, node, tmp_path, model):
    """A KV pool plus SWA and indexer side pools, registered as the hybrid controller does."""
    kv = build_mha_host_pool(layout="page_first", allocator="shm", layers=2, kv_heads=2, head_dim=32,
                             page_size=PAGE, pages=2 * N)
    swa = build_mha_host_pool(layout="page_first", allocator="default", layers=1, kv_heads=1, head_dim=16,
                              page_size=PAGE, pages=2 * N)
    idx = build_mha_host_pool(layout="layer_first", allocator="shm", layers=1, kv_heads=1, head_dim=8,
                              page_size=PAGE, pages=2 * N)
    if kind == "tiers":
        config = make_storage_config(model_name=model, extra_config=backend_extra(node))
        backend = create_backend("dynamic", config, kv)
    else:
        config = make_storage_config(model_name=model, extra_config={"file_storage_path": str(tmp_path / "file")})
        backend = create_backend("file", config, kv)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    backend.register_mem_host_pool_v2(idx, PoolName.INDEXER)
    return backend, {PoolName.KV: kv, PoolName.SWA: swa, PoolName.INDEXER: idx}


def transfer(name, pool, keys, pages, policy=PoolHitPolicy.ALL_PAGES):
    idx = host_indices_for_pages(pool, 0, len(keys)).reshape(len(keys), PAGE)[pages].reshape(-1) if pages else None
    return PoolTransfer(name=name, host_indices=idx, keys=[keys[p] for p in pages], hit_policy=policy)


def write_pattern(backend, pools, keys, present):
    """Write the pages of each pool listed in present[name] (page numbers), from filled host pools."""
    for name, pool in pools.items():
        fill_pages(pool, host_indices_for_pages(pool, 0, N), seed=hash(name) % 97)
    result = backend.batch_set_v2([transfer(name, pools[name], keys, pages) for name, pages in present.items() if pages])
    for name, pages in present.items():
        if pages:
            assert result[name] == [True] * len(pages), (name, result)


PATTERNS = [
    {PoolName.KV: list(range(10)), PoolName.INDEXER: list(range(7)), PoolName.SWA: [3, 4, 8, 9]},
    {PoolName.KV: list(range(10)), PoolName.INDEXER: list(range(10)), PoolName.SWA: [9]},
    {PoolName.KV: list(range(6)), PoolName.INDEXER: [0, 1, 2, 4, 5], PoolName.SWA: [0, 1, 2, 3, 4, 5]},
    {PoolName.KV: [0, 1, 2, 4], PoolName.INDEXER: [0, 1, 2, 3], PoolName.SWA: [1, 2]},
    {PoolName.KV: list(range(10)), PoolName.INDEXER: [], PoolName.SWA: list(range(10))},
]


@pytest.mark.parametrize("pattern", range(len(PATTERNS)))
@pytest.mark.parametrize("window", [1, 2, 3])
def test_exists_v2_matches_sglang_file_backend(node, tmp_path, pattern, window):
    model = f"v2-{pattern}-{window}"
    keys = make_keys(N, salt=pattern * 10 + window, page_size=PAGE)
    results = []
    for kind in ("tiers", "file"):
        backend, pools = build(kind, node, tmp_path, model)
        write_pattern(backend, pools, keys, PATTERNS[pattern])
        query = [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
                 PoolTransfer(name=PoolName.SWA, keys=keys[:window], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        results.append(backend.batch_exists_v2(keys, query))
        if hasattr(backend, "close"):  # SGLang's file backend has none
            backend.close()
    ours, reference = results
    assert ours.kv_hit_pages == reference.kv_hit_pages
    assert ours.extra_pool_hit_pages == reference.extra_pool_hit_pages
    assert list(ours.restorable_prefix_pages) == list(reference.restorable_prefix_pages)


def test_side_pool_pages_round_trip(node, tmp_path):
    keys = make_keys(N, salt=77, page_size=PAGE)
    backend, pools = build("tiers", node, tmp_path, "v2-roundtrip")
    write_pattern(backend, pools, keys, {name: list(range(N)) for name in pools})
    sums = {name: page_checksums(pool, host_indices_for_pages(pool, 0, N)) for name, pool in pools.items()}
    for pool in pools.values():
        zero_pages(pool, host_indices_for_pages(pool, 0, N))
    got = backend.batch_get_v2([transfer(name, pools[name], keys, list(range(N))) for name in pools])
    assert got == {name: [True] * N for name in pools}
    for name, pool in pools.items():
        assert page_checksums(pool, host_indices_for_pages(pool, 0, N)) == sums[name], name
    # Side pools live in namespaces of their own: the SWA key is not a KV page.
    assert backend.batch_exists(keys) == N
    backend.clear()
    assert backend.batch_exists(keys) == 0
    backend.close()


def test_exists_v2_against_brute_force_on_random_holes(node, tmp_path):
    rng = random.Random(5)
    backend, pools = build("tiers", node, tmp_path, "v2-random")
    for trial in range(6):
        keys = make_keys(N, salt=1000 + trial, page_size=PAGE)
        present = {name: sorted(rng.sample(range(N), rng.randint(0, N))) for name in pools}
        present[PoolName.KV] = sorted(set(present[PoolName.KV]) | set(range(rng.randint(0, N))))
        write_pattern(backend, pools, keys, present)
        window = rng.randint(1, 3)
        result = backend.batch_exists_v2(keys, [
            PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.SWA, keys=keys[:window], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        kv = next((i for i in range(N) if i not in present[PoolName.KV]), N)
        idx_cut = next((i for i in range(kv) if i not in present[PoolName.INDEXER]), kv)
        swa_ok = {n for n in range(1, kv + 1) if all(i in present[PoolName.SWA] for i in range(max(0, n - window), n))}
        expected = [n for n in range(1, idx_cut + 1) if n in swa_ok] if idx_cut else []
        assert result.kv_hit_pages == (expected[-1] if expected else 0), (present, window)
        assert list(result.restorable_prefix_pages) == expected
    backend.close()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_block_groups_report_leading_whole_groups_and_never_gate_the_kv_hit(node, tmp_path, group):
    """BLOCK_GROUPS as SGLang 0.5.23 documents it (PoolHitPolicy); no built-in backend implements it yet."""
    rng = random.Random(group)
    backend, pools = build("tiers", node, tmp_path, f"v2-groups-{group}")
    try:
        for trial in range(5):
            keys = make_keys(N, salt=2000 + 10 * group + trial, page_size=PAGE)
            present = {PoolName.KV: list(range(rng.randint(0, N))),
                       PoolName.INDEXER: sorted(rng.sample(range(N), rng.randint(0, N)))}
            write_pattern(backend, pools, keys, present)
            result = backend.batch_exists_v2(keys, [PoolTransfer(
                name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS, group_pages=group)])
            kv = len(present[PoolName.KV])
            groups = 0
            while (groups + 1) * group <= kv and all(i in present[PoolName.INDEXER]
                                                     for i in range(groups * group, (groups + 1) * group)):
                groups += 1
            assert result.kv_hit_pages == kv, (present, group)  # never gated by the side pool
            assert result.extra_pool_hit_pages.get(PoolName.INDEXER, 0) == groups * group, (present, group)
            assert list(result.restorable_prefix_pages) == list(range(1, kv + 1))
            backend.clear()
    finally:
        backend.close()
