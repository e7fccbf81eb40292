"""TieredHiCacheStorage: the HiCacheStorage class SGLang's ``dynamic`` loader builds.

Thin by design: it derives the namespace, turns host indices into page
regions (hicache_ext/host_pool.py) and hands batches to the router.  Every
public method returns a miss / False on failure and never raises into the
engine (a ``None`` where a list is expected would kill SGLang's prefetch
thread for the life of the process).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache_ext.host_pool import HostPoolView
from hicache_ext.router import TierRouter
from hicache_ext.settings import BackendSettings, derive_namespace
from tiers.client import Deadlines, TierClient
from tiers.config import load_config
from tiers.logs import RateLimitedLog

log = logging.getLogger("hicache.backend")
_warn = RateLimitedLog(log)


def never_raises(default):
    """Log (rate-limited) and return default(*args) instead of raising."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # the engine must never see our failures
                _warn.warning(f"exc:{method.__name__}", "hicache-tiers %s failed: %s: %s",
                              method.__name__, type(exc).__name__, exc)
                return default(*args, **kwargs) if callable(default) else default
        return guarded
    return wrap


def _all_false(keys, *args, **kwargs) -> List[bool]:
    return [False] * len(keys)


class TieredHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backend over the node's tier daemons."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        node = load_config(self.settings.tiers_config, runtime_dir=self.settings.runtime_dir)
        self.node = node
        self.write_policy = self.settings.write_policy or node.write_policy
        self.is_writer = storage_config.is_storage_writer
        self.mem_pool_host = None
        self._view: Optional[HostPoolView] = None
        self._router: Optional[TierRouter] = None
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []
        self._deadlines = Deadlines(base=self.settings.deadline_base_s,
                                    min_bandwidth=self.settings.deadline_min_gbps * 1e9,
                                    lookup=self.settings.lookup_timeout_s)
        log.info("hicache-tiers backend: tiers %s, write policy %s, runtime dir %s",
                 ", ".join(t.name for t in node.tiers), self.write_policy, node.runtime_dir)

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            self._view = HostPoolView(mem_pool_host)
            self._connect_locked()

    def _connect_locked(self) -> None:
        """(Re)build the tier clients for the current namespace."""
        if self._router is not None:
            self._router.close()
        namespace = self.settings.namespace or derive_namespace(self.storage_config, self.mem_pool_host)
        self.namespace = namespace
        client_name = f"sglang-pid{os.getpid()}-tp{self.storage_config.tp_rank}"
        clients = [TierClient(t.name, t.endpoint, namespace, client_name, self._deadlines) for t in self.node.tiers]
        if self._view is not None and self._view.memfd is not None:
            for client in clients:
                client.attach_region(self._view.memfd, self._view.memfd_size)
        self._router = TierRouter(clients, self.write_policy, promote=self.settings.promote,
                                  selective_min_reads=self.settings.selective_min_reads)

    def _route(self) -> TierRouter:
        if self._router is None:
            with self._lock:
                if self._router is None:
                    self._connect_locked()  # legacy use without a host pool
        return self._router

    # ------------------------------------------------------------ lookups
    @never_raises(0)
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._route().lookup(list(keys))

    @never_raises(False)
    def exists(self, key: str) -> bool:
        return self._route().lookup([key]) == 1

    # ----------------------------------------------------- v1: host indices
    @never_raises(_all_false)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        started = time.perf_counter()
        batch = self._view.batch(list(keys), host_indices)
        found = self._route().read(batch)
        self._record(self._prefetch_pgs, self._prefetch_bw, found, batch.nbytes // len(keys), started)
        return found

    @never_raises(_all_false)
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)  # MLA: another rank writes the shared pages
        started = time.perf_counter()
        batch = self._view.batch(list(keys), host_indices)
        parents = [None] + list(keys[:-1])
        if extra_info is not None and extra_info.prefix_keys:
            parents[0] = extra_info.prefix_keys[-1]
        stored = self._route().write(batch, parents)
        self._record(self._backup_pgs, self._backup_bw, stored, batch.nbytes // len(keys), started)
        return stored

    # ------------------------------------------------ legacy: flat tensors
    @never_raises(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        if target_locations is None:
            return [None] * len(keys)
        started = time.perf_counter()
        pages = [[_tensor_view(t)] for t in target_locations]
        found = self._route().read_buffers(list(keys), pages)
        nbytes = pages[0][0].nbytes if pages else 0
        self._record(self._prefetch_pgs, self._prefetch_bw, found, nbytes, started)
        return [t if ok else None for t, ok in zip(target_locations, found)]

    @never_raises(None)
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @never_raises(False)
    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        if not self.is_writer:
            return True
        started = time.perf_counter()
        contiguous = [v.contiguous() for v in values]  # keep alive until sent
        pages = [[_tensor_view(v)] for v in contiguous]
        stored = self._route().write_buffers(list(keys), pages)
        self._record(self._backup_pgs, self._backup_bw, stored, pages[0][0].nbytes if pages else 0, started)
        return all(stored)

    @never_raises(False)
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------- housekeeping
    @never_raises(None)
    def clear(self) -> None:
        for client in self._route().clients:
            client.clear()

    def _record(self, pages: list, bandwidth: list, flags: List[bool], page_bytes: int, started: float) -> None:
        done = sum(flags)
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._metrics_lock:
            pages.append(done)
            bandwidth.append(done * page_bytes / seconds / 1e9)  # GB/s, as SGLang's other backends report

    @never_raises(None)
    def get_stats(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics
        with self._metrics_lock:
            metrics = StorageMetrics(prefetch_pgs=self._prefetch_pgs, backup_pgs=self._backup_pgs,
                                     prefetch_bandwidth=self._prefetch_bw, backup_bandwidth=self._backup_bw)
            self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw = [], [], [], []
        return metrics

    def tier_stats(self) -> dict:
        """Each tier daemon's stats (None for a tier that does not answer)."""
        return {c.name: c.stats() for c in self._route().clients}

    def close(self) -> None:
        try:
            if self._router is not None:
                self._router.close()
        except Exception as exc:
            log.warning("hicache-tiers close: %s", exc)


def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor, without a copy."""
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")
