"""The TTFT bench's floor backend (hicache_ext/lab/bench/memory_backend.py): what it stores, it gives back
byte for byte into other host slots, through a real SGLang host pool."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from hicache_ext.lab.bench.memory_backend import InProcessMemoryStorage  # noqa: E402
from hicache_ext.lab.sglang_pools import (build_mha_host_pool, fill_pages, host_indices_for_pages,  # noqa: E402
                                          page_bytes, zero_pages)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_stored_come_back_exactly_into_other_slots_and_misses_stay_untouched(layout):
    pool = build_mha_host_pool(layout=layout, layers=4, pages=16)
    backend = InProcessMemoryStorage(None)
    backend.register_mem_pool_host(pool)
    written, target = host_indices_for_pages(pool, 0, 4), host_indices_for_pages(pool, 8, 5)
    fill_pages(pool, written, seed=7)
    keys = [f"page-{i}" for i in range(4)]
    assert backend.batch_set_v1(keys, written) == [True] * 4
    assert backend.batch_exists(keys + ["absent"]) == 4
    zero_pages(pool, target)
    found = backend.batch_get_v1(keys[:2] + ["absent"] + keys[2:], target)
    assert found == [True, True, False, True, True]
    got = page_bytes(pool, target)
    want = page_bytes(pool, written)
    assert got[:2] + got[3:] == want
    assert got[2] == bytes(len(got[2]))  # the missing page's slots were left as they were


def test_a_backend_that_moves_no_byte_answers_as_if_it_had_and_leaves_the_host_pool_alone():
    """copies=False (scripts/bench_dram_floor.py's "page functions alone"): keys kept, hits answered, no byte
    moved either way, so what is timed is SGLang's machinery and nothing else."""
    from types import SimpleNamespace
    pool = build_mha_host_pool(layout="page_first", layers=4, pages=16)
    backend = InProcessMemoryStorage(SimpleNamespace(extra_config={"copies": False}))
    backend.register_mem_pool_host(pool)
    written, target = host_indices_for_pages(pool, 0, 4), host_indices_for_pages(pool, 8, 4)
    fill_pages(pool, written, seed=7)
    keys = [f"page-{i}" for i in range(4)]
    assert backend.batch_set_v1(keys, written) == [True] * 4
    assert backend.batch_exists(keys) == 4
    zero_pages(pool, target)
    assert backend.batch_get_v1(keys, target) == [True] * 4
    assert all(page == bytes(len(page)) for page in page_bytes(pool, target))  # nothing landed
    assert sum(array.nbytes for array in backend.pages.values()) == 0  # nothing kept
