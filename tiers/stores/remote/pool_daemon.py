"""The pool daemon: a TierDaemon whose store is a registered arena, plus the pool operations.

``hicache-tiers serve --tier NAME`` runs it for a tier of kind ``pool`` (the
``hicache-pool`` systemd unit).  alloc, commit, locate and release are index
operations and run on the loop thread; page bytes never pass through it: the
remote engines read and write the arena themselves.  hello, lookup, delete,
clear, evict, stats, and put/get with page frames (a debugging path) are the
tier daemon's own.
"""
from __future__ import annotations

import logging
from typing import List, Optional

from tiers.wire import protocol as P
from tiers.ops.config import NodeConfig, TierConfig
from tiers.node.daemon import TierDaemon
from tiers.stores.remote.engine import Engine, EngineConfig
from tiers.stores.remote.pool import PoolStore
from tiers.wire.security import CurveSettings

log = logging.getLogger("hicache.remote.pool")

MAX_SANE_PAGE = 1 << 40  # larger is a malformed request, not a page to refuse


class PoolDaemon(TierDaemon):
    """Serves a PoolStore whose arena is registered with this process's Transfer Engine."""

    def __init__(self, name: str, store: PoolStore, endpoint: str, engine: Engine, max_page_bytes: int,
                 curve: Optional[CurveSettings] = None):
        super().__init__(name, store, endpoint, fd_socket=None, max_page_bytes=max_page_bytes, io_threads=1,
                         staging_bytes=1 << 20, curve=curve)  # no engine attaches to a pool: no staging needed
        self.pool: PoolStore = store
        self.engine = engine
        engine.register(store.base, store.capacity)
        log.info("pool %s: %d bytes registered with the transfer engine as segment %s", name, store.capacity,
                 engine.segment)

    def _ttl(self, header: dict) -> float:
        ttl = header.get("ttl", self.pool.max_lease)
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not ttl > 0:
            raise P.ProtocolError("bad_request", "ttl must be a positive number of seconds")
        return float(ttl)

    @staticmethod
    def _parents(header: dict, n: int) -> List[Optional[str]]:
        parents = header.get("parents")
        if not isinstance(parents, list) or len(parents) != n:
            return [None] * n
        return [p if isinstance(p, str) else None for p in parents]

    def _lease_field(self, header: dict) -> int:
        lease = header.get("lease")
        if not isinstance(lease, int) or isinstance(lease, bool):
            raise P.ProtocolError("bad_request", "lease must be an integer")
        return lease

    def handle_alloc(self, header: dict, frames) -> list:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        # Sizes over max_page_bytes are refused page by page (refusal), not the whole batch.
        sizes = P.decode_sizes(header.get("sizes"), len(keys), MAX_SANE_PAGE)
        sums = P.decode_sums(header.get("sums"), len(keys))
        lease, grants, refusal = self.pool.allocate(header["s"], [(ns, k) for k in keys], sizes,
                                                    self._parents(header, len(keys)), self._ttl(header), sums)
        desc, counts = P.encode_descriptors([g for g in grants if g is not None])
        fields = dict(lease=lease, seg=self.engine.segment, granted=P.flags([g is not None for g in grants]),
                      desc=desc, regions_per_page=counts)
        if refusal:
            fields["refusal"] = list(refusal)
        return [P.reply_ok(header["id"], **fields)]

    def handle_commit(self, header: dict, frames) -> list:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        done = self.pool.commit(header["s"], self._lease_field(header), [(ns, k) for k in keys])
        self.metrics.pages("put", sum(done), 0)
        return [P.reply_ok(header["id"], committed=P.flags(done))]

    def handle_locate(self, header: dict, frames) -> list:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        done = header.get("done", [])
        if not isinstance(done, list) or len(done) > P.MAX_DONE_LEASES:
            raise P.ProtocolError("bad_request", f"done must be a list of at most {P.MAX_DONE_LEASES} leases")
        for lease in done:
            if isinstance(lease, int) and not isinstance(lease, bool):
                self.pool.release(header["s"], lease)
        lease, found = self.pool.locate(header["s"], [(ns, k) for k in keys], self._ttl(header))
        held = [f for f in found if f is not None]
        desc, counts = P.encode_descriptors([extents for _size, extents, _sum in held])
        self.metrics.pages("get", len(held), sum(size for size, _e, _sum in held))
        return [P.reply_ok(header["id"], lease=lease, seg=self.engine.segment,
                           found=P.flags([f is not None for f in found]),
                           sizes=P.encode_sizes([size for size, _e, _sum in held]),
                           sums=P.encode_sums([checksum for _size, _e, checksum in held]), desc=desc,
                           regions_per_page=counts)]

    def handle_release(self, header: dict, frames) -> list:
        self._namespace(header)
        return [P.reply_ok(header["id"], released=self.pool.release(header["s"], self._lease_field(header)))]


def endpoint_host(endpoint: str) -> str:
    """The host of a tcp:// endpoint ('' for ipc:// or a wildcard)."""
    if not endpoint.startswith("tcp://"):
        return ""
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return "" if host in ("*", "0.0.0.0", "::") else host


def build_pool_daemon(node: NodeConfig, tier: TierConfig) -> PoolDaemon:
    """A pool daemon for a tier of kind pool: arena, engine, registration (EngineError when it cannot start)."""
    options = tier.options
    host = options.get("te_hostname") or endpoint_host(tier.endpoint)
    if not host:
        raise ValueError(f"tier {tier.name}: te_hostname is needed when the endpoint {tier.endpoint} names no host")
    engine = Engine(EngineConfig.from_options(options, default_host=host))
    store = PoolStore(tier.capacity, tier.policy, block_size=options["block_size"],
                      max_page_bytes=tier.max_page_bytes, max_lease=options["max_lease_ms"] / 1000.0,
                      prefault=options["prefault"])
    return PoolDaemon(tier.name, store, tier.endpoint, engine, max_page_bytes=tier.max_page_bytes, curve=tier.curve)
