"""The engine process stays flat when nobody calls get_stats() (SGLang calls it only with metrics on)."""
import os

from hicache_ext.engine_stats import RING
from hicache_ext.lab.sglang_harness import build_mha_host_pool, create_backend, host_indices_for_pages, make_storage_config
from tests.support.nodes import rss_bytes

CALLS = 150_000  # a leak of a record a call (~70 bytes) grows RSS by ~10 MB: 2.5x the bound below


def test_150k_calls_without_get_stats_keep_memory_flat(tmp_path):
    # No daemons behind the runtime dir: every call is a fast miss, so 150,000
    # real batch_get_v1 calls (each recorded) fit in the suite.
    extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
             "interface_v1": 1, "allocator": "shm", "runtime_dir": str(tmp_path / "nobody")}
    pool = build_mha_host_pool("page_first", "shm", layers=2, kv_heads=2, head_dim=32, page_size=4, pages=2)
    backend = create_backend("dynamic", make_storage_config(model_name="stats", extra_config=extra), pool)
    try:
        idx, keys = host_indices_for_pages(pool, 0, 1), ["ab" * 32]
        for _ in range(CALLS // 10):
            assert backend.batch_get_v1(keys, idx) == [False]
        before = rss_bytes_self()
        for _ in range(CALLS - CALLS // 10):
            backend.batch_get_v1(keys, idx)
        grown = rss_bytes_self() - before
        # Lists of a record per call grew by ~70 bytes a call (~10 MB here); the rings do not grow.
        assert grown < 4 << 20, f"engine RSS grew {grown / 2**20:.1f} MiB over {CALLS} calls"
        assert backend.transfer_stats.held() == RING
        metrics = backend.get_stats()
        assert len(metrics.prefetch_pgs) == len(metrics.prefetch_bandwidth) == RING
        assert set(metrics.prefetch_pgs) == {0} and metrics.backup_pgs == []
        assert backend.transfer_stats.held() == 0 and backend.get_stats().prefetch_pgs == []
    finally:
        backend.close()


def rss_bytes_self() -> int:
    return rss_bytes(os.getpid())
