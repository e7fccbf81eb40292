"""A remote tier backed by an existing Mooncake Store cluster (its master and its clients).

For sites that already run ``mooncake_master`` and Mooncake Store clients:
this tier daemon becomes one more client (``MooncakeDistributedStore``),
optionally contributing ``global_segment_size`` bytes of its own memory to the
cluster.  Placement, replication and eviction are the cluster's; keys are
``NAMESPACE/KEY``.  Host-pool mappings are registered with the store's engine
(``register_buffer``) so pages move from and into them with no staging copy;
pages that arrive as frames go through a registered staging slot.

Differences from the pool tier, all the Mooncake Store's own behaviour: a put
of a key that exists replaces it only when the page is one contiguous buffer
(``upsert_from``); a page in several buffers goes through
``batch_put_from_multi_buffers``, which keeps the stored object (HiCache keys
name their content, so it holds the same bytes).  Calls are bounded by the
store client's own RPC timeouts, not by the tier's deadline.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Iterable, List, Optional, Tuple

from tiers.shm.buffers import address_of, as_bytes_view, scatter_copy
from tiers.stores.remote.engine import EngineError
from tiers.stores.remote.staging import Counters, Registrations, Staging, page_views
from tiers.stores.base import Buffers, PageKey, PageStore, StoreError, StoreIOError, StoreStats, total_size
from tiers.plugins import StoreKind

log = logging.getLogger("hicache.remote.mooncake_store")


def _load():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise EngineError(f"cannot load the Mooncake Store client (mooncake.store): {exc}; install "
                          "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine) and Debian's "
                          "libibverbs1 (scripts/install-system-deps.sh)") from None
    return MooncakeDistributedStore


class MooncakeStoreTier(PageStore):
    """Pages in a Mooncake Store cluster, through one MooncakeDistributedStore client."""

    parallel_io = True

    def __init__(self, client, max_page_bytes: int = 64 << 20, staging_slots: int = 2, slot_timeout: float = 5.0):
        self._client = client
        self.max_page_bytes = max_page_bytes
        self._slot_timeout = slot_timeout
        self._registrations = Registrations(self._register, self._unregister)
        self._staging = Staging(self._registrations, staging_slots, max_page_bytes)
        self._counters = Counters()

    @classmethod
    def connect(cls, master: str, hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                protocol: str = "tcp", device_name: str = "", global_segment_size: int = 0,
                local_buffer_size: int = 256 << 20, **kwargs) -> "MooncakeStoreTier":
        """A client of the cluster whose master is at master (HOST:PORT); EngineError when setup fails."""
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        client = _load()()
        ret = client.setup(hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name,
                           master)
        if ret != 0:
            raise EngineError(f"Mooncake Store setup against master {master} failed ({ret}): is mooncake_master "
                              f"running there, and metadata_server {metadata_server} reachable?")
        log.info("Mooncake Store client of master %s (contributing %d bytes)", master, global_segment_size)
        return cls(client, **kwargs)

    @classmethod
    def from_config(cls, tier) -> "MooncakeStoreTier":
        o = tier.options
        return cls.connect(o["master_server_address"], hostname=o["te_hostname"], metadata_server=o["metadata_server"],
                           protocol=o["protocol"], device_name=o["device_name"],
                           global_segment_size=o["global_segment_size"], local_buffer_size=o["local_buffer_size"],
                           max_page_bytes=tier.max_page_bytes, staging_slots=o["io_threads"])

    # ---------------------------------------------------------- plumbing
    def _register(self, base: int, length: int) -> None:
        ret = self._client.register_buffer(base, length)
        if ret != 0:
            raise EngineError(f"register_buffer of {length} bytes failed ({ret})")

    def _unregister(self, base: int) -> None:
        self._client.unregister_buffer(base)

    @staticmethod
    def _name(key: PageKey) -> str:
        return f"{key[0]}/{key[1]}"  # '/' is outside the key alphabet: no two keys collide

    # --------------------------------------------------------- interface
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        src, size = page_views(buffers, self.max_page_bytes)
        name = self._name(key)
        with self._staging.source_extents(src, size, self._slot_timeout) as local:
            if len(local) == 1:
                ret = self._client.upsert_from(name, local[0][0], size)
            else:
                ret = self._client.batch_put_from_multi_buffers([name], [[a for a, _n in local]],
                                                                [[n for _a, n in local]])[0]
        if ret != 0:
            raise StoreIOError(f"Mooncake Store refused {name} ({ret})")
        self._counters.add(inserts=1, bytes_written=size)

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        dst = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
        size = total_size(dst)
        local = self._registrations.extents(dst)
        if local is None:
            data = self.get_bytes(key)
            if data is None or len(data) != size:
                return False
            scatter_copy(dst, [memoryview(data)])
            return True
        got = self._client.batch_get_into_multi_buffers([self._name(key)], [[a for a, _n in local]],
                                                        [[n for _a, n in local]])[0]
        if got != size:  # negative: missing, or a size that does not match
            self._counters.add(misses=1)
            return False
        self._counters.add(hits=1, bytes_read=size)
        return True

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        name = self._name(key)
        size = self._client.get_size(name)
        if size <= 0 or size > self.max_page_bytes:
            self._counters.add(misses=1)
            return None
        slot = self._staging.take(self._slot_timeout)
        try:
            staged = self._staging.view(slot, size)
            if self._client.get_into(name, address_of(staged), size) != size:
                self._counters.add(misses=1)
                return None
            data = bytes(staged)
        finally:
            self._staging.give(slot)
        self._counters.add(hits=1, bytes_read=size)
        return data

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        names = [self._name(k) for k in keys]
        if not names:
            return []
        return [r == 1 for r in self._client.batch_is_exist(names)]

    def delete(self, keys: Iterable[PageKey]) -> int:
        return sum(self._client.remove(self._name(k), True) == 0 for k in keys)

    def clear(self, namespace: Optional[str] = None) -> int:
        if namespace is None:
            return max(0, self._client.remove_all(True))
        return max(0, self._client.remove_by_regex(f"^{re.escape(namespace)}/", True))

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        raise StoreError("a Mooncake Store tier does not evict: the cluster's master does")

    def region_mapped(self, view: memoryview) -> None:
        """A host pool the daemon mapped: registered with the engine so pages move from and into it directly."""
        self._registrations.add(view, background=True)

    def region_unmapped(self, view: memoryview) -> None:
        self._registrations.remove(view)

    def stats(self) -> StoreStats:
        return self._counters.snapshot(master_healthy=1 if self._client.health_check() == 0 else 0,
                                       staging_slots_free=self._staging.free_slots())

    def close(self) -> None:
        self._staging.close()
        self._client.close()


# The mooncake_store kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS).
KIND = StoreKind("mooncake_store", lambda tier, quotas=None, evictions=None: MooncakeStoreTier.from_config(tier),
                 description="a Mooncake Store cluster (master and store nodes)")
