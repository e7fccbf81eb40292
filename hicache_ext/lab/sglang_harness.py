"""Drive pages through an L3 storage backend with SGLang's own classes, on CPU.

Used by the tests, ``hicache-tiers demo`` and the benchmarks.  Public API:
- ``build_mha_host_pool(layout, allocator, layers, kv_heads, head_dim, dtype, page_size, pages)``
  and ``build_mla_host_pool(layout, allocator, layers, kv_lora_rank, qk_rope_head_dim, dtype,
  page_size, pages)``: real host pools (hicache_ext/lab/sglang_pools.py says how).
- ``make_storage_config(tp_rank, tp_size, model_name, is_mla, layout, extra_config, pp_rank,
  pp_size)``: a real ``HiCacheStorageConfig``; extra_config goes through SGLang's own parser,
  which pops prefetch_threshold, prefetch_timeout_*, hicache_storage_pass_prefix_keys.
- ``create_backend(name, storage_config, pool)``: ``StorageBackendFactory.create_backend`` plus
  the registration the engine makes: ``register_mem_pool_host(pool)``,
  ``register_mem_host_pool_v2(pool, PoolName.KV)``, ``on_host_pools_registered()``.
- ``PageDriver(backend, pool, storage_config, backend_name)``: ``backup(keys, host_indices)``,
  ``prefetch(keys, host_indices)`` and ``exists(keys)`` run HybridCacheController's page
  functions (the controller 0.5.23 uses for plain MHA/MLA models too).
- ``uses_zero_copy(backend_name, extra_config)``: the controller's v1-vs-legacy rule.
- ``InMemoryStorage``: a reference v1 backend (bytes in a dict), loadable as ``dynamic``.
- Page helpers re-exported from sglang_pools: ``host_indices_for_pages``, ``fill_pages``,
  ``zero_pages``, ``page_bytes``, ``page_checksums``, ``page_regions``, ``make_keys``,
  ``make_tokens``, ``chain_keys``.

SGLang facts this relies on (0.5.23):
- v1 (batch_get_v1/batch_set_v1 with host indices) is chosen only for the built-ins in
  ZERO_COPY_BACKENDS or for ``dynamic`` with a truthy ``interface_v1``; everything else,
  ``file`` and ``sim`` included, gets the legacy batch_get/batch_set of flat pages.
- A legacy flat page is ``get_data_page`` order: for layer_first that is all K layers then
  all V layers, not the [K_l0, V_l0, ...] region order of get_page_buffer_meta, so bytes
  written by one path cannot be read by the other for that layout.
- MLA: only ``storage_config.is_storage_writer`` (TP rank 0) backs up; other ranks report 0.
"""
from __future__ import annotations

import ctypes
import json
import queue
import threading
from typing import Dict, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.pool_host import HostPoolGroup
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache_ext.lab.sglang_pools import (  # noqa: F401  (re-exported API)
    build_mha_host_pool,
    build_mla_host_pool,
    chain_keys,
    fill_pages,
    host_indices_for_pages,
    make_keys,
    make_tokens,
    page_bytes,
    page_checksums,
    page_regions,
    zero_pages,
)

# Built-in backends HiCacheController.attach_storage_backend switches to the
# zero-copy page functions; tests/test_sglang_harness.py checks this against
# the installed source so a new SGLang cannot drift silently.
ZERO_COPY_BACKENDS = ("hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori",
                      "tensorcast", "seaweedfs")


def uses_zero_copy(backend_name: str, extra_config: Optional[dict]) -> bool:
    """True when the controller would pick batch_get_v1/batch_set_v1 for this backend."""
    if backend_name in ZERO_COPY_BACKENDS:
        return True
    return backend_name == "dynamic" and bool((extra_config or {}).get("interface_v1", 0))


def make_storage_config(tp_rank: int = 0, tp_size: int = 1, model_name: Optional[str] = "test-model",
                        is_mla: bool = False, layout: str = "page_first",
                        extra_config: Optional[dict] = None, pp_rank: int = 0,
                        pp_size: int = 1) -> HiCacheStorageConfig:
    """The HiCacheStorageConfig a single-DP rank would build (_generate_storage_config)."""
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"rank out of range: tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}")
    raw = json.dumps(extra_config) if extra_config else None
    extra = HybridCacheController.parse_storage_backend_extra_config(raw)[0]
    # The controller pops tp_lcm_size itself and splits heads only for page_head MHA.
    tp_lcm_size = extra.pop("tp_lcm_size", None)
    if tp_lcm_size and tp_lcm_size % tp_size:
        raise ValueError("tp_lcm_size must be divisible by tp_size")
    split = bool(tp_lcm_size) and not is_mla and layout == "page_head" and tp_lcm_size > tp_size
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=is_mla, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=model_name, tp_lcm_size=tp_lcm_size,
        should_split_heads=split, extra_config=extra)


def create_backend(name: str, storage_config: HiCacheStorageConfig, pool) -> HiCacheStorage:
    """Build a backend through SGLang's factory and register the pool as the engine does."""
    backend = StorageBackendFactory.create_backend(name, storage_config, pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, PoolName.KV)
    backend.on_host_pools_registered()
    return backend


def _host_pool_group(pool) -> HostPoolGroup:
    """The anchor-only group build_kv_only_group makes for a flat MHA/MLA pool."""
    device = getattr(pool, "harness_device_pool", None)
    layers = pool.layer_num
    entry = build_pool_entry(name=PoolName.KV, host_pool=pool, device_pool=device,
                             layer_mapping={i: i for i in range(layers)},
                             transfer_layer_id_max=layers, is_anchor=True)
    return HostPoolGroup([entry])


class PageDriver:
    """Runs HybridCacheController's own page functions against one backend.

    backup() and prefetch() may run in two threads at once, like the engine's
    backup and prefetch-io threads; prefetches are serialized as on that one thread.
    """

    def __init__(self, backend: HiCacheStorage, pool, storage_config: HiCacheStorageConfig,
                 backend_name: str = "dynamic"):
        # An uninitialised controller carrying only what the page functions read:
        # it must be a real instance because they call super().
        ctl = object.__new__(HybridCacheController)
        ctl.storage_backend = backend
        ctl.storage_backend_type = backend_name
        ctl.storage_config = storage_config
        ctl.storage_host_pool = pool
        ctl.mem_pool_host = _host_pool_group(pool)
        ctl.page_size = pool.page_size
        ctl.prefetch_sync_queue = queue.Queue()
        if uses_zero_copy(backend_name, storage_config.extra_config):
            ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
        else:
            ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
        self.controller = ctl
        self.zero_copy = ctl.page_get_func == ctl._page_get_zero_copy
        self.page_size = pool.page_size
        self.last_prefetch_acks: List[int] = []  # completed tokens per batch of the last prefetch
        self._ops = 0
        self._prefetch_lock = threading.Lock()

    def _check(self, keys: List[str], host_indices: torch.Tensor) -> None:
        if len(host_indices) != len(keys) * self.page_size:
            raise ValueError(f"{len(host_indices)} host slots for {len(keys)} pages of {self.page_size}")

    def backup(self, keys: List[str], host_indices: torch.Tensor,
               prefix_keys: Optional[List[str]] = None) -> int:
        """Write pages as the backup thread does; returns pages written (a prefix)."""
        self._check(keys, host_indices)
        op = StorageOperation(host_indices, [], hash_value=list(keys), prefix_keys=prefix_keys)
        # The backup thread's wrapper: a raising backend counts as a failed backup.
        self.controller._page_backup_or_log(op)
        return op.completed_tokens // self.page_size

    def prefetch(self, keys: List[str], host_indices: torch.Tensor,
                 prefix_keys: Optional[List[str]] = None) -> int:
        """Read pages as the prefetch-io thread does; returns leading pages read."""
        self._check(keys, host_indices)
        # The engine has one prefetch-io thread; serializing here also keeps each
        # call's acks apart in the shared queue.
        with self._prefetch_lock:
            self._ops += 1
            handle = CacheRequestHandle(rid=f"harness-{self._ops}", attempt_id=0)
            op = PrefetchOperation(handle, [], prefix_keys=prefix_keys)
            op.hash_value, op.host_indices = list(keys), host_indices
            self.controller._page_transfer(op)
            # Completion is reported only through acks (one per batch of at most
            # STORAGE_BATCH_SIZE pages), as to the prefetch sync thread.
            acks = []
            while not self.controller.prefetch_sync_queue.empty():
                ack = self.controller.prefetch_sync_queue.get_nowait()
                if ack.completed_tokens is not None:
                    acks.append(ack.completed_tokens)
            self.last_prefetch_acks = acks
        return max(acks, default=0) // self.page_size

    def exists(self, keys: List[str], prefix_keys: Optional[List[str]] = None) -> int:
        """Leading hit count from the single batch_exists call the hit query makes."""
        # HybridCacheController._storage_hit_query derives keys from token ids; with
        # keys in hand the call it makes (KV only) is exactly this one.  The engine
        # would log an exception or a non-int and count a miss; a harness says so.
        info = HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys) if prefix_keys else None)
        hits = self.controller.storage_backend.batch_exists(list(keys), info)
        if not isinstance(hits, int) or not 0 <= hits <= len(keys):
            raise ValueError(f"batch_exists returned {hits!r} for {len(keys)} keys")
        return hits


class InMemoryStorage(HiCacheStorage):
    """Reference backend: page bytes in a dict, v1 (zero-copy) and legacy paths."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self._pages: Dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _regions(self, host_indices: torch.Tensor) -> List[List[tuple]]:
        return page_regions(self.mem_pool_host, host_indices)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        pages = [b"".join(ctypes.string_at(p, n) for p, n in r) for r in self._regions(host_indices)]
        with self._lock:
            self._pages.update(zip(keys, pages))
        return [True] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> List[bool]:
        out = []
        for key, regions in zip(keys, self._regions(host_indices)):
            with self._lock:
                data = self._pages.get(key)
            if data is None or len(data) != sum(n for _, n in regions):
                out.append(False)
                continue
            src, at = memoryview(data), 0
            for p, n in regions:
                memoryview((ctypes.c_char * n).from_address(p)).cast("B")[:] = src[at:at + n]
                at += n
            out.append(True)
        return out

    def get(self, key, target_location=None, target_sizes=None):
        with self._lock:
            data = self._pages.get(key)
        if data is None or target_location is None:
            return None
        flat = target_location.view(torch.uint8)
        if flat.numel() != len(data):
            return None
        flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys))]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        data = value.contiguous().view(torch.uint8).numpy().tobytes()
        with self._lock:
            self._pages[key] = data
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def exists(self, key) -> bool:
        with self._lock:
            return key in self._pages

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
