"""The tier daemon: a ZeroMQ ROUTER loop in front of one page store.

Majordomo-style: poll, decode each request into its Struct (tiers/wire/messages.py), dispatch it
to the handler its type names (``handlers``: the page operations in tiers/node/page_ops.py, deletes
and clears in tiers/node/admin_ops.py), housekeeping per tick.
Each handler's route says where its work runs (tiers/node/routes.py): lookups, stats,
releases and leased DRAM reads on the loop thread; page transfers in a small I/O pool
(tiers/node/transfers.py, reads.py) so a long batch never stalls a lookup, their replies
coming back through a wake pipe.  Engines
attach over AF_UNIX (tiers/node/regions.py).  Pages evicted dirty go down through
a bounded queue with a thread of its own (tiers/node/demotion.py).  Every failure
becomes an error reply: the loop only ends when asked to.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import zmq

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire import held_wait, security
from tiers.shm.arena import BlockArena
from tiers.node.admin_ops import StoreAdmin
from tiers.node.demotion import Demoter
from tiers.node.dirty import DirtySet
from tiers.node.endpoint import bind_router, physical_memory
from tiers.node.faults import CorruptReads
from tiers.node.connections import ConnectionGuard
from tiers.node.memory_guard import MemoryGuard
from tiers.node.tenant_stats import TenantStats
from tiers.node.fds import open_fds, raise_fd_limit
from tiers.node.metrics import DaemonMetrics
from tiers.node.tenants import Tenant, TenantTable
from tiers.node.peers import PeerReplies
from tiers.node.regions import RegionRegistry
from tiers.node.replies import Replies
from tiers.node.routes import Route, Where, answered_early, in_pool
from tiers.node.page_ops import PageOps, RequestContext
from tiers.node.streamed_reads import StreamedReads
from tiers.node.sessions import Sessions
from tiers.stores.base import PageStore
from tiers.node.reads import PageReads
from tiers.node.transfers import PageTransfers

# Requests whose work runs in the I/O pool where the store touches a disk (parallel_io): each counts as its
# peer's work in flight (tiers/node/peers.py).
_POOL_WORK = (M.Put, M.Clear, M.Delete, M.Evict)

log = logging.getLogger("hicache.daemon")

HWM = 64  # messages queued per peer each way; a client that never reads its replies loses the later ones
DEMOTION_OWNER = -1  # arena lease owner for pages on their way down
# Flags as plain ints: pyzmq's enum arithmetic costs ~1-2 us an operation, a tenth of a lookup's own work.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class TierDaemon:
    """Serves one store on one endpoint until stop() is called."""

    def __init__(self, name: str, store: PageStore, endpoint: str, fd_socket: Optional[str] = None,
                 max_page_bytes: int = 64 << 20, io_threads: int = 2, context: Optional[zmq.Context] = None,
                 demoter: Optional[Demoter] = None,
                 staging_bytes: int = 2 << 30, max_region_bytes: int = 0, max_inflight_bytes: int = 2 << 30,
                 curve: Optional[security.CurveSettings] = None, corrupt_reads: Optional[CorruptReads] = None,
                 tenants: Optional[TenantTable] = None, socket_gid: Optional[int] = None,
                 connection_idle_s: float = 60.0):
        self.name = name
        self.connection_idle_s = connection_idle_s
        self.curve = curve or security.CurveSettings()  # a tcp:// endpoint needs keys (or allow_insecure_tcp)
        self.store = store
        self.endpoint = endpoint
        self.max_page_bytes = max_page_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.metrics = DaemonMetrics(name)
        self._ctx = context or zmq.Context.instance()
        self._router: Optional[zmq.Socket] = None
        self._zap: Optional[security.Admission] = None  # CurveZMQ admission on tcp:// endpoints
        self._guard: Optional[ConnectionGuard] = None  # connections a tenant keeps
        self._memory: Optional[MemoryGuard] = None  # its bound on what peers' unfinished messages hold
        self.fd_limit = raise_fd_limit()  # before any socket: libzmq aborts on EMFILE (tiers/node/fds.py)
        # Staging is prefaulted in the background: a first touch costs ~10x a warm copy, and every
        # NVMe or remote page passes through it.
        self.arena = store.export_arena() or BlockArena(max(staging_bytes, 64 << 10), 64 << 10, f"{name}-staging",
                                                        prefault=staging_bytes >= 64 << 20, background=True)
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-io")
        self.transfers = PageTransfers(name, store, self.arena, self._pool, io_threads, max_page_bytes)  # puts
        # Engines read hits through the store's page directory without asking (tiers/shm/directory.py);
        # not while the damaging test hook is on: its damage is done to the pages this daemon serves.
        self.directory = store.export_directory() if fd_socket and corrupt_reads is None else None
        streamed = StreamedReads(store, self.arena, self._pool.submit, lambda n, b: self.metrics.pages("get", n, b),
                                 corrupt_reads, lambda seconds: self.metrics.observe("get", seconds))
        self.reads = PageReads(store, self.arena, self.transfers.each, streamed, corrupt_reads=corrupt_reads,
                               directory=self.directory)  # gets; corrupt_reads: a test hook (tiers/node/faults.py)
        if self.transfers.stages:
            store.region_mapped(self.arena.view)  # the remote tier sends from and lands into staging
        self.arena_id = secrets.randbits(62)
        # Write-back and selective pages go to the next tier down (if there is one), through a queue;
        # the demoter is the store's EvictionListener too (tiers/ops/tier_factory.py).
        self.demoter = demoter
        self.dirty = demoter.dirty if demoter is not None else DirtySet(0)  # stays empty without a tier below
        self.admin = StoreAdmin(store, self.dirty, self._namespace)  # deletes, clears, evictions
        self.tenants = tenants or TenantTable()  # who may open sessions on which namespaces
        self.sessions = Sessions(self.tenants, endpoint.startswith("ipc://"), curve is not None and curve.enabled)
        self._peer_replies = PeerReplies(max_inflight_bytes)  # what each peer leaves unread (tiers/node/peers.py)
        self._peer_tenant: Optional[Tenant] = None  # the tenant of the request being dispatched
        self._tenant_stats = TenantStats(store, self.stats)  # what tenants' stats requests show
        self.socket_gid = socket_gid
        self._regions = RegionRegistry(fd_socket, self.arena.export_fd, self.arena_id, self.arena.size,
                                       self.sessions.tenant, max_region_bytes or physical_memory(), self.tenants,
                                       socket_gid, self.directory) if fd_socket else None
        if self._regions is not None:
            # A store that sends pages straight out of a host pool (PageStore.sends_from: the remote tier, which
            # registers it with its engine on first use) forgets it before it is unmapped.
            self._regions.on_unmap = store.region_unmapped
        self._replies = Replies(self.metrics, self._peer_replies, held_wait.shared())  # tiers/node/replies.py
        # hello, lookups, puts, gets, releases, touches and stats (tiers/node/page_ops.py), for the request the loop
        # is dispatching.
        self.pages = PageOps(name, store, self.arena, self.arena_id, self.transfers, self.reads, self.sessions,
                             self.metrics, self.dirty, demoter, self._regions, max_page_bytes,
                             RequestContext(self._namespace, lambda: self._peer_tenant), self._tenant_stats,
                             self.stats)
        # The operations this daemon serves, by request type (a pool daemon adds its own), and where each
        # one's work runs (tiers/node/routes.py).
        pages = self.pages
        self.handlers: Dict[type, Route] = {
            M.Hello: Route(pages.handle_hello, Where.LOOP), M.Lookup: Route(pages.handle_lookup, Where.LOOP),
            M.Put: Route(pages.handle_put, Where.POOL), M.Get: Route(pages.handle_get, Where.READ),
            M.Release: Route(pages.handle_release, Where.LOOP), M.Stats: Route(pages.handle_stats, Where.LOOP),
            M.Touch: Route(pages.handle_touch, Where.LOOP),
            M.Delete: Route(self.admin.handle_delete, Where.STORE_IO),
            M.Clear: Route(self.admin.handle_clear, Where.STORE_IO),
            M.Evict: Route(self.admin.handle_evict, Where.STORE_IO)}
        self._stopping = threading.Event()
        self.ready = threading.Event()

    # ------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Bind sockets (after this, clients can connect; then READY=1).

        ipc:// sockets are created 0600 in a 0700 directory; a tcp:// endpoint
        needs CurveZMQ keys (or allow_insecure_tcp), else ValueError: the
        daemon refuses to start (tiers/wire/security.py).
        """
        router, self._zap = bind_router(self._ctx, self.endpoint, self.name, self.curve,
                                        self.max_page_bytes + P.MAX_HEADER_BYTES, HWM, self.socket_gid)
        self._router = self._replies.router = router
        # Each tenant's share of the descriptors, and on tcp:// the unidentified connections' (tiers/node/connections.py).
        self._guard = ConnectionGuard(router, self.endpoint, self.tenants, self.fd_limit, self.name,
                                      self.connection_idle_s, self.sessions.tenant_of,
                                      self._zap.handshake_failed if self._zap is not None else None)
        # What libzmq holds for messages peers never finish (tiers/node/memory_guard.py).
        self._memory = MemoryGuard(self.name, self.max_inflight_bytes, self.store.index_bytes, self._replies.wake)
        self._memory.start()
        if self._regions is not None:
            self._regions.bind()
        self.ready.set()

    def stop(self) -> None:
        """Ask the loop to finish in-flight work and return."""
        self._stopping.set()
        self._replies.wake()

    def serve_forever(self, tick: float = 0.5, on_tick: Optional[Callable[[], None]] = None) -> None:
        if self._router is None:
            self.bind()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies.wake_fd, zmq.POLLIN)
        if self._regions is not None:
            self._regions.register(poller)
        guard_monitor = self._guard.monitor if self._guard is not None else None
        if guard_monitor is not None:
            poller.register(guard_monitor, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stopping.is_set() or self._replies.in_flight:
                events = dict(poller.poll(int(tick * 1000)))
                if self._replies.wake_fd in events:
                    self._replies.drain_wake()
                    if self._memory is not None and self._memory.over:
                        self._memory.shed_with(self._guard.shut_silent)
                self._replies.send_done()
                if self._router in events and not self._stopping.is_set():
                    for _ in range(64):  # bounded burst, then look at the rest
                        try:
                            request = self._receive()
                        except zmq.Again:
                            break
                        self._dispatch(*request)
                        # Asking is cheaper than the exception an empty queue raises (most bursts are one call).
                        if not self._router.get(zmq.EVENTS) & _POLLIN:
                            break
                # After the requests: a first request read before its connection's accept event is placed
                # by it, not pushed out by a flood's accepts queued behind it (tiers/node/connections.py).
                if guard_monitor is not None and guard_monitor in events:
                    self._guard.handle_monitor()
                if self._regions is not None:
                    self._regions.handle_events(events, poller)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + tick
                    self._housekeeping(poller)
                    if on_tick:
                        on_tick()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.transfers.close()
        self._replies.send_done()
        if self.demoter is not None:
            self.demoter.close(self.store)
        if self._regions is not None:
            self._regions.close()
        if self._guard is not None:
            self._guard.close()
        if self._memory is not None:
            self._memory.close()
        if self._router is not None:
            self._router.close(linger=1000)  # let the last replies of a graceful stop out
        if self._zap is not None:
            self._zap.close()
        self._replies.close()
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
        self.store.close()

    # ------------------------------------------------------------- dispatch
    def _receive(self) -> Tuple[zmq.Frame, Optional[bytes], List[zmq.Frame]]:
        """The next request (zmq.Again when none): the peer's routing frame (its metadata says who the peer
        is), the header (bytes; None when the message had none) and the payload frames, uncopied."""
        router = self._router
        peer = router.recv(_NOBLOCK, copy=False)
        if not router.get(zmq.RCVMORE):
            return peer, None, []
        header = router.recv(_NOBLOCK)
        payload = []
        while router.get(zmq.RCVMORE):
            payload.append(router.recv(_NOBLOCK, copy=False))
        return peer, header, payload

    def _dispatch(self, peer: zmq.Frame, raw_header: Optional[bytes], frames: List[zmq.Frame]) -> None:
        ident = peer.bytes
        req_id = 0
        started = time.perf_counter()
        # The connection is in use: not one to shut for a newcomer (False: a tcp connection's first request,
        # past its tenant's share; it was shut, and the request is not served).
        if self._guard is not None and not self._guard.active(peer.get(zmq.SRCFD), started, peer):
            return
        op = "invalid"
        nbytes = 0
        try:
            if raw_header is None:
                raise P.ProtocolError("bad_request", "empty message")
            msg = M.decode_request(raw_header)
            op, req_id = type(msg).__struct_config__.tag, msg.id
            nbytes = sum(len(f) for f in frames) if frames else 0
            if nbytes and self._replies.inflight_bytes + nbytes > self.max_inflight_bytes:
                nbytes = 0
                raise P.ProtocolError("busy", f"over {self.max_inflight_bytes} bytes in flight; try again")
            self._peer_tenant = self.sessions.tenant_of(peer)  # read by _namespace: a session is its own tenant's only
            # Pages that come back as frames, and puts and disk work of clear/delete/evict in the I/O pool:
            # bounded a peer (tiers/node/peers.py), so a peer that sends without waiting queues nothing unbounded.
            counted = ((type(msg) is M.Get and msg.lease is None)
                       or (type(msg) in _POOL_WORK and self.store.parallel_io))
            if counted:
                self._peer_replies.admit(ident)
            route = self.handlers.get(type(msg))
            if route is None:  # a pool operation sent to a tier daemon
                raise P.ProtocolError("unknown_op", f"{self.name} does not serve {op}")
            if msg.touched is not None:  # reads through the page directory, counted before this request
                self.metrics.pages("get", *self.reads.count_touched(self._namespace(msg), msg.touched,
                                                                    msg.touched_sizes, self.max_page_bytes))
            result = route.handler(msg, frames)  # checks the request here, on the loop
            if route.where is Where.LOOP:
                reply = result
            elif in_pool(route.where, msg, self.store.parallel_io, self.reads.stages, self.reads.streamed.enabled):
                # Its reply leaves when the pool has done the work (tiers/node/replies.py).
                self._replies.later(self._pool.submit(result), ident, req_id, op, started, nbytes, counted)
                return
            else:
                reply = result()
        except Exception as exc:
            reply = self._replies.error(req_id, op, exc)
        else:
            if answered_early(msg, self.reads.streamed.enabled):
                self._replies.send(ident, reply)  # timed when its reads end (tiers/node/streamed_reads.py)
                return
        self.metrics.observe(op, time.perf_counter() - started)
        self._replies.send(ident, reply)

    def _housekeeping(self, poller) -> None:
        self.arena.expire()
        self._peer_replies.prune()
        self.store.prune()
        self.sessions.expire(time.monotonic())
        if self._regions is not None:
            self._regions.tick(poller)

    # ------------------------------------------------------------- sessions
    def _namespace(self, msg: M.Request, write: bool = False) -> str:
        """The namespace of the request's session; write: a request that changes it (puts, deletes, clears)."""
        return self.sessions.get(msg.s, self._peer_tenant, write).ns

    def stats(self) -> dict:
        """Store counters, request metrics and daemon state (the stats reply; read by the Prometheus exporter)."""
        snap = self.store.stats()
        stats = snap.as_dict()
        stats.update(self.metrics.snapshot())
        stats["sessions"] = self.sessions.clients()
        stats["dirty_pages"] = len(self.dirty)
        stats.update(self.demoter.stats() if self.demoter is not None else Demoter.idle_stats())
        stats["regions"] = len(self._regions) if self._regions is not None else 0
        stats["attach_refused"] = self._regions.refused if self._regions is not None else 0
        stats["attach_expired"] = self._regions.expired if self._regions is not None else 0
        stats["leases"] = self.arena.lease_count()
        # 1 once the daemon's arena and the store's own (a pool's) are faulted in: copies run at full speed
        stats["arena_prefaulted"] = float(self.arena.prefaulted.is_set() and stats.get("store_prefaulted", 1.0) == 1.0)
        stats["leases_expired"] = self.arena.leases_expired
        stats["staging_full"] = self.transfers.staging_full + self.reads.staging_full
        stats["streamed_reads"] = self.reads.streamed.reads
        stats["streamed_bytes_in_flight"] = self.reads.streamed.in_flight_bytes()
        stats["source_gone"] = self.transfers.source_gone
        stats["sum_refused"] = self.transfers.sum_refused
        stats["in_place_puts"] = self.transfers.in_place_puts
        stats["region_puts"] = self.transfers.region_puts
        stats["replies_unread_bytes"] = self._peer_replies.unread_bytes()  # pages libzmq holds for peers
        stats["open_fds"] = open_fds()
        stats["fd_limit"] = self.fd_limit
        stats.update(self._guard.stats() if self._guard is not None else ConnectionGuard.idle_stats())
        stats["connections_shed_for_memory"] = self._memory.shed if self._memory is not None else 0
        return stats
