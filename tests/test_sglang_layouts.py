"""Every host layout SGLang 0.5.23 can build, MHA and MLA, through both controller paths.

The zero-copy path (interface_v1: batch_get_v1/batch_set_v1 over host indices)
and the generic path (flat pages: batch_get/batch_set) are SGLang's own page
functions (HybridCacheController), run against real daemons; every page read
back is checked byte for byte.  page_unified and page_first_kv_split have no
flat page in SGLang (get_data_page raises), so only the zero-copy path exists
for them; the last test pins that down so a new SGLang cannot change it silently.
"""
import pytest

from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, build_mla_host_pool, create_backend,
                                        fill_pages, host_indices_for_pages, make_keys, make_storage_config,
                                        page_checksums, zero_pages)
from tests.support.backend_env import backend_extra
from tests.support.nodes import module_node

N, PAGE_SIZE = 6, 4
MHA = dict(layers=2, kv_heads=2, head_dim=32, page_size=PAGE_SIZE)
MLA = dict(layers=2, kv_lora_rank=64, qk_rope_head_dim=16, page_size=PAGE_SIZE)
FLATLESS = {"page_unified", "page_first_kv_split"}  # SGLang has no flat page for these

CASES = [(attn, layout, allocator, path)
         for attn, layouts in (("mha", ("page_first", "layer_first", "page_first_direct", "page_head", "page_unified")),
                               ("mla", ("page_first", "layer_first", "page_first_direct", "page_first_kv_split")))
         for layout in layouts
         for allocator in ("shm", "default")
         for path in ("zero_copy", "generic")
         if not (path == "generic" and layout in FLATLESS)]


node = module_node("layouts")


def rank(node, attn, layout, allocator, path, tp_rank):
    build = build_mha_host_pool if attn == "mha" else build_mla_host_pool
    pool = build(layout, allocator, pages=2 * N, **(MHA if attn == "mha" else MLA))
    extra = backend_extra(node, interface_v1=path == "zero_copy", allocator=allocator)
    config = make_storage_config(tp_rank=tp_rank, tp_size=2 if attn == "mla" else 1, is_mla=attn == "mla",
                                 model_name=f"layouts-{attn}-{layout}-{allocator}-{path}", layout=layout,
                                 extra_config=extra)
    backend = create_backend("dynamic", config, pool)
    driver = PageDriver(backend, pool, config, "dynamic")
    assert driver.zero_copy == (path == "zero_copy")
    return pool, backend, driver


@pytest.mark.parametrize("attn,layout,allocator,path", CASES)
def test_pages_round_trip_in_every_layout_and_path(node, attn, layout, allocator, path):
    keys = make_keys(N, salt=hash((attn, layout, allocator, path)) % 10_000, page_size=PAGE_SIZE)
    writer = rank(node, attn, layout, allocator, path, tp_rank=0)
    # MLA: rank 1 is not the storage writer; it reads the one copy rank 0 wrote.
    reader = rank(node, attn, layout, allocator, path, tp_rank=1) if attn == "mla" else writer
    try:
        pool, _, driver = writer
        src = host_indices_for_pages(pool, 0, N)
        fill_pages(pool, src, seed=N)
        want = page_checksums(pool, src)
        assert driver.backup(keys, src) == N
        rpool, rbackend, rdriver = reader
        assert rdriver.exists(keys) == N
        dst = host_indices_for_pages(rpool, N, N)
        zero_pages(rpool, dst)
        assert rdriver.prefetch(keys, dst) == N
        assert page_checksums(rpool, dst) == want
        # A hole in the middle: the prefix stops there and only the pages before it are read.
        assert rdriver.exists(keys[:2] + make_keys(1, salt=99_999, page_size=PAGE_SIZE) + keys[3:]) == 2
        if attn == "mla":
            assert rdriver.backup(keys, dst) == 0  # SGLang skips the backup on non-writer ranks
    finally:
        for _, backend, _ in {id(writer): writer, id(reader): reader}.values():
            backend.close()


@pytest.mark.parametrize("attn,layout", [("mha", "page_unified"), ("mla", "page_first_kv_split")])
def test_sglang_has_no_flat_page_for_these_layouts(attn, layout):
    build = build_mha_host_pool if attn == "mha" else build_mla_host_pool
    pool = build(layout, "default", pages=2, **(MHA if attn == "mha" else MLA))
    with pytest.raises(ValueError, match="Unsupported layout"):
        pool.get_data_page(0, flat=True)
