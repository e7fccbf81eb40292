"""Four TP rank processes share one node's daemons: MHA shards stay apart, MLA pages are written once and read by all."""
import multiprocessing as mp
import traceback

from tests.support.nodes import dram_config, start_node

RANKS = 4
PAGES = 24


def rank_main(rank, runtime_dir, config_path, barrier, results):
    try:
        from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, build_mla_host_pool, create_backend,
                                                fill_pages, host_indices_for_pages, make_keys, make_storage_config,
                                                page_checksums, zero_pages)
        extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
                 "interface_v1": 1, "allocator": "shm", "runtime_dir": runtime_dir, "tiers_config": config_path}
        out = {}
        # MHA: every rank writes its own shard of the same prompt, concurrently.
        pool = build_mha_host_pool(allocator="shm", layers=2, kv_heads=2, head_dim=32, page_size=16, pages=2 * PAGES)
        config = make_storage_config(tp_rank=rank, tp_size=RANKS, model_name="shared-prompt", extra_config=extra)
        backend = create_backend("dynamic", config, pool)
        driver = PageDriver(backend, pool, config)
        keys = make_keys(PAGES, salt=42, page_size=16)  # the same keys on every rank: TP shards of one prompt
        idx = host_indices_for_pages(pool, 0, PAGES)
        fill_pages(pool, idx, seed=rank)  # each shard differs
        expected = page_checksums(pool, idx)
        barrier.wait()
        out["mha_written"] = driver.backup(keys, idx)
        barrier.wait()
        zero_pages(pool, idx)
        out["mha_read"] = driver.prefetch(keys, idx)
        out["mha_equal"] = page_checksums(pool, idx) == expected
        backend.close()
        # MLA: one writer (rank 0); every rank reads the same pages.
        mla = build_mla_host_pool(allocator="shm", layers=2, kv_lora_rank=64, qk_rope_head_dim=16, page_size=16,
                                  pages=PAGES)
        config = make_storage_config(tp_rank=rank, tp_size=RANKS, model_name="mla-model", is_mla=True,
                                     extra_config=extra)
        backend = create_backend("dynamic", config, mla)
        driver = PageDriver(backend, mla, config)
        keys = make_keys(PAGES, salt=43, page_size=16)
        idx = host_indices_for_pages(mla, 0, PAGES)
        fill_pages(mla, idx, seed=100)  # what the writer holds
        expected = page_checksums(mla, idx)
        out["mla_exists_before"] = driver.exists(keys)
        barrier.wait()
        out["mla_written"] = driver.backup(keys, idx)  # only rank 0 sends pages
        barrier.wait()
        zero_pages(mla, idx)
        out["mla_read"] = driver.prefetch(keys, idx)
        out["mla_equal"] = page_checksums(mla, idx) == expected
        out["mla_stored_pages"] = sum(s["pages"] for s in backend.tier_stats().values() if s)
        backend.close()
        results.put((rank, out))
    except Exception:
        results.put((rank, {"error": traceback.format_exc()}))


def ranks_main(runtime_dir, config_path, results):
    """The four ranks, forked from one process that imported SGLang once: four processes of their own as
    SGLang's ranks are, without four ~14 s imports of SGLang on two cores. The import starts no Python thread
    and runs no torch op, so no lock or thread pool is caught mid-use by the forks."""
    import hicache_ext.lab.sglang_harness  # noqa: F401  (imported here, before the forks)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(RANKS, timeout=120)
    procs = [ctx.Process(target=rank_main, args=(r, runtime_dir, config_path, barrier, results))
             for r in range(RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()


def test_four_ranks_share_a_node(tmp_path):
    runner = start_node(tmp_path, dram_config(capacity="64MiB"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    launcher = ctx.Process(target=ranks_main, args=(runner.runtime_dir, runner.config_path, results))
    try:
        launcher.start()
        outs = dict(results.get(timeout=300) for _ in range(RANKS))
        launcher.join(timeout=60)
    finally:
        if launcher.is_alive():
            launcher.kill()
        runner.stop()
    for rank, out in sorted(outs.items()):
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
        assert (out["mha_written"], out["mha_read"], out["mha_equal"]) == (PAGES, PAGES, True), (rank, out)
        assert out["mla_exists_before"] == 0
        # SGLang's controller skips the backup on MLA ranks that are not the storage writer.
        assert out["mla_written"] == (PAGES if rank == 0 else 0), (rank, out)
        assert (out["mla_read"], out["mla_equal"]) == (PAGES, True), (rank, out)
    # 4 MHA shards + one shared copy of the MLA pages, nothing more.
    assert outs[0]["mla_stored_pages"] == RANKS * PAGES + PAGES
