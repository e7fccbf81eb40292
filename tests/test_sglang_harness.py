"""The SGLang harness: real host pools and controller page functions move exact bytes."""
import ast
import inspect
import mmap
import os
import textwrap

import pytest
import torch

# sglang is a hard requirement of the suite: fail loudly here rather than skip.
import sglang  # noqa: F401
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

from hicache_ext.lab import sglang_harness as H

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


def _dynamic_config(pool, v1, class_name="InMemoryStorage", module=H.__name__):
    extra = {"backend_name": "mem", "module_path": module, "class_name": class_name, "interface_v1": v1}
    return H.make_storage_config(layout=pool.layout, extra_config=extra)


class CountingStorage(H.InMemoryStorage):
    """InMemoryStorage that records the size of every batch the controller sends."""

    def __init__(self, storage_config, kwargs=None):
        super().__init__(storage_config, kwargs)
        self.batches = []

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        self.batches.append(("set", len(keys)))
        return super().batch_set_v1(keys, host_indices, extra_info)

    def batch_exists(self, keys, extra_info=None):
        self.batches.append(("exists", len(keys)))
        return super().batch_exists(keys, extra_info)


class FailingStorage(H.InMemoryStorage):
    """A backend whose transfers raise: the controller must turn that into a miss."""

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        raise OSError("disk gone")

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        raise OSError("disk gone")


@pytest.mark.parametrize("allocator", ["default", "shm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_file_backend_round_trip(layout, allocator, small_mha_shape, file_driver):
    pool = H.build_mha_host_pool(layout, allocator, pages=10, **small_mha_shape)
    backend, driver = file_driver(pool)
    assert not driver.zero_copy  # the controller never uses v1 for "file"
    keys = H.make_keys(5, salt=1, page_size=pool.page_size)
    src = H.host_indices_for_pages(pool, 0, 5)
    H.fill_pages(pool, src, seed=11)
    written = H.page_bytes(pool, src)
    assert len(set(written)) == 5

    assert driver.exists(keys) == 0
    assert driver.backup(keys, src) == 5
    assert driver.exists(keys) == 5
    H.zero_pages(pool, src)
    assert driver.prefetch(keys, src) == 5
    assert H.page_bytes(pool, src) == written
    dst = H.host_indices_for_pages(pool, 5, 5)
    assert driver.prefetch(keys, dst) == 5
    assert H.page_bytes(pool, dst) == written


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("v1", [0, 1])
def test_dynamic_backend_v1_and_legacy(layout, v1, small_mha_shape):
    pool = H.build_mha_host_pool(layout, "shm", pages=8, **small_mha_shape)
    cfg = _dynamic_config(pool, v1)
    backend = H.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, H.InMemoryStorage) and backend.mem_pool_host is pool
    assert backend.registered_pools == {"kv": pool}
    driver = H.PageDriver(backend, pool, cfg)
    assert driver.zero_copy is bool(v1)
    keys = H.make_keys(4, salt=2, page_size=pool.page_size)
    src, dst = H.host_indices_for_pages(pool, 0, 4), H.host_indices_for_pages(pool, 4, 4)
    H.fill_pages(pool, src, seed=5)
    assert driver.backup(keys, src) == 4
    assert driver.exists(keys) == 4
    assert driver.prefetch(keys, dst) == 4
    assert H.page_checksums(pool, dst) == H.page_checksums(pool, src)


def test_batches_of_storage_batch_size(small_mha_shape):
    n = STORAGE_BATCH_SIZE + 2
    pool = H.build_mha_host_pool("page_first", pages=2 * n, **small_mha_shape)
    cfg = _dynamic_config(pool, 1, class_name="CountingStorage", module=__name__)
    backend = H.create_backend("dynamic", cfg, pool)
    driver = H.PageDriver(backend, pool, cfg)
    keys = H.make_keys(n, salt=3, page_size=pool.page_size)
    src, dst = H.host_indices_for_pages(pool, 0, n), H.host_indices_for_pages(pool, n, n)
    H.fill_pages(pool, src, seed=1)
    assert driver.backup(keys, src) == n
    assert driver.exists(keys) == n
    assert backend.batches == [("set", STORAGE_BATCH_SIZE), ("set", 2), ("exists", n)]
    assert driver.prefetch(keys, dst) == n
    assert driver.last_prefetch_acks == [STORAGE_BATCH_SIZE * pool.page_size, n * pool.page_size]
    assert H.page_checksums(pool, dst) == H.page_checksums(pool, src)


def test_raising_backend_counts_as_nothing_moved(small_mha_shape):
    pool = H.build_mha_host_pool("page_first", pages=4, **small_mha_shape)
    cfg = _dynamic_config(pool, 1, class_name="FailingStorage", module=__name__)
    driver = H.PageDriver(H.create_backend("dynamic", cfg, pool), pool, cfg)
    keys = H.make_keys(2, salt=9, page_size=pool.page_size)
    idx = H.host_indices_for_pages(pool, 0, 2)
    assert driver.backup(keys, idx) == 0
    assert driver.prefetch(keys, idx) == 0
    assert driver.last_prefetch_acks == [0]


def test_misses_stop_at_the_first_absent_page(small_mha_shape, file_driver):
    pool = H.build_mha_host_pool("page_first", pages=10, **small_mha_shape)
    _, driver = file_driver(pool)
    keys = H.make_keys(5, salt=4, page_size=pool.page_size)
    src, dst = H.host_indices_for_pages(pool, 0, 5), H.host_indices_for_pages(pool, 5, 5)
    H.fill_pages(pool, src, seed=2)
    ps = pool.page_size
    assert driver.backup(keys[:3], src[: 3 * ps]) == 3
    assert driver.exists(keys) == 3
    assert driver.prefetch(keys, dst) == 3
    assert H.page_bytes(pool, dst)[:3] == H.page_bytes(pool, src)[:3]
    assert driver.prefetch(H.make_keys(2, salt=99, page_size=ps), dst[: 2 * ps]) == 0
    with pytest.raises(ValueError):
        driver.backup(keys, src[:ps])


@pytest.mark.parametrize("layout,per_page", [("page_first", 2), ("layer_first", 8), ("page_first_direct", 2)])
def test_page_regions_and_memfd_offsets(layout, per_page, small_mha_shape):
    pool = H.build_mha_host_pool(layout, "shm", pages=4, **small_mha_shape)
    s = small_mha_shape
    token_bytes = s["kv_heads"] * s["head_dim"] * 2
    region = token_bytes * s["page_size"] * (1 if layout == "layer_first" else s["layers"])
    idx = H.host_indices_for_pages(pool, 1, 2)
    regions = H.page_regions(pool, idx)
    assert [[n for _, n in r] for r in regions] == [[region] * per_page] * 2
    # The whole kv_buffer is one memfd mapped from offset 0.
    assert pool.fd == pool.allocator.fds[0] and len(pool.allocator.mms) == 1
    H.fill_pages(pool, idx, seed=8)
    base = pool.kv_buffer.data_ptr()
    with mmap.mmap(pool.fd, os.fstat(pool.fd).st_size, prot=mmap.PROT_READ) as mm:
        via_fd = [b"".join(mm[p - base:p - base + n] for p, n in r) for r in regions]
    assert via_fd == H.page_bytes(pool, idx)
    # The legacy flat page matches region order except for layer_first (K layers, then V).
    legacy = pool.get_data_page(int(idx[0])).view(torch.uint8).numpy().tobytes()
    assert (legacy == via_fd[0]) is (layout != "layer_first")


def test_llama3_8b_shape_round_trip(file_driver):
    pool = H.build_mha_host_pool(pages=2)  # 32 layers, 8 heads, dim 128, bf16, 64 tokens
    idx = H.host_indices_for_pages(pool, 0, 1)
    assert sum(n for _, n in H.page_regions(pool, idx)[0]) == 8 << 20
    _, driver = file_driver(pool)
    keys = H.make_keys(1, salt=5)
    H.fill_pages(pool, idx, seed=3)
    assert driver.backup(keys, idx) == 1
    dst = H.host_indices_for_pages(pool, 1, 1)
    assert driver.prefetch(keys, dst) == 1
    assert H.page_checksums(pool, dst) == H.page_checksums(pool, idx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pool_round_trip_and_single_writer(layout, file_driver, tmp_path):
    pool = H.build_mla_host_pool(layout, layers=4, kv_lora_rank=64, qk_rope_head_dim=16,
                                 page_size=16, pages=6)
    _, writer = file_driver(pool, is_mla=True, tp_size=2)
    _, other = file_driver(pool, is_mla=True, tp_rank=1, tp_size=2)
    keys = H.make_keys(3, salt=6, page_size=16)
    src, dst = H.host_indices_for_pages(pool, 0, 3), H.host_indices_for_pages(pool, 3, 3)
    H.fill_pages(pool, src, seed=4)
    assert other.backup(keys, src) == 0  # only the storage writer (rank 0) writes MLA
    assert writer.backup(keys, src) == 3
    assert other.exists(keys) == 3  # MLA keys carry no TP rank: every rank reads them
    assert other.prefetch(keys, dst) == 3
    assert H.page_bytes(pool, dst) == H.page_bytes(pool, src)
    assert sorted(os.listdir(tmp_path / "l3")) == sorted(f"{k}_test-model.bin" for k in keys)


def test_keys_are_sglangs_chain():
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = H.make_tokens(3, salt=7, page_size=16)
    keys = H.chain_keys(tokens, 16)
    assert keys == get_hash_str(tokens, None, page_size=16)
    assert H.chain_keys(tokens[16:], 16, prior_hash=keys[0]) == keys[1:]
    assert H.make_keys(3, salt=7, page_size=16) == keys
    assert H.make_keys(3, salt=8, page_size=16) != keys
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)


def test_fill_pages_is_deterministic_and_finite(small_mha_shape):
    pool = H.build_mha_host_pool("layer_first", pages=4, **small_mha_shape)
    a, b = H.host_indices_for_pages(pool, 0, 2), H.host_indices_for_pages(pool, 2, 2)
    H.fill_pages(pool, a, seed=1)
    H.fill_pages(pool, b, seed=1)
    assert H.page_bytes(pool, a) == H.page_bytes(pool, b)
    H.fill_pages(pool, b, seed=2)
    assert set(H.page_bytes(pool, a)).isdisjoint(H.page_bytes(pool, b))
    assert bool(torch.isfinite(pool.kv_buffer.float()).all())
    with pytest.raises(ValueError):
        H.host_indices_for_pages(pool, 3, 2)


def test_storage_config_matches_the_controller():
    cfg = H.make_storage_config(tp_rank=1, tp_size=2, is_mla=True, layout="layer_first",
                                extra_config={"prefetch_threshold": 64, "interface_v1": 1})
    assert cfg.extra_config == {"interface_v1": 1}  # SGLang pops its own keys
    assert not cfg.is_page_first_layout and not cfg.is_storage_writer
    assert H.make_storage_config().is_page_first_layout
    with pytest.raises(ValueError):
        H.make_storage_config(tp_rank=2, tp_size=2)


def test_zero_copy_rule_matches_the_installed_controller():
    """The backends listed in attach_storage_backend are exactly ZERO_COPY_BACKENDS."""
    src = textwrap.dedent(inspect.getsource(HiCacheController.attach_storage_backend))
    lists = [node.comparators[0] for node in ast.walk(ast.parse(src))
             if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
             and node.left.attr == "storage_backend_type" and isinstance(node.comparators[0], ast.List)]
    assert len(lists) == 1
    assert tuple(c.value for c in lists[0].elts) == H.ZERO_COPY_BACKENDS
    assert '"interface_v1"' in src
    assert H.uses_zero_copy("dynamic", {"interface_v1": 1})
    assert not H.uses_zero_copy("dynamic", {}) and not H.uses_zero_copy("file", {"interface_v1": 1})


def test_a_server_port_is_chosen_below_the_kernels_ephemeral_range():
    """Ports the kernel hands out (bind to 0, outgoing connections of the Transfer Engine or ZeroMQ) cannot
    take the port a server was told to bind between the check and its bind (a suite run lost 300 s so)."""
    import socket
    from hicache_ext.lab.server import free_port
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low = int(fh.read().split()[0])
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free right after it was chosen
