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
from typing import Optional

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.node.daemon import TierDaemon
from tiers.node.routes import Route, Where
from tiers.stores.remote.engine import Engine
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
        self.handlers.update({M.Alloc: Route(self.handle_alloc, Where.LOOP),
                              M.Commit: Route(self.handle_commit, Where.LOOP),
                              M.Locate: Route(self.handle_locate, Where.LOOP),
                              M.Release: Route(self.handle_release, Where.LOOP)})
        self.engine = engine
        engine.register(store.base, store.capacity)
        log.info("pool %s: %d bytes registered with the transfer engine as segment %s", name, store.capacity,
                 engine.segment)

    def _ttl(self, ttl: Optional[float]) -> float:
        if ttl is None:
            return self.pool.max_lease
        if not ttl > 0:  # NaN too
            raise P.ProtocolError("bad_request", "ttl must be a positive number of seconds")
        return float(ttl)

    def handle_alloc(self, msg: M.Alloc, frames) -> list:
        ns = self._namespace(msg, write=True)
        keys = P.check_keys(msg.keys)
        # Sizes over max_page_bytes are refused page by page (refusal), not the whole batch.
        sizes = P.decode_sizes(msg.sizes, len(keys), MAX_SANE_PAGE)
        sums = P.decode_sums(msg.sums, len(keys))
        parents = msg.parents if msg.parents is not None and len(msg.parents) == len(keys) else [None] * len(keys)
        lease, grants, refusal = self.pool.allocate(msg.s, [(ns, k) for k in keys], sizes, parents,
                                                    self._ttl(msg.ttl), sums)
        desc, counts = P.encode_descriptors([g for g in grants if g is not None])
        fields = dict(lease=lease, seg=self.engine.segment, granted=P.flags([g is not None for g in grants]),
                      desc=desc, regions_per_page=counts)
        if refusal:
            fields["refusal"] = list(refusal)
        return [P.reply_ok(msg.id, **fields)]

    def handle_commit(self, msg: M.Commit, frames) -> list:
        ns = self._namespace(msg, write=True)
        keys = P.check_keys(msg.keys)
        done = self.pool.commit(msg.s, msg.lease, [(ns, k) for k in keys])
        self.metrics.pages("put", sum(done), 0)
        return [P.reply_ok(msg.id, committed=P.flags(done))]

    def handle_locate(self, msg: M.Locate, frames) -> list:
        ns = self._namespace(msg)
        keys = P.check_keys(msg.keys)
        for lease in msg.done or ():  # at most MAX_DONE_LEASES: the schema's bound
            self.pool.release(msg.s, lease)
        lease, found = self.pool.locate(msg.s, [(ns, k) for k in keys], self._ttl(msg.ttl))
        held = [f for f in found if f is not None]
        desc, counts = P.encode_descriptors([extents for _size, extents, _sum in held])
        self.metrics.pages("get", len(held), sum(size for size, _e, _sum in held))
        return [P.reply_ok(msg.id, lease=lease, seg=self.engine.segment,
                           found=P.flags([f is not None for f in found]),
                           sizes=P.encode_sizes([size for size, _e, _sum in held]),
                           sums=P.encode_sums([checksum for _size, _e, checksum in held]), desc=desc,
                           regions_per_page=counts)]

    def handle_release(self, msg: M.Release, frames) -> list:
        self._namespace(msg)
        return [P.reply_ok(msg.id, released=self.pool.release(msg.s, msg.lease))]
