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

This module is the PageStore: it builds the parts and answers lookups,
deletes, clears and stats; the clients of the pools are
tiers/stores/remote/pools.py's, puts writes.py's and gets reads.py's.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

from tiers.shm.buffers import as_bytes_view
from tiers.stores.remote.engine import Engine, EngineConfig
from tiers.stores.remote.placement import Rendezvous
from tiers.stores.remote.pool_client import PoolClient
from tiers.stores.remote.pools import Pools
from tiers.stores.remote.reads import RemoteReads
from tiers.stores.remote.staging import Abandoned, Counters, Landing, Registrations, Staging
from tiers.stores.remote.transfers import Transfers
from tiers.stores.remote.writes import RemoteWrites
from tiers.stores.base import Buffers, HoldPage, OnFinal, PageKey, PageStore, StoreError, StoreStats
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
    streams_reads = True  # each page of a get told of as its transfer completes: the engine copies it meanwhile

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
        self._pools = Pools(self.placement, pool_timeout, retry_max, name, curve)
        self._counters = Counters()
        # Lookups and stats run on the daemon's loop thread: those of several pools get workers of their own,
        # never queued behind a batch's transfers (which fan out over the other pool); one pool's run on the
        # loop thread itself (Pools.per_pool).
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
        transfers = Transfers(self._pools, engine, self._registrations, self._abandoned, self._counters,
                              max_page_bytes, transfer_timeout, min_bandwidth, lease_margin)
        self._writes = RemoteWrites(transfers, self._staging, abandoned_lease)
        # direct_reads is read at each read: the operator (or a benchmark) may change it on a live store.
        self._reads = RemoteReads(transfers, self._landing, lambda: self.direct_reads)

    # --------------------------------------------------------- interface
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        self.put_with_sum(key, buffers, parent, 0)

    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        self._writes.put(key, buffers, parent, checksum)

    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        return self.get_into_with_sum(key, buffers) is not None

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        got = self._reads.get(key, [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes])
        return None if got is None else got[1]

    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        return self.get_bytes_with_sum(key)[0]

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        return self._reads.get(key, None) or (None, 0)

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
        return self._writes.put_many(keys, pages, parents, deadline, checksums, self._movers)

    def get_many_into(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                      deadline: Optional[float] = None) -> List[bool]:
        return [r is not None for r in self.get_many_into_with_sums(keys, pages, deadline)]

    def get_many_into_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                                deadline: Optional[float] = None,
                                hold: Optional[HoldPage] = None) -> List[Optional[int]]:
        """Read a batch into buffers: one locate a pool, every transfer in flight at once; each page's
        checksum (0: unknown), None for a miss (tiers/stores/remote/reads.py; hold: the daemon's staging
        blocks, the transfers land in them)."""
        return self._reads.get_many(keys, pages, deadline, hold, self._movers)

    def get_many_streamed(self, keys: Sequence[PageKey], pages: Sequence[Buffers], deadline: Optional[float],
                          on_final: OnFinal, hold: Optional[HoldPage] = None) -> None:
        """As get_many_into_with_sums, each page told of as its transfer completes, while the rest move
        (PageStore); with hold, transfers land straight in the buffers, as there."""
        self._reads.get_many(keys, pages, deadline, hold, self._movers, on_final)

    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        keys = list(keys)

        def lookup(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            held = client.lookup([keys[i][1] for i in positions])
            return None if held is None else [b != 0 for b in held]
        return [bool(v) for v in self._pools.per_pool(keys, lookup, self._fan_out)]

    def delete(self, keys: Iterable[PageKey]) -> int:
        keys = list(keys)

        def delete(client: PoolClient, pool: str, namespace: str, positions: List[int]):
            return [client.delete([keys[i][1] for i in positions])] + [0] * (len(positions) - 1)
        return sum(v or 0 for v in self._pools.per_pool(keys, delete, self._fan_out))

    def clear(self, namespace: Optional[str] = None) -> int:
        if namespace is None:
            clients = [self._pools.client(pool, ADMIN_NAMESPACE) for pool in self.placement.pools]
            results = self._fan_out.map(lambda c: c.clear(everything=True), clients)
        else:
            clients = [self._pools.client(pool, namespace) for pool in self.placement.pools]
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

    def sends_from(self, view: memoryview) -> bool:
        """Pages of a host pool registered with the engine move straight out of it (RemoteWrites keeps them
        referenced under a transfer given up).  Over TCP the engine sends from the mapping through the kernel:
        a truncated memfd fails the transfer and the daemon lives (tests/test_remote_in_place.py); over RDMA
        the registration pins the pages.  A host pool is registered, in the background, the first time the
        daemon asks (only for pages that are one piece of memory each: MLA, ``page_unified``; K and V apart go
        through staging, where neighbours merge), so no other pool is pinned; until then its pages are staged."""
        if self._registrations.extents([view]) is not None:
            return True
        self._registrations.add(view, background=True)
        return False

    def stats(self) -> StoreStats:
        """This node's hits, misses and bytes; capacity, use, pages and evictions summed over the pools that answer."""
        admins = [self._pools.client(pool, ADMIN_NAMESPACE) for pool in self.placement.pools]
        pool_stats = list(self._fan_out.map(lambda c: None if c.is_down() else c.stats(), admins))
        down = {c.endpoint for c in self._pools.clients() if c.is_down()}
        down |= {p for p, st in zip(self.placement.pools, pool_stats) if st is None}
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
        self._pools.close()
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
