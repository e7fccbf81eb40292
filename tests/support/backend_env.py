"""Build the real backend the way SGLang does, against real daemons (shared by backend tests)."""
from __future__ import annotations

from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, create_backend, fill_pages,
                                        host_indices_for_pages, make_keys, make_storage_config,
                                        page_checksums, zero_pages)

SMALL_SHAPE = dict(layers=4, kv_heads=2, head_dim=64, page_size=16)  # 32 KiB pages


def backend_extra(runner, interface_v1: bool = True, allocator: str = "shm", **ours) -> dict:
    extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
             "runtime_dir": runner.runtime_dir, "tiers_config": runner.config_path,
             "deadline_base_s": 2.0, "lookup_timeout_s": 1.0}
    if interface_v1:
        extra["interface_v1"] = 1
    if allocator == "shm":
        extra["allocator"] = "shm"
    extra.update(ours)
    return extra


class Engine:
    """One SGLang rank: a real host pool, the backend from the factory, the controller's page functions."""

    def __init__(self, runner, layout="page_first", allocator="shm", interface_v1=True, pages=32, tp_rank=0,
                 tp_size=1, model="test-model", is_mla=False, shape=None, **ours):
        shape = dict(SMALL_SHAPE if shape is None else shape)
        self.pool = build_mha_host_pool(layout=layout, allocator=allocator, pages=pages, **shape)
        extra = backend_extra(runner, interface_v1, allocator, **ours)
        self.config = make_storage_config(tp_rank=tp_rank, tp_size=tp_size, model_name=model, is_mla=is_mla,
                                          layout=layout, extra_config=extra)
        self.backend = create_backend("dynamic", self.config, self.pool)
        self.driver = PageDriver(self.backend, self.pool, self.config, "dynamic")

    def indices(self, first: int, n: int):
        return host_indices_for_pages(self.pool, first, n)

    def write(self, keys, first_page: int, seed: int):
        """Fill pages with known content, back them up; (pages written, checksums)."""
        idx = self.indices(first_page, len(keys))
        fill_pages(self.pool, idx, seed)
        sums = page_checksums(self.pool, idx)
        return self.driver.backup(keys, idx), sums

    def read(self, keys, first_page: int):
        """Zero the target pages, prefetch into them; (pages read, checksums)."""
        idx = self.indices(first_page, len(keys))
        zero_pages(self.pool, idx)
        done = self.driver.prefetch(keys, idx)
        return done, page_checksums(self.pool, idx)

    def close(self):
        self.backend.close()


__all__ = ["Engine", "backend_extra", "make_keys", "SMALL_SHAPE"]
