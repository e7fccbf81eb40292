"""A tier daemon's page operations: hello, lookup, put, get, release, touch and stats.

Each handler runs on the daemon's loop thread and checks its request there; it returns its reply, or the
work that makes the reply, which runs where the request's route says (tiers/node/routes.py, the daemon's
``handlers``).  Who sent the request comes from the daemon that dispatches it (``RequestContext``): a
session is its own tenant's only, and every namespace a handler touches is its session's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from tiers.node.admin_ops import target_namespace
from tiers.node.demotion import Demoter
from tiers.node.dirty import DirtySet, MODES
from tiers.node.metrics import DaemonMetrics
from tiers.node.reads import PageReads
from tiers.node.regions import RegionRegistry
from tiers.node.sessions import ADMIN_NAMESPACE, Sessions
from tiers.node.tenant_stats import TenantStats
from tiers.node.tenants import OPERATOR, Tenant
from tiers.node.transfers import PageTransfers
from tiers.logs import RateLimitedLog
from tiers.shm.arena import BlockArena
from tiers.stores.base import PageStore
from tiers.wire import messages as M
from tiers.wire import protocol as P

log = logging.getLogger("hicache.daemon")
_warn = RateLimitedLog(log)


@dataclass
class RequestContext:
    """Who sent the request being dispatched, as the daemon's loop knows it."""

    namespace: Callable[..., str]  # namespace(msg, write=False): its session's, checked for the sender's tenant
    tenant: Callable[[], Optional[Tenant]]  # the tenant of the peer that sent it


class PageOps:
    """The handlers of the page operations, over the daemon's store, arena and sessions."""

    def __init__(self, name: str, store: PageStore, arena: BlockArena, arena_id: int, transfers: PageTransfers,
                 reads: PageReads, sessions: Sessions, metrics: DaemonMetrics, dirty: DirtySet,
                 demoter: Optional[Demoter], regions: Optional[RegionRegistry], max_page_bytes: int,
                 context: RequestContext, tenant_stats: TenantStats, daemon_stats: Callable[[], dict]):
        self.name, self.store, self.arena, self.arena_id = name, store, arena, arena_id
        self.transfers, self.reads, self.sessions, self.metrics = transfers, reads, sessions, metrics
        self.dirty, self.demoter, self.regions = dirty, demoter, regions
        self.max_page_bytes = max_page_bytes
        self.context = context
        self.tenant_stats = tenant_stats  # what a tenant's stats request shows
        self.daemon_stats = daemon_stats  # the operator's: the whole daemon's (TierDaemon.stats)

    def _lease_owner(self, msg: M.Request) -> Tuple[int, Optional[int]]:
        return self.sessions.lease_owner(msg.s, self.arena.size)

    def handle_hello(self, msg: M.Hello, frames) -> list:
        ns = P.check_namespace(msg.ns)
        tenant = self.context.tenant()
        client = msg.client[:200]
        session = self.sessions.open(ns, client, tenant)
        if tenant is not OPERATOR and ns != ADMIN_NAMESPACE:  # the operator's namespaces are a share each
            self.store.assign_tenant(ns, tenant.name, tenant.quota_in(self.name) or None)
        # The operator's CLI says hello on every status poll: that is not news.
        (log.debug if ns == ADMIN_NAMESPACE else log.info)("hello from %s for namespace %s", client or "?", ns)
        return [P.reply_ok(msg.id, session=session, tier=self.name, max_page_bytes=self.max_page_bytes,
                           max_batch=P.MAX_BATCH, fd_socket=self.regions.path if self.regions is not None else "",
                           digests=self.store.answers_digests, dir_ns=self.reads.directory_number(ns, tenant))]

    # ----------------------------------------------------------- operations
    def handle_lookup(self, msg: M.Lookup, frames) -> list:
        ns = self.context.namespace(msg)
        self._release_done(msg)
        if msg.digests is not None:  # packed key digests: one field, one native call (tiers/wire/protocol.py)
            if not self.store.answers_digests:
                raise P.ProtocolError("bad_request", f"tier {self.name} takes lookups by key, not by digest")
            held = self.store.held_digests(ns, P.check_digests(msg.digests))
        elif msg.keys is not None:
            held = self.store.held(ns, P.check_keys(msg.keys))
        else:
            raise P.ProtocolError("bad_request", "a lookup names keys or digests")
        prefix = P.leading_run(held)
        self.metrics.lookup(len(held), prefix)
        return [P.reply_ok(msg.id, held=held, prefix=prefix)]

    def handle_put(self, msg: M.Put, frames) -> Callable[[], list]:
        # An _admin session may name the namespace per put: a demotion link carries every namespace's pages
        # through one session (one connection, one attach), however many namespaces the tier above holds.
        ns = target_namespace(False, msg.ns, self.context.namespace(msg, write=True))
        self._release_done(msg)
        keys = P.check_keys(msg.keys)
        sources = self.transfers.page_sources(msg, frames, keys, self.regions)
        sums = P.decode_sums(msg.sums, len(keys))
        parents = msg.parents if msg.parents is not None and len(msg.parents) == len(keys) else [None] * len(keys)
        mode, min_reads = msg.mode, msg.min_reads
        if mode not in MODES or min_reads < 1:
            raise P.ProtocolError("bad_request", f"mode must be one of {', '.join(MODES)} and min_reads >= 1")
        if msg.promote:
            self.metrics.promotions += len(keys)
        req_id, deadline = msg.id, msg.dl

        def work(_frames_kept_alive=frames) -> list:
            # A promotion is copied out of a host pool after the engine's read returned: checked
            stored, refusal = self.transfers.put_pages(ns, keys, sources, parents, deadline, sums,
                                                       checked=msg.promote and any(sums),
                                                       hashed=msg.hash_pages and not any(sums))
            if self.demoter is not None and mode == "back":
                stored = self.demoter.admit_write_back(self.store, ns, keys, stored, min_reads)
            elif self.demoter is not None:
                for key, ok in zip(keys, stored):
                    if ok:
                        self.dirty.add((ns, key), mode, min_reads)
            self.metrics.pages("put", sum(stored), sum(n for n, ok in zip(sources.sizes, stored) if ok))
            fields = {"stored": P.flags(stored)}
            if refusal:
                fields["refusal"] = list(refusal)
                # The operator hears of a full or failing medium here, not only in the engine's log.
                _warn.warning(f"refusal:{refusal[0]}", "tier %s refused %d of %d pages: %s: %s", self.name,
                              len(stored) - sum(stored), len(stored), refusal[0], refusal[1])
            return [P.reply_ok(req_id, **fields)]
        return work

    def handle_get(self, msg: M.Get, frames) -> Callable[[], list]:
        ns = self.context.namespace(msg)
        keys = P.check_keys(msg.keys)
        req_id = msg.id
        if msg.region is not None:
            raise P.ProtocolError("bad_request", "a daemon never writes into a host pool: ask for a lease")
        if msg.lease is None:
            def frame_work() -> list:
                found, out, sums = self.reads.frame_reads(ns, keys, msg.dl)
                self.metrics.pages("get", sum(found), sum(len(f) for f in out))
                return [P.reply_ok(req_id, found=P.flags(found), sums=sums), *out]
            return frame_work
        expiry = P.check_lease_expiry(msg.lease)
        sizes = P.decode_sizes(msg.sizes, len(keys), self.max_page_bytes)
        self._release_done(msg)
        owner, budget = self._lease_owner(msg)
        dir_ns = self.reads.directory_number(ns, self.context.tenant())  # renewed: a number given up is given again
        return lambda: self._lease_reply(req_id, self.reads.lease_reads(ns, keys, sizes, owner, expiry, budget,
                                                                        msg.stream), dir_ns)

    def _release_done(self, msg: M.Request) -> None:
        """Leases of earlier reads the session copied out, released on the way (before any new work)."""
        owner = self._lease_owner(msg)[0] if msg.done else None
        for lease in (msg.done or ())[:P.MAX_DONE_LEASES]:
            self.arena.release(lease, owner)

    def _lease_reply(self, req_id: int, result, dir_ns: int) -> list:
        fields, pages, nbytes = result
        self.metrics.pages("get", pages, nbytes)
        if dir_ns:
            fields["dir_ns"] = dir_ns
        return [P.reply_ok(req_id, arena=self.arena_id, **fields)]

    def handle_touch(self, msg: M.Touch, frames) -> list:
        return [P.reply_ok(msg.id)]  # its pages were counted on the way in (PageReads.count_touched)

    def handle_release(self, msg: M.Release, frames) -> list:
        self.context.namespace(msg)
        return [P.reply_ok(msg.id, released=self.arena.release(msg.lease, self._lease_owner(msg)[0]))]

    def handle_stats(self, msg: M.Stats, frames) -> list:
        own = self.context.namespace(msg)
        if own == ADMIN_NAMESPACE:
            return [P.reply_ok(msg.id, tier=self.name, stats=self.daemon_stats())]
        # Its own namespace's figures only; a configured tenant's from a snapshot (tiers/node/tenant_stats.py),
        # the operator's engines' fresh (they read counters right after their own calls).
        view = self.tenant_stats.view(own, fresh=self.context.tenant() is OPERATOR)
        return [P.reply_ok(msg.id, tier=self.name, stats=view)]
