"""ZeroMQ connections to a daemon's endpoint: at most a share of its descriptors for each tenant.

libzmq accepts every connection and aborts the whole process when its ipc
listener runs out of descriptors (tiers/node/fds.py); it has no way to refuse
one.  So the daemon watches its ROUTER's monitor: each accepted connection is
a descriptor whose peer the kernel names (SO_PEERCRED).  A connection of a
configured tenant past its share, of accounts in no tenant past a few (kept
so that their hellos are told ``forbidden``), or past the
node's whole budget (the descriptor limit less a headroom) is shut down at once
through a duplicate of its descriptor: libzmq then reads end-of-file and closes
it as if the peer had left.  The operator's connections count against the
whole budget only.  A shut connection costs its owner a reconnection; the
victims' connections, accepted before, are never touched while they are in use.

Unless they sit idle: before a newcomer is shut, the connection of the same
share (its tenant's, the strangers', or for the node's budget any but the
operator's) that has sent nothing for longest gives way to it, once that is
``idle_s`` or more.  Connections an engine leaked (a client opened a request
and never closed) would otherwise hold their tenant's share for good, and
that tenant's live engines could not connect.  The daemon tells the guard of
each request's connection (``active``: ZMQ_SRCFD of its routing frame).

On a tcp:// endpoint anyone who can reach the port opens connections, and
nobody is known until CurveZMQ admitted a key and a first request came: a
flood of connections that never finish a handshake filled every descriptor
and the node's engines could not connect (a daemon with a limit of 100: its
client got "not connected" until the flood ended).  So a tcp connection is
*unidentified* until its first request names its tenant (the key's, through
``tenant_of``), and unidentified connections together hold a quarter of the
budget: a newcomer past it shuts the oldest of them whose peer sent no more
than a handshake's opening (what anyone may send without a key; the kernel
counts a connection's bytes received) or that waited GRACE_S.  A client that
got through CurveZMQ, whose request may be on its way, is not pushed out by a
flood.  When none of the oldest stalled, the newcomer goes (a client's
connection reconnects by itself, its request still queued).  libzmq drops a
handshake not done within HANDSHAKE_S (tiers/node/endpoint.py).  Once
identified, a connection counts against its tenant's share as on ipc.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from itertools import islice
from typing import Callable, Dict, Optional

import zmq

from tiers.logs import RateLimitedLog
from tiers.node.tenants import OPERATOR, Tenant, TenantTable

log = logging.getLogger("hicache.connections")
_warn = RateLimitedLog(log)

# libzmq's monitor message: a frame of the event (16 bits) and its value (32 bits, a descriptor for the events
# read here), then one of the endpoint.
_MONITOR_FRAME = struct.Struct("=Hi")


def _recv_monitor_event(monitor: zmq.Socket) -> Optional[dict]:
    """The next monitor event, {"event", "value", "endpoint"} (zmq.Again when none, None for a message not
    in libzmq's form): what pyzmq's recv_monitor_message returns, without the asyncio its module imports
    (24 ms of every daemon's start)."""
    frames = monitor.recv_multipart(zmq.NOBLOCK)
    if len(frames) != 2 or len(frames[0]) != _MONITOR_FRAME.size:
        return None
    event, value = _MONITOR_FRAME.unpack(frames[0])
    return {"event": event, "value": value, "endpoint": frames[1]}


HEADROOM_SHARE = 8  # 1/8 of the descriptor limit (at least MIN_HEADROOM) stays for files, attaches, staging
MIN_HEADROOM = 64
TENANT_SHARE = 4  # a configured tenant holds at most 1/4 of the connection budget
STRANGER_CONNECTIONS = 16  # accounts in no tenant, together: enough to be told so (a hello gets forbidden)
_STRANGERS = ""  # their name in the count (no tenant has an empty name)
_UNIDENTIFIED = "\0unidentified"  # tcp connections before their first request (tenant names are text)
# What a peer may send on a tcp connection before CurveZMQ can have admitted it: the ZMTP greeting (64 bytes)
# and a HELLO command (200); a client past ZAP has sent its INITIATE (~250 more) and then its request.
STALLED_BYTES = 300
STALLED_SCAN = 16  # unidentified connections looked at, oldest first, for one that stalled
# An unidentified connection this old goes whatever it sent (a client's handshake and hello take milliseconds).
GRACE_S = 1.0
_TCP_INFO_BYTES = 136  # struct tcp_info up to tcpi_bytes_received (Linux 4.1 on)
_BYTES_AT = 128
_BYTES_RECEIVED = struct.Struct("<Q")
MONITOR_BATCH = 256  # monitor events read a turn of the loop: the requests queued meanwhile are read between
REFUSED_IDS = 4096  # routing ids of connections refused at a request, remembered (the oldest forgotten)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# Handshakes that failed before ZAP was asked (a client without CurveZMQ keys, or with the wrong server key):
# one monitor a socket, so this one also tells tiers/wire/security.py's Admission of them.
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def connection_budget(fd_limit: int) -> int:
    """Connections the daemon keeps at most, of every tenant together."""
    return max(1, fd_limit - max(MIN_HEADROOM, fd_limit // HEADROOM_SHARE))


class ConnectionGuard:
    """Counts accepted connections by tenant and shuts those past their share (called on the loop thread)."""

    def __init__(self, router: zmq.Socket, endpoint: str, tenants: TenantTable, fd_limit: int, name: str,
                 idle_s: float = 60.0, tenant_of: Optional[Callable[[zmq.Frame], Optional[Tenant]]] = None,
                 handshake_failed: Optional[Callable[[dict], None]] = None):
        """endpoint: the router's (ipc:// or tcp://, bound); tenant_of: a tcp request's tenant from its routing
        frame (Sessions.tenant); handshake_failed: told of each failed CurveZMQ handshake (Admission)."""
        self.name = name
        self.idle_s = idle_s
        self.budget = connection_budget(fd_limit)
        self.tenant_budget = max(1, self.budget // TENANT_SHARE)
        self._tcp = endpoint.startswith("tcp://")
        self._path = None if self._tcp else endpoint[len("ipc://"):]
        # A tcp descriptor is ours when its local port is the one bound (the router's last endpoint: port 0
        # or a wildcard resolved).
        self._port = int(router.get(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]) if self._tcp else 0
        self._tenant_of = tenant_of
        self._handshake_failed = handshake_failed
        self._tenants = tenants
        self._owner: Dict[int, str] = {}  # descriptor -> tenant name, for connections kept
        # Each tenant's kept connections, least recently in use first (descriptor -> when it last carried a
        # request, perf_counter): its count, and its longest-idle connection at once, whatever the share's size.
        self._by_tenant: Dict[str, "OrderedDict[int, float]"] = {}
        self._early: set = set()  # descriptors placed by their first request before their accept event
        # Routing ids of connections refused at a request: what they queued before libzmq closes them is not
        # served (an id is never reused while the socket lives; a descriptor number is, at once).
        self._refused_ids: "OrderedDict[bytes, None]" = OrderedDict()
        self.refused = 0
        self.reclaimed = 0
        self.monitor: Optional[zmq.Socket] = router.get_monitor_socket(
            _EVENTS | (HANDSHAKE_FAILED if handshake_failed is not None else 0))

    def stats(self) -> Dict[str, int]:
        """The daemon's connection figures (unidentified: tcp connections that have sent no request yet)."""
        return {"connections": len(self._owner), "connections_refused": self.refused,
                "connections_reclaimed": self.reclaimed, "connections_unidentified": self._held(_UNIDENTIFIED)}

    @staticmethod
    def idle_stats() -> Dict[str, int]:
        """The same figures before the daemon bound its endpoint."""
        return {"connections": 0, "connections_refused": 0, "connections_reclaimed": 0,
                "connections_unidentified": 0}

    def handle_monitor(self) -> None:
        for _ in range(MONITOR_BATCH):
            if self.monitor is None:
                return
            try:
                event = _recv_monitor_event(self.monitor)
            except zmq.Again:
                return
            if event is None:
                continue
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                if fd in self._early:  # its first request came before this event and placed it
                    self._early.discard(fd)
                    continue
                self._forget(fd)  # its earlier owner left and the number was reused before we heard
                self._accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._early.discard(fd)
                self._forget(fd)
            elif self._handshake_failed is not None:
                self._handshake_failed(event)

    def active(self, fd: int, now: float, peer: Optional[zmq.Frame] = None) -> bool:
        """A request came over connection fd, from the routing frame peer (kept ones only: a number we do not
        hold is left alone).  False: the connection is past its share (checked at its first request on tcp, or
        when that came before its accept event), now or at an earlier request of it; the request is not to be
        served."""
        name = self._owner.get(fd)
        if name is None:
            # A first request read before its connection's accept event (the loop reads requests first): the
            # connection is placed now, as its accept would have placed it (so none past its share is served,
            # and on tcp a flood's accepts queued behind it cannot push it out as the oldest unidentified).
            if peer is not None and peer.bytes in self._refused_ids:
                return False  # refused: what it queued before libzmq closes it is not served
            if self._tcp:
                conn = self._duplicate(fd)
                if conn is None:
                    return True  # not one of our connections by now: left alone
                conn.close()
                self._owner[fd] = _UNIDENTIFIED
                self._by_tenant.setdefault(_UNIDENTIFIED, OrderedDict())[fd] = now
                kept: Optional[bool] = self._identified(fd, now, peer)
            else:
                kept = self._accepted(fd)
                if kept is None:
                    return True  # not one of our connections by now: left alone
                if not kept:
                    self._refused_id(peer)
            if kept:
                self._early.add(fd)
            return bool(kept)
        if name == _UNIDENTIFIED:
            return self._identified(fd, now, peer)
        order = self._by_tenant[name]
        order[fd] = now
        order.move_to_end(fd)
        return True

    def _refused_id(self, peer: Optional[zmq.Frame]) -> None:
        if peer is not None:
            self._refused_ids[peer.bytes] = None
            if len(self._refused_ids) > REFUSED_IDS:
                self._refused_ids.popitem(last=False)

    def _identified(self, fd: int, now: float, peer: Optional[zmq.Frame]) -> bool:
        """A tcp connection's first request: it moves to its tenant's share, or is shut past it."""
        self._forget(fd)
        tenant = self._tenant_of(peer) if self._tenant_of is not None and peer is not None else None
        why = self._refusal(tenant)
        if why and self._reclaim(tenant, why):
            why = ""
        if why:
            self._refuse(fd, "a tcp client", why)
            self._refused_id(peer)
            return False
        self._keep(fd, tenant, now)
        return True

    def _held(self, name: str) -> int:
        return len(self._by_tenant.get(name, ()))

    def _forget(self, fd: int) -> None:
        name = self._owner.pop(fd, None)
        if name is not None:
            order = self._by_tenant[name]
            del order[fd]
            if not order:
                del self._by_tenant[name]

    def _duplicate(self, fd: int) -> Optional[socket.socket]:
        """A duplicate of fd while it is still a connection to our ipc socket (None: libzmq closed it, and the
        number may name another descriptor of ours by now); the caller closes it."""
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            if self._tcp:
                if (conn.family in (socket.AF_INET, socket.AF_INET6) and conn.getsockname()[1] == self._port
                        and not conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    return conn
            elif conn.family == socket.AF_UNIX and conn.getsockname() == self._path:
                return conn
        except OSError:
            pass
        conn.close()
        return None

    def _accepted(self, fd: int) -> Optional[bool]:
        """Count a connection just accepted: True kept, False shut, None no longer ours (nothing counted)."""
        conn = self._duplicate(fd)
        if conn is None:
            return None  # the connection left meanwhile: nothing to count
        try:
            if self._tcp:
                return self._accepted_tcp(fd)
            uid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
            tenant = self._tenants.of_uid(uid)
            why = self._refusal(tenant)
            if why and self._reclaim(tenant, why):
                why = ""
            if why:
                self._refuse(fd, f"uid {uid}", why)
                return False
            self._keep(fd, tenant, time.perf_counter())
            return True
        except OSError:
            return None
        finally:
            conn.close()  # the duplicate only; libzmq keeps its own

    def _accepted_tcp(self, fd: int) -> bool:
        """Unidentified until its first request.  Past their share (or the node's budget) the oldest one that
        stalled (``_stalled``) goes; when none of the oldest has, the newcomer goes instead (a client's
        connection reconnects by itself, its request still queued)."""
        now = time.perf_counter()
        share = max(1, self.budget // TENANT_SHARE)
        if self._held(_UNIDENTIFIED) >= share or len(self._owner) >= self.budget:
            victim = self._stalled(now)
            if victim is not None:
                self._refuse(victim, "a tcp client", f"{share} connections at most may wait for their first "
                                                     "request (the oldest that stalled in its handshake goes)")
                self._forget(victim)
            elif self._held(_UNIDENTIFIED) or not self._reclaim(None, "the node's budget", node=True):
                self._refuse(fd, "a tcp client", f"{share} connections at most may wait for their first request, "
                                                 f"and the node keeps {self.budget} in all")
                return False
        self._owner[fd] = _UNIDENTIFIED
        self._by_tenant.setdefault(_UNIDENTIFIED, OrderedDict())[fd] = now
        return True

    def _stalled(self, now: float) -> Optional[int]:
        """The oldest unidentified connection (of the STALLED_SCAN oldest) whose peer sent no more than a
        handshake's opening (STALLED_BYTES: what anyone may send without a key), or that waited GRACE_S: a
        client that got through CurveZMQ has sent its INITIATE, and its request is on its way."""
        # islice: under a flood thousands wait, and every newcomer past the share looks here.
        for fd, since in list(islice(self._by_tenant.get(_UNIDENTIFIED, {}).items(), STALLED_SCAN)):
            if now - since >= GRACE_S:
                return fd
            conn = self._duplicate(fd)
            if conn is None:
                return fd  # gone already: its place is free
            try:
                info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            except OSError:
                info = b""
            finally:
                conn.close()
            if len(info) >= _TCP_INFO_BYTES and _BYTES_RECEIVED.unpack_from(info, _BYTES_AT)[0] <= STALLED_BYTES:
                return fd
        return None

    def _keep(self, fd: int, tenant, now: float) -> None:
        name = tenant.name if tenant is not None else _STRANGERS
        self._owner[fd] = name
        self._by_tenant.setdefault(name, OrderedDict())[fd] = now

    def _refuse(self, fd: int, who: str, why: str) -> None:
        self.refused += 1
        _warn.warning(f"conn:{who}", "tier %s shut a connection of %s: %s", self.name, who, why)
        self._shut(fd)  # libzmq sees end-of-file and closes its descriptor

    def _refusal(self, tenant) -> str:
        """Why a new connection of tenant may not be kept ('' when it may)."""
        if len(self._owner) >= self.budget:
            return f"the node keeps {self.budget} connections at most"
        if tenant is None:
            if self._held(_STRANGERS) >= min(STRANGER_CONNECTIONS, self.tenant_budget):
                return "accounts in no tenant hold their connections"
        elif tenant is not OPERATOR and self._held(tenant.name) >= self.tenant_budget:
            return f"tenant {tenant.name} holds its {self.tenant_budget} connections"
        return ""

    def _reclaim(self, tenant, why: str, node: bool = False) -> bool:
        """Shut the longest-idle connection of the share a newcomer of tenant is refused by (node: the node's
        whole budget), when it has sent nothing for idle_s; True when one made room."""
        if node or len(self._owner) >= self.budget:  # the node's whole budget: any connection but the operator's
            shares = [order for name, order in self._by_tenant.items() if name != OPERATOR.name]
        elif tenant is OPERATOR:
            return False
        else:
            shares = [self._by_tenant.get(tenant.name if tenant is not None else _STRANGERS, {})]
        oldest = [next(iter(order.items())) for order in shares if order]
        if not oldest:
            return False
        fd, seen = min(oldest, key=lambda item: item[1])
        now = time.perf_counter()
        if now - seen < self.idle_s:
            return False
        self._shut(fd)
        self._forget(fd)  # shut, or closed by libzmq already: its place is free
        self.reclaimed += 1
        _warn.warning(f"reclaim:{why}", "tier %s shut a connection idle %.0f s to make room (%s)", self.name,
                      now - seen, why)
        return True

    def shut_silent(self, seconds: float) -> int:
        """Shut every kept connection that has completed no message for seconds (tiers/node/memory_guard.py:
        the daemon holds more memory than it may, and a peer in the middle of a message it never ends is
        among these); how many."""
        now = time.perf_counter()
        silent = []
        for order in self._by_tenant.values():
            for fd, seen in order.items():  # least recently in use first
                if now - seen < seconds:
                    break
                silent.append(fd)
        for fd in silent:
            self._shut(fd)
            self._forget(fd)
        return len(silent)

    def _shut(self, fd: int) -> None:
        conn = self._duplicate(fd)
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # libzmq sees end-of-file and closes its descriptor
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
