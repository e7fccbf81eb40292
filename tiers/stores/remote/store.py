"""RemoteStore: the page store of a node's remote tier, spread over N pool daemons.

Each key lives on the pool rendezvous hashing picks.  A put is alloc (one
round trip), a one-sided engine write from the page's own buffers into the
pool's arena, commit (one round trip); a get is locate (one round trip, which
also releases earlier reads' pins) and an engine read.  A batch (put_many,
get_many_into, which the tier daemon calls when a store has them) makes those
round trips once a pool and keeps every transfer in flight at once.
When the page's buffers lie in a host-pool mapping the daemon registered with
the engine (``region_mapped``, called when an engine hands over its memfd),
writes move bytes straight from the host pool to the arena.  Reads land in
registered landing chunks first and are copied into the host pool only when
the transfer completed before the request's deadline: a transfer cannot be
cancelled, and one given up could otherwise complete into host memory the
engine has reused (``direct_reads`` trades that safety for the copy).  Chunks
and write leases a given-up transfer may still touch stay out of use until
the engine reports it ended.  Pages that arrived as ZeroMQ frames go through
a registered staging slot (one copy on this node).  A pool that does not answer within ``pool_timeout``
costs its keys a miss, not a hang, and rejoins after its back-off.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from tiers.shm.buffers import as_bytes_view
from tiers.stores.remote.engine import Engine, EngineConfig, batches_by_page, pair_extents
from tiers.stores.remote.landed_reads import land_pages, read_landed
from tiers.stores.remote.placement import Rendezvous
from tiers.stores.remote.pool_client import PoolClient
from tiers.stores.remote.staging import Abandoned, Counters, Landing, Registrations, Staging, page_views
from tiers.stores.base import (Buffers, HoldPage, PageKey, PageStore, StoreError, StoreFull, StoreIOError, StoreStats,
                               total_size)
from tiers.plugins import StoreKind
from tiers.wire.security import CurveSettings

log = logging.getLogger("hicache.remote.store")

ADMIN_NAMESPACE = "_admin"
LANDING_BYTES = 256 << 20  # staged reads in flight at once: 32 pages of 8 MiB
LANDING_CHUNK = 256 << 10


class RemoteStore(PageStore):
    """Pages on remote pools, moved by the Transfer Engine."""

    parallel_io = True
    batched = True
    keeps_checksums = True  # in the pools' page records (alloc's and locate's sums)

    def __init__(self, pools: Sequence[str], engine: Engine, max_page_bytes: int = 64 << 20,
                 pool_timeout: float = 0.2, retry_max: float = 2.0, transfer_timeout: float = 1.0,
                 min_bandwidth: float = 100e6, lease_margin: float = 2.0, staging_slots: int = 2,
                 weights: Sequence[float] = (), name: str = "remote", direct_reads: bool = False,
                 landing_bytes: int = 0, landing_chunk: int = LANDING_CHUNK, abandoned_lease: float = 30.0,
                 curve: Optional[CurveSettings] = None):
        self.placement = Rendezvous(list(pools), weights)
        self.engine = engine
        self.max_page_bytes = max_page_bytes
        self.pool_timeout = pool_timeout
        self.retry_max = retry_max
        self.transfer_timeout = transfer_timeout
        self.min_bandwidth = min_bandwidth
        self.lease_margin = lease_margin
        self.name = name
        self.curve = curve  # CurveZMQ keys for tcp:// pools
        self.direct_reads = direct_reads
        self.abandoned_lease = abandoned_lease  # a write lease outlives its deadline by this, for late bytes
        self._clients: Dict[Tuple[str, str], PoolClient] = {}
        self._lock = threading.Lock()
        self._counters = Counters()
        # Lookups and stats run on the daemon's loop thread: they get workers of their own, never
        # queued behind a batch's transfers (which fan out over the other pool).
        self._fan_out = ThreadPoolExecutor(max_workers=len(self.placement.pools), thread_name_prefix=f"{name}-ctl")
        self._movers = ThreadPoolExecutor(max_workers=len(self.placement.pools) * max(1, staging_slots),
                                          thread_name_prefix=f"{name}-move")
        self._registrations = Registrations(engine.register, engine.unregister)
        self._staging = Staging(self._registrations, staging_slots, max_page_bytes)
        # Reads land here first (every read unless direct_reads; pages that are not in a registered host pool
        # always): a transfer given up at its deadline can only write where nothing else looks.
        self._abandoned = Abandoned(engine.status)
        self._landing = Landing(self._registrations, landing_bytes or max(LANDING_BYTES, 2 * max_page_bytes),
                                landing_chunk, self._abandoned)

    # ---------------------------------------------------------- plumbing
    def _client(self, pool: str, namespace: str) -> PoolClient:
        key = (pool, namespace)
        client = self._clients.get(key)
        if client is None:
            with self._lock:
                client = self._clients.get(key)
                if client is None:
                    client = PoolClient(pool, namespace, self.pool_timeout, self.retry_max, client_name=self.name,
                                        curve=self.curve)
                    self._clients[key] = client
        return client

    def _down(self, namespace: str) -> Set[str]:
        """Pools this node's client of namespace counts as down: their keys go to each key's next pool."""
        if len(self.placement.pools) == 1:
            return set()
        return {pool for pool in self.placement.pools if self._client(pool, namespace).is_down()}

    def _timeout(self, nbytes: int) -> float:
        return self.transfer_timeout + nbytes / self.min_bandwidth

    # --------------------------------------------------------- interface
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        namespace, name = key
        src, size = page_views(buffers, self.max_page_bytes)
        pool = self.placement.pick(name, self._down(namespace))
        client = self._client(pool, namespace)
        if client.is_down():
            raise StoreIOError(f"pool {pool} is down")
        timeout = self._timeout(size)
        with self._staging.source_extents(src, size, timeout) as local:
            grant = client.alloc([name], [size], [parent], ttl=timeout + self.lease_margin + self.abandoned_lease,
                                 sums=[checksum])
            if grant is None:
                raise StoreIOError(f"pool {pool} did not answer an alloc")
            remote = grant.extents[0]
            if remote is None:
                raise StoreFull(f"pool {pool} refused the page")
            abandoned: List[Tuple[int, int]] = []
            if not self.engine.transfer(grant.segment, True, pair_extents(local, remote), timeout, abandoned):
                self._release_write(client, grant.lease, abandoned)
                raise StoreIOError(f"transfer to pool {pool} failed or timed out")
            if not client.commit(grant.lease, [name])[0]:
                raise StoreIOError(f"pool {pool} did not commit the page")
        self._counters.add(inserts=1, bytes_written=size)

    def _release_write(self, client: PoolClient, lease: int, abandoned: List[Tuple[int, int]]) -> None:
        """Release a write lease now, or, when a transfer under it was given up, once the engine says it ended.

        Until then its blocks stay reserved (at most the lease's ttl), so late
        bytes cannot land in blocks the pool has handed to another page.
        """
        if abandoned:
            self._abandoned.add([batch for _page, batch in abandoned], lambda: client.release(lease))
        else:
            client.release(lease)

    def _read(self, key: PageKey, dst: Optional[Sequence[memoryview]]) -> Optional[Tuple[bytes, int]]:
        """Read a page into dst (b"") or, with dst None, as bytes, and its checksum; None on a miss."""
        namespace, name = key
        pool = self.placement.pick(name, self._down(namespace))
        client = self._client(pool, namespace)
        ttl = self._timeout(self.max_page_bytes) + self.lease_margin
        grant = None if client.is_down() else client.locate([name], ttl=ttl)
        if grant is None or grant.extents[0] is None:
            self._counters.add(misses=1)
            return None
        size, remote = grant.sizes[0], grant.extents[0]
        try:
            if dst is not None and size != total_size(dst):
                self._counters.add(misses=1)
                return None
            local = self._registrations.extents(dst) if dst is not None and self.direct_reads else None
            if local is not None:
                abandoned: List[Tuple[int, int]] = []
                ok = self.engine.transfer(grant.segment, False, pair_extents(local, remote), self._timeout(size),
                                          abandoned)
                if abandoned:  # it may still land in the host pool (the risk direct_reads accepts)
                    self._abandoned.add([batch for _page, batch in abandoned])
                out: Optional[bytes] = b"" if ok else None
            else:
                out = read_landed(self._landing, self.engine, grant.segment, remote, size, dst, self._timeout(size))
        finally:
            client.release_later(grant.lease)  # rides on the next locate: one round trip a read
        if out is None:
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_read=size)
        return out, grant.sums[0]

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        got = self._read(key, [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes])
        return None if got is None else got[1]

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        return self._read(key, None) or (None, 0)

    def _per_pool(self, keys: Sequence[PageKey], call, executor: Optional[ThreadPoolExecutor] = None) -> List[object]:
        """call(client, pool, namespace, positions) for each (pool, namespace) group, in parallel.

        Returns one result a key, in key order; None for keys of a pool that is down.
        """
        groups: Dict[Tuple[str, str], List[int]] = {}
        down: Dict[str, Set[str]] = {}
        for i, (namespace, name) in enumerate(keys):
            skip = down.get(namespace)
            if skip is None:
                skip = down[namespace] = self._down(namespace)
            groups.setdefault((self.placement.pick(name, skip), namespace), []).append(i)
        futures = {}
        for (pool, namespace), positions in groups.items():
            client = self._client(pool, namespace)
            if not client.is_down():
                futures[(pool, namespace)] = (executor or self._fan_out).submit(call, client, pool, namespace,
                                                                                positions)
        out: List[object] = [None] * len(keys)
        for group, future in futures.items():
            result = future.result()
            if result is not None:
                for i, value in zip(groups[group], result):
                    out[i] = value
        return out

    @staticmethod
    def _budget(timeout: float, deadline: Optional[float]) -> float:
        """A transfer's timeout, cut at the request's absolute deadline (Unix seconds)."""
        return timeout if deadline is None else min(timeout, deadline - time.time())

    def put_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], parents: Sequence[Optional[str]],
                 deadline: Optional[float] = None) -> List[Optional[StoreError]]:
        return self.put_many_with_sums(keys, pages, parents, deadline, [0] * len(keys))

    def put_many_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                           parents: Sequence[Optional[str]], deadline: Optional[float],
                           checksums: Sequence[int],
                           page_sums: Optional[Sequence[int]] = None) -> List[Optional[StoreError]]:
        """Store a batch: one alloc and one commit a pool, every transfer in flight at once.

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
                for r in self._per_pool(keys, group, self._movers)]

    def _put_group(self, client: PoolClient, pool: str, namespace: str, names: List[str],
                   views: List[List[memoryview]], parents: List[Optional[str]], deadline: Optional[float],
                   sums: List[int]) -> list:
        out: list = [None] * len(names)
        todo, sizes, local = [], [], []
        for j, page in enumerate(views):
            size = total_size(page)
            extents = self._registrations.extents(page) if 0 < size <= self.max_page_bytes else None
            if extents is None:  # too large, empty or not in registered memory: the one-page path says which
                if deadline is not None and time.time() > deadline:
                    out[j] = StoreIOError("deadline passed before the page was sent")  # the caller stopped waiting
                    continue
                try:
                    self.put_with_sum((namespace, names[j]), page, parents[j], sums[j])
                    out[j] = True
                except StoreError as exc:
                    out[j] = exc
                continue
            todo.append(j)
            sizes.append(size)
            local.append(extents)
        if not todo:
            return out
        timeout = self._budget(self._timeout(sum(sizes)), deadline)
        grant = client.alloc([names[j] for j in todo], sizes, [parents[j] for j in todo],
                             ttl=max(timeout, 0.01) + self.lease_margin + self.abandoned_lease,
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
        oks = self.engine.transfer_pages(grant.segment, True,
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
            self._release_write(client, grant.lease, abandoned)
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
        self._counters.add(inserts=sum(committed), bytes_written=stored)
        return out

    def get_many_into(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                      deadline: Optional[float] = None) -> List[bool]:
        return [r is not None for r in self.get_many_into_with_sums(keys, pages, deadline)]

    def get_many_into_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                                deadline: Optional[float] = None,
                                hold: Optional[HoldPage] = None) -> List[Optional[int]]:
        """Read a batch into buffers: one locate a pool, every transfer in flight at once; each page's
        checksum (0: unknown), None for a miss.

        With hold (the daemon's staging blocks, registered with the engine) the
        transfers land in the buffers themselves, no landing copy: a page given up
        at its deadline is held (its blocks stay out of use) until the engine
        reports its transfer ended.
        """
        views = [[v for v in (as_bytes_view(b) for b in page) if v.nbytes] for page in pages]

        def group(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            held = None if hold is None else (lambda k, positions=positions: hold(positions[k]))
            return self._get_group(client, namespace, [keys[i][1] for i in positions],
                                   [views[i] for i in positions], deadline, held)
        return self._per_pool(keys, group, self._movers)

    def _get_group(self, client: PoolClient, namespace: str, names: List[str], views: List[List[memoryview]],
                   deadline: Optional[float], hold: Optional[HoldPage] = None) -> List[Optional[int]]:
        if deadline is not None and time.time() >= deadline:  # nothing could land in time: not even a locate
            self._counters.add(misses=len(names))
            return [None] * len(names)
        # Straight into the buffers when a late byte can harm nobody: memory the caller holds on request
        # (hold), or any registered memory when the operator accepted the risk (direct_reads).
        local = ([self._registrations.extents(page) for page in views]
                 if self.direct_reads or hold is not None else None)
        if local is not None and any(extents is None for extents in local):  # frames or foreign buffers: staged
            local = None
        grant = client.locate(names, ttl=self._timeout(self.max_page_bytes * len(names)) + self.lease_margin)
        if grant is None:
            self._counters.add(misses=len(names))
            return [None] * len(names)
        moving = [k for k, e in enumerate(grant.extents) if e is not None and grant.sizes[k] == total_size(views[k])]
        out = [False] * len(names)
        nbytes = sum(grant.sizes[k] for k in moving)
        timeout = self._budget(self._timeout(nbytes), deadline)
        if moving and timeout > 0 and local is not None:  # direct: straight into the buffers
            abandoned: List[Tuple[int, int]] = []
            oks = self.engine.transfer_pages(grant.segment, False,
                                             [pair_extents(local[k], grant.extents[k]) for k in moving], timeout,
                                             abandoned)
            if abandoned and hold is not None:  # the caller keeps each given-up page's buffers until it ended
                for i, batches in batches_by_page(abandoned).items():
                    self._abandoned.add(batches, hold(moving[i]))
            elif abandoned:  # they may still land in the host pool (the risk direct_reads accepts)
                self._abandoned.add([batch for _page, batch in abandoned])
            for k, ok in zip(moving, oks):
                out[k] = ok
        elif moving and timeout > 0:
            land_pages(self._landing, self.engine, grant, moving, views, out, timeout, deadline)
        client.release_later(grant.lease)
        hits = sum(out)
        self._counters.add(hits=hits, misses=len(names) - hits,
                           bytes_read=sum(grant.sizes[k] for k in moving if out[k]))
        return [grant.sums[k] if ok else None for k, ok in enumerate(out)]

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        keys = list(keys)

        def lookup(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            held = client.lookup([keys[i][1] for i in positions])
            return None if held is None else [b != 0 for b in held]
        return [bool(v) for v in self._per_pool(keys, lookup)]

    def delete(self, keys: Iterable[PageKey]) -> int:
        keys = list(keys)

        def delete(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            return [client.delete([keys[i][1] for i in positions])] + [0] * (len(positions) - 1)
        return sum(v or 0 for v in self._per_pool(keys, delete))

    def clear(self, namespace: Optional[str] = None) -> int:
        if namespace is None:
            clients = [self._client(pool, ADMIN_NAMESPACE) for pool in self.placement.pools]
            results = self._fan_out.map(lambda c: c.clear(everything=True), clients)
        else:
            clients = [self._client(pool, namespace) for pool in self.placement.pools]
            results = self._fan_out.map(lambda c: c.clear(), clients)
        return sum(r or 0 for r in results)

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        raise StoreError("a remote tier does not evict: each pool evicts by its own policy "
                         "(run `evict` against the pool daemons)")

    def region_mapped(self, view: memoryview) -> None:
        """A host pool the daemon mapped: registered with the engine so pages move from and into it directly."""
        self._registrations.add(view, background=True)

    def region_unmapped(self, view: memoryview) -> None:
        self._registrations.remove(view)

    def stats(self) -> StoreStats:
        """This node's hits, misses and bytes; capacity, use, pages and evictions summed over the pools that answer."""
        admins = [self._client(pool, ADMIN_NAMESPACE) for pool in self.placement.pools]
        pool_stats = list(self._fan_out.map(lambda c: None if c.is_down() else c.stats(), admins))
        with self._lock:
            clients = list(self._clients.values())
        down = {c.endpoint for c in clients if c.is_down()} | {p for p, st in zip(self.placement.pools, pool_stats)
                                                               if st is None}
        snap = self._counters.snapshot(pools=len(self.placement.pools), pools_down=len(down),
                                       staging_slots_free=self._staging.free_slots(),
                                       landing_chunks_free=self._landing.free_chunks(),
                                       landing_chunks_held=self._landing.held_chunks())
        for st in pool_stats:
            for name in ("capacity_bytes", "used_bytes", "pages", "evictions"):
                value = st.get(name) if isinstance(st, dict) else None
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(snap, name, getattr(snap, name) + value)
        return snap

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()
        self._fan_out.shutdown(wait=False)
        self._movers.shutdown(wait=False)
        self._staging.close()
        self._landing.close()
        self._abandoned.close()

    @classmethod
    def from_config(cls, tier) -> "RemoteStore":
        options = tier.options
        if not options["pools"]:
            raise ValueError(f"tier {tier.name}: pools lists no pool endpoint")
        engine = Engine(EngineConfig.from_options(options))
        return cls(options["pools"], engine, max_page_bytes=tier.max_page_bytes,
                   pool_timeout=options["pool_timeout_ms"] / 1000.0, retry_max=options["pool_retry_max_ms"] / 1000.0,
                   transfer_timeout=options["transfer_timeout_ms"] / 1000.0,
                   min_bandwidth=float(options["min_bandwidth"]), staging_slots=options["io_threads"],
                   weights=options["pool_weights"], name=tier.name, direct_reads=options["direct_reads"],
                   curve=tier.curve)


# The remote kind, as tiers/plugins.py finds it (options: tiers/stores/kind_options.py KIND_OPTIONS["remote"]).
KIND = StoreKind("remote", lambda tier, quotas=None, evictions=None: RemoteStore.from_config(tier),
                 description="memory pools of other nodes through the Mooncake Transfer Engine")
