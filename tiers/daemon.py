"""The tier daemon: a ZeroMQ ROUTER loop in front of one page store.

Majordomo-style: poll, dispatch ``handle_<op>``, housekeeping per tick.
Lookups, stats and deletes run on the loop thread; page transfers run in a
small I/O pool so a long batch never stalls a lookup, and their replies come
back through a wake pipe.  Host-pool memfds arrive on an AF_UNIX socket
(tiers/regions.py).  Every failure becomes an error reply: the loop only ends
when asked to.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

import zmq

from tiers import protocol as P
from tiers import security
from tiers.logs import RateLimitedLog
from tiers.demotion import DemotionLink, DirtySet, should_demote
from tiers.metrics import DaemonMetrics
from tiers.regions import RegionRegistry
from tiers.store import PageStore, StoreError
from tiers.transfers import PageTransfers

log = logging.getLogger("hicache.daemon")
_warn = RateLimitedLog(log)

SESSION_LIMIT = 4096  # oldest idle sessions are forgotten beyond this
ADMIN_NAMESPACE = "_admin"  # the operator CLI's session: may act on every namespace


def private_dir(path: str) -> None:
    """Create path 0700, or tighten it to 0700 when it is ours and open to others (a log line says so)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        log.info("runtime directory %s was mode %o; now 0700 (sockets are for this account only)",
                 path, st.st_mode & 0o777)
        os.chmod(path, 0o700)


class TierDaemon(PageTransfers):
    """Serves one store on one endpoint until stop() is called."""

    def __init__(self, name: str, store: PageStore, endpoint: str, fd_socket: Optional[str] = None,
                 max_page_bytes: int = 64 << 20, io_threads: int = 2, context: Optional[zmq.Context] = None,
                 lower: Optional[DemotionLink] = None, max_dirty_pages: int = 1024):
        self.name = name
        self.store = store
        self.endpoint = endpoint
        self.max_page_bytes = max_page_bytes
        self.metrics = DaemonMetrics(name)
        self._ctx = context or zmq.Context.instance()
        self._router: Optional[zmq.Socket] = None
        self._zap: Optional[security.ZapHandler] = None  # CurveZMQ admission on tcp:// endpoints
        self._regions = RegionRegistry(fd_socket) if fd_socket else None
        if self._regions is not None:  # a store that moves pages by DMA registers each host pool mapping
            self._regions.on_map = getattr(store, "region_mapped", None)
            self._regions.on_unmap = getattr(store, "region_unmapped", None)
        self._sessions: Dict[int, dict] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix=f"{name}-io")
        self._done: deque = deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = threading.Event()
        self._in_flight = 0
        self.ready = threading.Event()
        # Write-back and selective pages go to the next tier down (if there is one).
        self.lower = lower
        self.dirty = DirtySet(max_dirty_pages)
        self._flushing = False
        if lower is not None:
            store.on_evict = self._on_evict

    # ------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Bind sockets (after this, clients can connect; then READY=1).

        ipc:// sockets are created 0600 in a 0700 directory; a tcp:// endpoint
        needs CurveZMQ keys (or allow_insecure_tcp), else ValueError: the
        daemon refuses to start (tiers/security.py).
        """
        if self.endpoint.startswith("ipc://"):
            path = self.endpoint[len("ipc://"):]
            private_dir(os.path.dirname(path))
            if os.path.exists(path):
                os.unlink(path)  # a stale socket from a killed daemon
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_page_bytes + (P.MAX_HEADER_BYTES))
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.SNDHWM, 0)
        try:
            self._zap = security.secure_router(router, self._ctx, self.endpoint, self.name)
            old_umask = os.umask(0o077)  # no moment where the socket file is open to others
            try:
                router.bind(self.endpoint)
            finally:
                os.umask(old_umask)
        except BaseException:
            router.close(linger=0)
            if self._zap is not None:
                self._zap.close()
                self._zap = None
            raise
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        self._router = router
        if self._regions is not None:
            self._regions.bind()
        self.ready.set()

    def stop(self) -> None:
        """Ask the loop to finish in-flight work and return."""
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def serve_forever(self, tick: float = 0.5, on_tick: Optional[Callable[[], None]] = None) -> None:
        if self._router is None:
            self.bind()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._regions is not None:
            self._regions.register(poller)
        zap = self._zap.sockets() if self._zap is not None else []
        for sock in zap:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stopping.is_set() or self._in_flight:
                events = dict(poller.poll(int(tick * 1000)))
                if zap and any(sock in events for sock in zap):
                    self._zap.handle()
                    self._zap.handle_monitor()
                if self._wake_r in events:
                    self._drain_wake()
                self._send_done()
                if self._router in events and not self._stopping.is_set():
                    for _ in range(64):  # bounded burst, then look at the rest
                        try:
                            frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._dispatch(frames)
                if self._regions is not None:
                    self._regions.handle_events(events, poller)
                self._housekeeping()
                if on_tick:
                    on_tick()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._close_transfers()
        self._send_done()
        if self.lower is not None:
            self._flush(everything=True)
            self.lower.close()
        if self._regions is not None:
            self._regions.close()
        if self._router is not None:
            self._router.close(linger=1000)  # let the last replies of a graceful stop out
        if self._zap is not None:
            self._zap.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
        self.store.close()

    # ------------------------------------------------------------- dispatch
    def _dispatch(self, frames: List[zmq.Frame]) -> None:
        ident = frames[0].bytes
        req_id = 0
        started = time.perf_counter()
        op = "invalid"
        try:
            if len(frames) < 2:
                raise P.ProtocolError("bad_request", "empty message")
            header = P.unpack(frames[1].buffer)
            req_id = header.get("id", 0) if isinstance(header.get("id", 0), int) else 0
            op, req_id = P.check_request(header)
            header["id"] = req_id  # optional on the wire (0); handlers echo header["id"]
            handler = getattr(self, f"handle_{op}", None)
            if handler is None:  # a pool operation sent to a tier daemon, or the reverse
                raise P.ProtocolError("unknown_op", f"{self.name} does not serve {op}")
            result = handler(header, frames[2:])
            if isinstance(result, Future):
                self._in_flight += 1
                result.add_done_callback(lambda fut, i=ident, r=req_id, o=op, t=started: self._finish(fut, i, r, o, t))
                return
            reply = result
        except P.ProtocolError as exc:
            self.metrics.error(exc.code)
            reply = [P.reply_error(req_id, exc.code, exc.msg)]
        except StoreError as exc:
            self.metrics.error(exc.code)
            reply = [P.reply_error(req_id, exc.code, str(exc))]
        except Exception as exc:  # a bug must not end the daemon
            log.exception("internal error serving %s", op)
            self.metrics.error("internal")
            reply = [P.reply_error(req_id, "internal", f"{type(exc).__name__}: {exc}")]
        self.metrics.observe(op, time.perf_counter() - started)
        self._router.send_multipart([ident, *reply], copy=False)

    def _finish(self, fut: Future, ident: bytes, req_id: int, op: str, started: float) -> None:
        try:
            reply = fut.result()
        except StoreError as exc:
            self.metrics.error(exc.code)
            reply = [P.reply_error(req_id, exc.code, str(exc))]
        except Exception as exc:
            log.exception("internal error in %s", op)
            self.metrics.error("internal")
            reply = [P.reply_error(req_id, "internal", f"{type(exc).__name__}: {exc}")]
        self.metrics.observe(op, time.perf_counter() - started)
        self._done.append((ident, reply))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _send_done(self) -> None:
        while self._done:
            ident, reply = self._done.popleft()
            self._in_flight -= 1
            self._router.send_multipart([ident, *reply], copy=False)

    # ------------------------------------------------------------ demotion
    def _on_evict(self, key, views, reads: int) -> None:
        """Called by the store before an evicted page's memory is reused."""
        pending = self.dirty.pop(key)
        if pending is not None and should_demote(pending[0], pending[1], reads):
            self.lower.push(key, views)

    def _housekeeping(self) -> None:
        if self.lower is not None and not self._flushing and self.dirty.oldest_over_limit():
            self._flushing = True
            self._pool.submit(self._flush_over_limit)

    def _flush_over_limit(self) -> None:
        try:
            self._flush(everything=False)
        finally:
            self._flushing = False

    def _flush(self, everything: bool) -> int:
        """Demote dirty pages: those over the bound, or (at shutdown) every eligible one."""
        if everything:
            keys = self.dirty.snapshot()
        else:
            keys = [(k, "back", 0) for k in self.dirty.oldest_over_limit()]
        done = 0
        for key, mode, min_reads in keys:
            if not should_demote(mode, min_reads, self.store.read_count(key)):
                continue
            data = self.store.peek(key)
            if data is not None and self.lower.push(key, [memoryview(data)]):
                self.dirty.pop(key)
                done += 1
        if everything and keys:
            log.info("flushed %d of %d dirty pages to %s", done, len(keys), self.lower.name)
        return done

    # ------------------------------------------------------------- sessions
    def _namespace(self, header: dict) -> str:
        sid = header.get("s")
        # Any msgpack value may arrive here: only an integer can name a session (a list is unhashable).
        session = self._sessions.get(sid) if isinstance(sid, int) and not isinstance(sid, bool) else None
        if session is None:
            raise P.ProtocolError("no_session", "unknown session; send hello again")
        session["seen"] = time.monotonic()
        return session["ns"]

    def handle_hello(self, header: dict, frames) -> list:
        ns = P.check_namespace(P.field(header, "ns", str))
        client = str(P.field(header, "client", str, required=False, default=""))[:200]
        if len(self._sessions) >= SESSION_LIMIT:
            oldest = min(self._sessions, key=lambda s: self._sessions[s]["seen"])
            del self._sessions[oldest]
        session = secrets.randbits(62)
        self._sessions[session] = {"ns": ns, "client": client, "seen": time.monotonic()}
        log.info("hello from %s for namespace %s", client or "?", ns)
        return [P.reply_ok(header["id"], session=session, tier=self.name, max_page_bytes=self.max_page_bytes,
                           max_batch=P.MAX_BATCH, fd_socket=self._regions.path if self._regions is not None else "")]

    # ----------------------------------------------------------- operations
    def handle_lookup(self, header: dict, frames) -> list:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        held = self.store.held(ns, keys)
        prefix = P.leading_run(held)
        self.metrics.lookup(len(keys), prefix)
        return [P.reply_ok(header["id"], held=held, prefix=prefix)]

    def handle_delete(self, header: dict, frames) -> list:
        ns = self._namespace(header)
        keys = P.keys_field(header)
        for key in keys:
            self.dirty.pop((ns, key))
        return [P.reply_ok(header["id"], deleted=self.store.delete([(ns, k) for k in keys]))]

    def _target_namespace(self, header: dict, own: str) -> Optional[str]:
        """The namespace an admin operation acts on (None: every namespace)."""
        everything = P.field(header, "all", bool, required=False, default=False)
        target = header.get("ns")
        if target is not None:
            target = P.check_namespace(target)
        if (everything or (target is not None and target != own)) and own != ADMIN_NAMESPACE:
            raise P.ProtocolError("bad_request", "acting on other namespaces needs an _admin session")
        return None if everything else (target or own)

    def handle_clear(self, header: dict, frames) -> list:
        own = self._namespace(header)
        namespace = self._target_namespace(header, own)
        self.dirty.discard_namespace(namespace)
        return [P.reply_ok(header["id"], cleared=self.store.clear(namespace))]

    def handle_evict(self, header: dict, frames) -> list:
        own = self._namespace(header)
        nbytes = P.field(header, "bytes", int)
        if nbytes < 0:
            raise P.ProtocolError("bad_request", "bytes must not be negative")
        namespace = self._target_namespace(header, own)
        if own == ADMIN_NAMESPACE and header.get("ns") is None:
            namespace = None  # the operator evicts across every namespace by default
        pages, freed = self.store.evict(nbytes, namespace)
        return [P.reply_ok(header["id"], evicted_pages=pages, evicted_bytes=freed)]

    def handle_stats(self, header: dict, frames) -> list:
        self._namespace(header)
        return [P.reply_ok(header["id"], tier=self.name, stats=self.stats())]

    def stats(self) -> dict:
        """Store counters, request metrics and daemon state (the stats reply; read by the Prometheus exporter)."""
        stats = self.store.stats().as_dict()
        stats.update(self.metrics.snapshot())
        stats["sessions"] = len(self._sessions)
        stats["dirty_pages"] = len(self.dirty)
        stats["demotions"] = self.lower.demoted if self.lower else 0
        stats["demotion_failures"] = self.lower.failed if self.lower else 0
        stats["lower_tier"] = self.lower.name if self.lower else ""
        stats["regions"] = len(self._regions) if self._regions is not None else 0
        return stats
