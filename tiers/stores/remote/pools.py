"""A remote store's pools as this node reaches them: a client per (pool, namespace), which count as down, and a
batch's keys grouped by the pool each lies on, the groups called in parallel.

Each key lives on the pool rendezvous hashing picks (tiers/stores/remote/placement.py);
a pool this node's client of the namespace counts as down is skipped, so its
keys go to each key's next pool.
"""
from __future__ import annotations

import threading
from concurrent.futures import Executor
from typing import Dict, List, Optional, Sequence, Set, Tuple

from tiers.stores.base import PageKey
from tiers.stores.remote.placement import Rendezvous
from tiers.stores.remote.pool_client import PoolClient
from tiers.wire.security import CurveSettings


class Pools:
    """The clients of one remote store, made on first use."""

    def __init__(self, placement: Rendezvous, pool_timeout: float, retry_max: float, name: str,
                 curve: Optional[CurveSettings]):
        self.placement = placement
        self._pool_timeout = pool_timeout
        self._retry_max = retry_max
        self._name = name
        self._curve = curve  # CurveZMQ keys for tcp:// pools
        self._clients: Dict[Tuple[str, str], PoolClient] = {}
        self._lock = threading.Lock()

    def client(self, pool: str, namespace: str) -> PoolClient:
        key = (pool, namespace)
        client = self._clients.get(key)
        if client is None:
            with self._lock:
                client = self._clients.get(key)
                if client is None:
                    client = PoolClient(pool, namespace, self._pool_timeout, self._retry_max, client_name=self._name,
                                        curve=self._curve)
                    self._clients[key] = client
        return client

    def down(self, namespace: str) -> Set[str]:
        """Pools this node's client of namespace counts as down: their keys go to each key's next pool."""
        if len(self.placement.pools) == 1:
            return set()
        return {pool for pool in self.placement.pools if self.client(pool, namespace).is_down()}

    def pick(self, key: PageKey) -> str:
        """The pool key lies on now."""
        namespace, name = key
        return self.placement.pick(name, self.down(namespace))

    def per_pool(self, keys: Sequence[PageKey], call, executor: Executor) -> List[object]:
        """call(client, pool, namespace, positions) for each (pool, namespace) group, in parallel on executor
        (a single group on the calling thread).

        Returns one result a key, in key order; None for keys of a pool that is down.
        """
        groups: Dict[Tuple[str, str], List[int]] = {}
        down: Dict[str, Set[str]] = {}
        for i, (namespace, name) in enumerate(keys):
            skip = down.get(namespace)
            if skip is None:
                skip = down[namespace] = self.down(namespace)
            groups.setdefault((self.placement.pick(name, skip), namespace), []).append(i)
        if len(groups) == 1:
            # One pool and one namespace (most batches): called on this thread, which waits for it either way.
            # Handing it to a worker and back cost a remote lookup after idle ~0.2 ms (1.71 -> 1.50 ms, medians
            # of six runs each: docs/PERFORMANCE.md, session 36).  A frozen pool bounds it the same way: its
            # client's own timeout.
            ((pool, namespace), positions), = groups.items()
            client = self.client(pool, namespace)
            result = None if client.is_down() else call(client, pool, namespace, positions)
            return list(result) if result is not None else [None] * len(keys)
        futures = {}
        for (pool, namespace), positions in groups.items():
            client = self.client(pool, namespace)
            if not client.is_down():
                futures[(pool, namespace)] = executor.submit(call, client, pool, namespace, positions)
        out: List[object] = [None] * len(keys)
        for group, future in futures.items():
            result = future.result()
            if result is not None:
                for i, value in zip(groups[group], result):
                    out[i] = value
        return out

    def clients(self) -> List[PoolClient]:
        """Every client made so far."""
        with self._lock:
            return list(self._clients.values())

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()
