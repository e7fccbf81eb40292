"""A remote store's puts: alloc on the key's pool (one round trip), a one-sided engine write into the pool's
arena, commit (one round trip); a batch makes those round trips once a pool with every transfer in flight.

Pages in a host pool the engine registered move straight from it; pages
that arrived as ZeroMQ frames go through a registered staging slot (one copy
on this node).  A write lease under a transfer given up at its deadline is
released only once the engine says the transfer ended: late bytes never land
in blocks the pool has handed to another page.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

from tiers.shm.buffers import as_bytes_view
from tiers.stores.base import Buffers, PageKey, StoreError, StoreFull, StoreIOError, total_size
from tiers.stores.remote.engine import abandoned_batches, pair_extents
from tiers.stores.remote.pool_client import PoolClient
from tiers.stores.remote.staging import Staging, page_views
from tiers.stores.remote.transfers import Transfers, budget


class RemoteWrites:
    def __init__(self, transfers: Transfers, staging: Staging, abandoned_lease: float):
        self.t = transfers
        self._staging = staging  # registered slots for pages outside registered memory
        self._abandoned_lease = abandoned_lease  # a write lease outlives its deadline by this, for late bytes

    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        t = self.t
        namespace, name = key
        src, size = page_views(buffers, t.max_page_bytes)
        pool = t.pools.pick(key)
        client = t.pools.client(pool, namespace)
        if client.is_down():
            raise StoreIOError(f"pool {pool} is down")
        timeout = t.timeout(size)
        with self._staging.source_extents(src, size, timeout) as local:
            grant = client.alloc([name], [size], [parent], ttl=timeout + t.lease_margin + self._abandoned_lease,
                                 sums=[checksum])
            if grant is None:
                raise StoreIOError(f"pool {pool} did not answer an alloc")
            remote = grant.extents[0]
            if remote is None:
                raise StoreFull(f"pool {pool} refused the page")
            abandoned: List[Tuple[int, int]] = []
            if not t.engine.transfer(grant.segment, True, pair_extents(local, remote), timeout, abandoned):
                self._release_write(client, grant.lease, abandoned)
                raise StoreIOError(f"transfer to pool {pool} failed or timed out")
            if not client.commit(grant.lease, [name])[0]:
                raise StoreIOError(f"pool {pool} did not commit the page")
        t.counters.add(inserts=1, bytes_written=size)

    def _release_write(self, client: PoolClient, lease: int, abandoned: List[Tuple[int, int]],
                       sources: object = None) -> None:
        """Release a write lease now, or, when a transfer under it was given up, once the engine says it ended.

        Until then its blocks stay reserved (at most the lease's ttl), so late
        bytes cannot land in blocks the pool has handed to another page; and
        sources (the pages' views) stay referenced: a host pool's mapping is
        unmapped only once no view of it lives (tiers/node/regions.py), so the
        engine never reads an address unmapped or mapped again for other memory.
        """
        if abandoned:
            self.t.abandoned.add(abandoned_batches(abandoned), lambda kept=sources: client.release(lease))
        else:
            client.release(lease)

    def put_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], parents: Sequence[Optional[str]],
                 deadline: Optional[float], checksums: Sequence[int], executor) -> List[Optional[StoreError]]:
        """Store a batch: one alloc and one commit a pool, every transfer in flight at once (a group a pool on
        executor).

        Returns, per key, None when stored or the StoreError that refused it.
        Pages outside registered memory (frames) are stored one by one.
        """
        views = [[v for v in (as_bytes_view(b) for b in page) if v.nbytes] for page in pages]
        parents = [p if isinstance(p, str) else None for p in parents]

        def group(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            return self._put_group(client, pool, namespace, [keys[i][1] for i in positions],
                                   [views[i] for i in positions], [parents[i] for i in positions], deadline,
                                   [checksums[i] for i in positions])
        return [StoreIOError("pool is down") if r is None else (None if r is True else r)
                for r in self.t.pools.per_pool(keys, group, executor)]

    def _put_group(self, client: PoolClient, pool: str, namespace: str, names: List[str],
                   views: List[List[memoryview]], parents: List[Optional[str]], deadline: Optional[float],
                   sums: List[int]) -> list:
        t = self.t
        out: list = [None] * len(names)
        todo, sizes, local = [], [], []
        for j, page in enumerate(views):
            size = total_size(page)
            extents = t.registrations.extents(page) if 0 < size <= t.max_page_bytes else None
            if extents is None:  # too large, empty or not in registered memory: the one-page path says which
                if deadline is not None and time.time() > deadline:
                    out[j] = StoreIOError("deadline passed before the page was sent")  # the caller stopped waiting
                    continue
                try:
                    self.put((namespace, names[j]), page, parents[j], sums[j])
                    out[j] = True
                except StoreError as exc:
                    out[j] = exc
                continue
            todo.append(j)
            sizes.append(size)
            local.append(extents)
        if not todo:
            return out
        timeout = budget(t.timeout(sum(sizes)), deadline)
        grant = client.alloc([names[j] for j in todo], sizes, [parents[j] for j in todo],
                             ttl=max(timeout, 0.01) + t.lease_margin + self._abandoned_lease,
                             sums=[sums[j] for j in todo]) if timeout > 0 else None
        if grant is None:
            for j in todo:
                out[j] = StoreIOError(f"pool {pool} did not answer an alloc in time")
            return out
        moving = [k for k, e in enumerate(grant.extents) if e is not None]
        for k, e in enumerate(grant.extents):
            if e is None:
                out[todo[k]] = StoreFull(f"pool {pool} refused the page")
        abandoned: List[Tuple[int, int]] = []
        oks = t.engine.transfer_pages(grant.segment, True,
                                      [pair_extents(local[k], grant.extents[k]) for k in moving], timeout, abandoned)
        done = [todo[k] for k, ok in zip(moving, oks) if ok]
        for k, ok in zip(moving, oks):
            if not ok:
                out[todo[k]] = StoreIOError(f"transfer to pool {pool} failed or timed out")
        if done and deadline is not None and time.time() > deadline:
            # The engine may have reused its buffers: what was read after the deadline may be torn.
            for j in done:
                out[j] = StoreIOError("deadline passed during the transfer")
            done = []
        if abandoned:
            # Committing ends the lease and frees the pages not committed, while the bytes of one given up may
            # still arrive: commit nothing, and release the lease only once the engine says those ended.
            for j in done:
                out[j] = StoreIOError("another page's transfer to the pool was given up")
            self._release_write(client, grant.lease, abandoned, views)
            return out
        if not done:
            client.release(grant.lease)
            return out
        committed = client.commit(grant.lease, [names[j] for j in done])
        size_of = dict(zip(todo, sizes))
        stored = 0
        for j, ok in zip(done, committed):
            out[j] = True if ok else StoreIOError(f"pool {pool} did not commit the page")
            stored += size_of[j] if ok else 0
        t.counters.add(inserts=sum(committed), bytes_written=stored)
        return out
