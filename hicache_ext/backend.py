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
from dataclasses import dataclass
import os
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolName, PoolTransfer, PoolTransferResult)

from hicache_ext.break_even import BreakEven, ReadSpeeds, first_token_of
from hicache_ext.engine_stats import TransferStats
from hicache_ext.head_shards import HeadShards
from hicache_ext.host_pool import HostPoolView
from hicache_ext.hybrid import empty_result, pool_hit_result
from hicache_ext.router import TierRouter
from hicache_ext.sealing import PageSealer, key_fingerprint, read_key_file
from hicache_ext.settings import BackendSettings, derive_namespace
from tiers.wire import protocol as P
from tiers.wire.client import Deadlines, TierClient
from tiers.ops.config import load_config
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


def _all_false_by_pool(transfers, *args, **kwargs) -> Dict[str, List[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers}


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
        self.registered_pools = {}
        # One route per host pool: KV, and each side pool of a hybrid model.
        self._routes: Dict[str, _Route] = {}
        self._lock = threading.Lock()
        self.transfer_stats = TransferStats()
        self._deadlines = Deadlines(base=self.settings.deadline_base_s,
                                    min_bandwidth=self.settings.deadline_min_gbps * 1e9,
                                    lookup=self.settings.lookup_timeout_s,
                                    reply_spin=self.settings.reply_spin_us * 1e-6)
        # Pages sealed in this process (hicache_ext/sealing.py); the key is read once, here: a bad file stops
        # the server at start, not at its first write.
        self._page_key = read_key_file(self.settings.page_key_file) if self.settings.page_key_file else None
        log.info("hicache-tiers backend: tiers %s, write policy %s, runtime dir %s%s",
                 ", ".join(t.name for t in node.tiers), self.write_policy, node.runtime_dir,
                 ", pages sealed (AES-256-GCM)" if self._page_key else "")

    # ------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            self._replace_route_locked(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        with self._lock:
            current = self._routes.get(name)
            if current is None or current.view is None or current.view.pool is not host_pool:
                self._replace_route_locked(name, host_pool)

    def _replace_route_locked(self, name: str, pool) -> None:
        old = self._routes.pop(name, None)
        if old is not None:
            old.router.close()
        self._routes[name] = self._build_route(name, pool)

    def _build_route(self, name: str, pool) -> "_Route":
        # MLA pages are the same on every rank (one writer); Mamba states are TP-sharded.
        shared = self.storage_config.is_mla_model and name != PoolName.MAMBA
        shards = self._head_shards(pool) if name == PoolName.KV and not shared else None
        namespace = self.settings.namespace or derive_namespace(self.storage_config, pool, shared,
                                                                head_shards_of=shards.lcm if shards else 0)
        if name != PoolName.KV:
            namespace = f"{namespace}.{_clean_pool_name(name)}"
        sealer = None
        if self._page_key is not None:  # engines with another key (or none) never share these pages
            namespace = f"{namespace}.sealed-{key_fingerprint(self._page_key)}"
            sealer = PageSealer(self._page_key, namespace)
        view = HostPoolView(pool, head_split=shards.count if shards else 0) if pool is not None else None
        if name == PoolName.KV and view is not None:
            self._warn_if_shm_lost(view)
        client_name = f"sglang-pid{os.getpid()}-tp{self.storage_config.tp_rank}"
        clients = [TierClient(t.name, t.endpoint, namespace, client_name, self._deadlines, attach=True, curve=t.curve)
                   for t in self.node.tiers]
        # A sealed route never shares its host pool (plaintext): the router offers its sealed staging instead.
        if view is not None and view.memfd is not None and sealer is None:
            for client in clients:
                client.attach_region(view.memfd, view.memfd_size)
        break_even = BreakEven(ReadSpeeds(len(clients), stale_s=self.settings.read_speed_stale_s),
                               self.settings.recompute_us_per_token,
                               self.settings.recompute_growth_us_per_ki_token)
        router = TierRouter(clients, self.write_policy, promote=self.settings.promote,
                            selective_min_reads=self.settings.selective_min_reads,
                            promote_min_reads=self.settings.promote_min_reads,
                            promote_max_bytes=self.settings.promote_max_mib << 20, break_even=break_even,
                            checksums=self.settings.page_checksums, sealer=sealer,
                            sealed_staging_bytes=self.settings.sealed_staging_mib << 20)
        return _Route(namespace, view, router, writes=(not shared) or self.is_writer, shards=shards)

    def _head_shards(self, pool) -> Optional[HeadShards]:
        """Split pages by heads when SGLang's tp_lcm_size asks and the layout allows it."""
        cfg = self.storage_config
        if not cfg.tp_lcm_size or pool is None:
            return None
        if getattr(pool, "layout", None) != "page_head" or not (cfg.extra_config or {}).get("interface_v1"):
            log.warning("hicache-tiers: tp_lcm_size %s is ignored: sharing pages between TP sizes needs "
                        "--hicache-mem-layout page_head and interface_v1 (this pool: %s); pages stay per TP rank",
                        cfg.tp_lcm_size, getattr(pool, "layout", "?"))
            return None
        return HeadShards.for_rank(cfg.tp_rank, cfg.tp_size, cfg.tp_lcm_size, int(pool.head_num))

    def _warn_if_shm_lost(self, view: HostPoolView) -> None:
        if view.memfd is not None or (self.storage_config.extra_config or {}).get("allocator") != "shm":
            return
        if view.memfd_count > 1:  # page_first_kv_split: one memfd per buffer; we attach one mapping a pool
            log.info("hicache-tiers: the %s host pool spans %d memfds; its pages travel as ZeroMQ frames",
                     view.pool.layout, view.memfd_count)
        else:
            log.warning("hicache-tiers: the extra config asks for \"allocator\": \"shm\" but the host pool is "
                        "not in a memfd, so pages travel as ZeroMQ frames (slower). SGLang reads \"allocator\" "
                        "only from inline JSON, not from @file: pass --hicache-storage-backend-extra-config "
                        "\"$(hicache-tiers sglang-args --json)\" (or \"$(cat FILE)\") instead")

    def _route(self, name: str = PoolName.KV) -> "_Route":
        route = self._routes.get(name)
        if route is None:
            with self._lock:
                route = self._routes.get(name)
                if route is None:
                    pool = self.registered_pools.get(name) if name != PoolName.KV else self.mem_pool_host
                    route = self._routes[name] = self._build_route(name, pool)  # legacy use without a pool
        return route

    @property
    def namespace(self) -> str:
        return self._route().namespace

    @property
    def _router(self) -> TierRouter:
        return self._route().router

    # ------------------------------------------------------------ lookups
    @never_raises(0)
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return P.leading_run(self._route().held(keys, extra_info))  # held makes the list it sends

    @never_raises(False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ----------------------------------------------------- v1: host indices
    @never_raises(_all_false)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        started = time.perf_counter()
        route = self._route()
        found = route.fold(route.router.read(route.view.batch(route.storage_keys(keys), host_indices)))
        self.transfer_stats.record(False, found, route.view.page_bytes(), started)
        return found

    @never_raises(_all_false)
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        if not keys:
            return []
        route = self._route()
        if not route.writes:
            return [True] * len(keys)  # MLA: another rank writes the shared pages
        started = time.perf_counter()
        batch = route.view.batch(route.storage_keys(keys), host_indices)
        stored = route.fold(route.router.write(batch, route.storage_parents(keys, extra_info)))
        self.transfer_stats.record(True, stored, batch.nbytes // len(keys), started)
        return stored

    # ------------------------------------------------ legacy: flat tensors
    @never_raises(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        if target_locations is None:
            return [None] * len(keys)
        started = time.perf_counter()
        pages = [[_tensor_view(t)] for t in target_locations]
        found = self._router.read_buffers(list(keys), pages)
        nbytes = pages[0][0].nbytes if pages else 0
        self.transfer_stats.record(False, found, nbytes, started)
        return [t if ok else None for t, ok in zip(target_locations, found)]

    @never_raises(None)
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @never_raises(False)
    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        if not self._route().writes:
            return True
        started = time.perf_counter()
        contiguous = [v.contiguous() for v in values]  # keep alive until sent
        pages = [[_tensor_view(v)] for v in contiguous]
        stored = self._router.write_buffers(list(keys), pages, _parents(list(keys), None))
        self.transfer_stats.record(True, stored, pages[0][0].nbytes if pages else 0, started)
        return all(stored)

    @never_raises(False)
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ---------------------------------------------- v2: hybrid side pools
    @never_raises(lambda *a, **k: empty_result())
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        keys = list(keys)
        kv_held = self._route().held(keys, extra_info)
        kv_pages = P.leading_run(kv_held)
        pool_held = {}
        for transfer in pool_transfers or []:
            if kv_pages and transfer.name not in pool_held:
                pool_held[transfer.name] = self._route(str(transfer.name)).router.held(keys[:kv_pages])
        return pool_hit_result(kv_held, pool_transfers or [], pool_held)

    @never_raises(_all_false_by_pool)
    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return {t.name: self._transfer_v2(t, write=False, extra_info=extra_info) for t in transfers}

    @never_raises(_all_false_by_pool)
    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return {t.name: self._transfer_v2(t, write=True, extra_info=extra_info) for t in transfers}

    def _transfer_v2(self, transfer: PoolTransfer, write: bool, extra_info) -> List[bool]:
        keys = list(transfer.keys or [])
        route = self._route(str(transfer.name))
        if not keys:
            return []
        if route.view is None or transfer.host_indices is None:
            _warn.warning(f"v2:{transfer.name}", "hicache-tiers: pool %s has no host pool or indices", transfer.name)
            return [False] * len(keys)
        if write and not route.writes:
            return [True] * len(keys)
        started = time.perf_counter()
        batch = route.view.batch(route.storage_keys(keys), transfer.host_indices)
        if write:
            flags = route.fold(route.router.write(batch, route.storage_parents(keys, extra_info)))
        else:
            flags = route.fold(route.router.read(batch))
        self.transfer_stats.record(write, flags, route.view.page_bytes(), started)
        return flags

    # ------------------------------------------------------- housekeeping
    @never_raises(None)
    def clear(self) -> None:
        for route in list(self._routes.values()) or [self._route()]:
            for client in route.router.clients:
                client.clear()

    @never_raises(None)
    def get_stats(self):
        return self.transfer_stats.drain()

    def tier_stats(self) -> dict:
        """Each tier daemon's stats (None for a tier that does not answer)."""
        return {c.name: c.stats() for c in self._router.clients}

    def router_stats(self) -> dict:
        """This rank's own counters, summed over its host pools (promotions queued, done, dropped, failed)."""
        total: dict = {}
        for route in list(self._routes.values()):
            for name, value in route.router.counters().items():
                total[name] = total.get(name, 0) + value
        return total

    def close(self) -> None:
        for route in list(self._routes.values()):
            try:
                route.router.close()
            except Exception as exc:
                log.warning("hicache-tiers close: %s", exc)


@dataclass
class _Route:
    """Where one host pool's pages go: its namespace, address view and tier router."""

    namespace: str
    view: Optional[HostPoolView]
    router: TierRouter
    writes: bool  # False on MLA ranks that are not the storage writer
    shards: Optional[HeadShards] = None  # pages stored per KV-head shard (tp_lcm_size)

    def storage_keys(self, keys: List[str]) -> List[str]:
        return self.shards.keys(keys) if self.shards else list(keys)

    def storage_parents(self, keys: List[str], extra_info) -> List[Optional[str]]:
        parents = _parents(keys, extra_info)
        return self.shards.parents(parents) if self.shards else parents

    def fold(self, flags: List[bool]) -> List[bool]:
        """Per page, from per stored key."""
        return self.shards.fold(flags) if self.shards else flags

    def held(self, keys: List[str], extra_info=None) -> bytes:
        """Per page: held by some tier, and worth reading (the break-even rule, when set)."""
        per_key = self.shards.count if self.shards else 1
        page_tokens = self.view.page_size if self.view is not None else 0
        page_bytes = self.view.page_bytes() if self.view is not None else 0
        prefix = extra_info.prefix_keys if extra_info is not None else None
        held = self.router.held(self.storage_keys(keys), page_bytes / per_key, page_tokens / per_key,
                                first_token_of(prefix, page_tokens))
        return self.shards.fold_held(held) if self.shards else held


def _parents(keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> List[Optional[str]]:
    """Each page's predecessor in its prefix (prefix-aware eviction uses it)."""
    first = extra_info.prefix_keys[-1] if extra_info is not None and extra_info.prefix_keys else None
    return [first] + list(keys[:-1])


def _clean_pool_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in name)


def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor, without a copy.

    A copy of a non-contiguous read target would take the page and lose it, so
    such a tensor is refused (the call becomes a miss) instead.
    """
    if not tensor.is_contiguous():
        raise ValueError("a page tensor must be contiguous")
    flat = tensor.view(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")
