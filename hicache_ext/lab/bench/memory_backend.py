"""SGLang's floor for an L3 hit: a storage backend that keeps pages in its own process's memory.

The TTFT part loads it like ours (``--hicache-storage-backend dynamic``, interface v1) into a server
of the same model and pools: a hit through it costs SGLang's own path (the storage query, the host
allocation, the prefetch threads and their acknowledgements, the load to the device) and one memcpy
of each page region between a dict and the host pool (one C call a batch, as ours copies), nothing
more: no daemon, no wire, no checksum. What our L3 hit adds beyond it is what the tiers, the wire and
the checks cost. Never a product backend: unbounded, one process, no node.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache_ext.host_pool import HostPoolView
from tiers.shm.buffers import copy_runs

BACKEND_NAME = "memory_reference"


def extra_config(copies: bool = True) -> dict:
    """--hicache-storage-backend-extra-config that loads this backend with the zero-copy interface.  copies
    False: it keeps the keys and moves no byte (SGLang's page functions alone, scripts/bench_dram_floor.py);
    its reads then give back whatever the host pool held."""
    extra = {"backend_name": BACKEND_NAME, "module_path": __name__, "class_name": "InProcessMemoryStorage",
             "interface_v1": 1}
    if not copies:
        extra["copies"] = False
    return extra


class InProcessMemoryStorage(HiCacheStorage):
    """Pages in a dict of this process (key -> the page's regions end to end, as one byte array)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.pages: Dict[str, np.ndarray] = {}
        self.view: Optional[HostPoolView] = None
        # Arrays of cleared pages, by size, taken again by later writes: a floor pays a copy, not the page
        # faults of fresh memory (a store keeps its memory too).
        self._free: Dict[int, List[np.ndarray]] = {}
        extra = (storage_config.extra_config if storage_config is not None else None) or {}
        self.copies = extra.get("copies", True) is not False

    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.view = HostPoolView(mem_pool_host)

    @staticmethod
    def _runs(regions, lengths, pages: List[np.ndarray], to_pool: bool) -> None:
        """One copy_runs call: each page's regions (addresses in the host pool) from or to its array."""
        pool_side, array_side, sizes = [], [], []
        for page_regions, page_lengths, array in zip(regions, lengths, pages):
            at = array.ctypes.data
            for address, length in zip(page_regions, page_lengths):
                pool_side.append(address)
                array_side.append(at)
                sizes.append(length)
                at += length
        if to_pool:
            copy_runs(pool_side, array_side, sizes)
        else:
            copy_runs(array_side, pool_side, sizes)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        for i, key in enumerate(keys):
            if key not in self.pages:
                return i
        return len(keys)

    def exists(self, key: str) -> bool:
        return key in self.pages

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        batch = self.view.batch(list(keys), host_indices)
        found = [key in self.pages for key in keys]
        hits = [i for i, ok in enumerate(found) if ok and self.copies]
        self._runs(batch.pointers[hits].tolist(), batch.lengths[hits].tolist(), [self.pages[keys[i]] for i in hits],
                   to_pool=True)
        return found

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        batch = self.view.batch(list(keys), host_indices)
        new = [i for i, key in enumerate(keys) if key not in self.pages]
        arrays = [self._array(int(batch.lengths[i].sum()) if self.copies else 0) for i in new]
        if self.copies:
            self._runs(batch.pointers[new].tolist(), batch.lengths[new].tolist(), arrays, to_pool=False)
        for i, array in zip(new, arrays):
            self.pages[keys[i]] = array
        return [True] * len(keys)

    # The legacy interface SGLang still declares abstract: never called with interface v1; it says so.
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        raise NotImplementedError("memory_reference serves interface v1 only")

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        raise NotImplementedError("memory_reference serves interface v1 only")

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        raise NotImplementedError("memory_reference serves interface v1 only")

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        raise NotImplementedError("memory_reference serves interface v1 only")

    def _array(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        return free.pop() if free else np.empty(nbytes, dtype=np.uint8)

    def clear(self) -> None:
        for array in self.pages.values():
            self._free.setdefault(array.nbytes, []).append(array)
        self.pages.clear()
