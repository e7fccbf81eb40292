"""Shared fixtures: the SGLang harness (hicache_ext/lab/sglang_harness.py) on small pools."""
import os

import pytest

# The Transfer Engine logs through glog at INFO to the terminal (fd 2), past pytest's
# capture when an engine is torn down between tests; warnings and errors still show.
os.environ.setdefault("GLOG_minloglevel", "1")

# Small enough that a test file of round trips stays well under 30 s on 2 cores.
SMALL_MHA = dict(layers=4, kv_heads=2, head_dim=64, page_size=16)


@pytest.fixture
def small_mha_shape():
    """Keyword arguments for a small build_mha_host_pool."""
    return dict(SMALL_MHA)


@pytest.fixture
def file_driver(tmp_path):
    """Factory: (pool, **config) -> (backend, PageDriver) over SGLang's file backend in tmp_path."""
    from hicache_ext.lab import sglang_harness as H

    def make(pool, **config):
        extra = {"file_storage_path": str(tmp_path / "l3"), **config.pop("extra_config", {})}
        cfg = H.make_storage_config(layout=pool.layout, extra_config=extra, **config)
        backend = H.create_backend("file", cfg, pool)
        return backend, H.PageDriver(backend, pool, cfg, "file")

    return make
