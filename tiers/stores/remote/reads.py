"""A remote store's gets: locate on the key's pool (one round trip, which also releases earlier reads' pins)
and a one-sided engine read; a batch locates once a pool with every transfer in flight.

Reads land in registered landing chunks first (tiers/stores/remote/landed_reads.py)
and are copied into the caller's buffers only when the transfer completed in
time: a transfer cannot be cancelled, and one given up could otherwise complete
into memory the engine has reused.  They go straight into the buffers when a
late byte can harm nobody: buffers the caller holds on request (``hold``), or
any registered memory when the operator accepted the risk (``direct_reads``).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

from tiers.shm.buffers import as_bytes_view
from tiers.stores.base import Buffers, HoldPage, OnFinal, PageKey, total_size
from tiers.stores.remote.engine import abandoned_batches, abandoned_groups, pair_extents
from tiers.stores.remote.landed_reads import land_pages, read_landed
from tiers.stores.remote.pool_client import PoolClient
from tiers.stores.remote.staging import Landing
from tiers.stores.remote.transfers import Transfers, budget


class RemoteReads:
    def __init__(self, transfers: Transfers, landing: Landing, direct_reads: Callable[[], bool]):
        self.t = transfers
        self._landing = landing  # where reads land first
        self._direct_reads = direct_reads  # reads straight into registered memory now (the store's setting)

    def get(self, key: PageKey, dst: Optional[Sequence[memoryview]]) -> Optional[Tuple[bytes, int]]:
        """Read a page into dst (b"") or, with dst None, as bytes, and its checksum; None on a miss."""
        t = self.t
        namespace, name = key
        pool = t.pools.pick(key)
        client = t.pools.client(pool, namespace)
        ttl = t.timeout(t.max_page_bytes) + t.lease_margin
        grant = None if client.is_down() else client.locate([name], ttl=ttl)
        if grant is None or grant.extents[0] is None:
            t.counters.add(misses=1)
            return None
        size, remote = grant.sizes[0], grant.extents[0]
        try:
            if dst is not None and size != total_size(dst):
                t.counters.add(misses=1)
                return None
            local = t.registrations.extents(dst) if dst is not None and self._direct_reads() else None
            if local is not None:
                abandoned: List[Tuple[int, int]] = []
                ok = t.engine.transfer(grant.segment, False, pair_extents(local, remote), t.timeout(size), abandoned)
                if abandoned:  # it may still land in the host pool (the risk direct_reads accepts)
                    t.abandoned.add(abandoned_batches(abandoned))
                out: Optional[bytes] = b"" if ok else None
            else:
                out = read_landed(self._landing, t.engine, grant.segment, remote, size, dst, t.timeout(size))
        finally:
            client.release_later(grant.lease)  # rides on the next locate: one round trip a read
        if out is None:
            t.counters.add(misses=1)
            return None
        t.counters.add(hits=1, bytes_read=size)
        return out, grant.sums[0]

    def get_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], deadline: Optional[float],
                 hold: Optional[HoldPage], executor, on_final: Optional[OnFinal] = None) -> List[Optional[int]]:
        """Read a batch into buffers: one locate a pool, every transfer in flight at once (a group a pool on
        executor); each page's checksum (0: unknown), None for a miss.

        With hold (the daemon's staging blocks, registered with the engine) the
        transfers land in the buffers themselves, no landing copy: a page given up
        at its deadline is held (its blocks stay out of use) until the engine
        reports its transfer ended.  on_final, when given, hears of each page once: of one that lands
        straight in its buffers as its transfer completes, of the others when their group ends.
        """
        views = [[v for v in (as_bytes_view(b) for b in page) if v.nbytes] for page in pages]

        def group(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            held = None if hold is None else (lambda k, positions=positions: hold(positions[k]))
            told = [False] * len(positions)

            def tell(ks: List[int], checksums: List[Optional[int]]) -> None:
                for k in ks:
                    told[k] = True
                on_final([positions[k] for k in ks], checksums)
            out = self._get_group(client, namespace, [keys[i][1] for i in positions],
                                  [views[i] for i in positions], deadline, held,
                                  tell if on_final is not None else None)
            if on_final is not None:
                rest = [k for k in range(len(positions)) if not told[k]]
                if rest:
                    on_final([positions[k] for k in rest], [out[k] for k in rest])
            return out
        return self.t.pools.per_pool(keys, group, executor)

    def _get_group(self, client: PoolClient, namespace: str, names: List[str], views: List[List[memoryview]],
                   deadline: Optional[float], hold: Optional[HoldPage] = None,
                   tell: Optional[Callable[[List[int], List[Optional[int]]], None]] = None) -> List[Optional[int]]:
        t = self.t
        if deadline is not None and time.time() >= deadline:  # nothing could land in time: not even a locate
            t.counters.add(misses=len(names))
            return [None] * len(names)
        # Straight into the buffers when a late byte can harm nobody: memory the caller holds on request
        # (hold), or any registered memory when the operator accepted the risk (direct_reads).
        local = ([t.registrations.extents(page) for page in views]
                 if self._direct_reads() or hold is not None else None)
        if local is not None and any(extents is None for extents in local):  # frames or foreign buffers: staged
            local = None
        grant = client.locate(names, ttl=t.timeout(t.max_page_bytes * len(names)) + t.lease_margin)
        if grant is None:
            t.counters.add(misses=len(names))
            return [None] * len(names)
        moving = [k for k, e in enumerate(grant.extents) if e is not None and grant.sizes[k] == total_size(views[k])]
        out = [False] * len(names)
        nbytes = sum(grant.sizes[k] for k in moving)
        timeout = budget(t.timeout(nbytes), deadline)
        if moving and timeout > 0 and local is not None:  # direct: straight into the buffers
            abandoned: List[Tuple[int, int]] = []
            # The pages whose transfers completed are told of at each look (on this thread, while the rest
            # move): their bytes are all there, and a transfer is never given up after it completed.
            arrived = None if tell is None else (lambda done: tell([moving[i] for i in done],
                                                                   [grant.sums[moving[i]] for i in done]))
            oks = t.engine.transfer_pages(grant.segment, False,
                                          [pair_extents(local[k], grant.extents[k]) for k in moving], timeout,
                                          abandoned, arrived)
            if abandoned and hold is not None:  # the caller keeps each given-up page's buffers until it ended
                for pages, batches in abandoned_groups(abandoned):
                    t.abandoned.add(batches, _all([hold(moving[i]) for i in pages]))
            elif abandoned:  # they may still land in the host pool (the risk direct_reads accepts)
                t.abandoned.add(abandoned_batches(abandoned))
            for k, ok in zip(moving, oks):
                out[k] = ok
        elif moving and timeout > 0:
            land_pages(self._landing, t.engine, grant, moving, views, out, timeout, deadline)
        client.release_later(grant.lease)
        hits = sum(out)
        t.counters.add(hits=hits, misses=len(names) - hits,
                       bytes_read=sum(grant.sizes[k] for k in moving if out[k]))
        return [grant.sums[k] if ok else None for k, ok in enumerate(out)]


def _all(calls: List[Callable[[], None]]) -> Callable[[], None]:
    """One callback running each of calls: a given-up transfer may carry several pages' bytes."""
    def run() -> None:
        for call in calls:
            call()
    return run
