"""ZeroMQ connections to a daemon's ipc socket: at most a share of its descriptors for each tenant.

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

tcp:// endpoints are left to CurveZMQ (only authorized keys complete a
handshake); their connections count in ``open_fds`` like every descriptor.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from typing import Dict, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from tiers.logs import RateLimitedLog
from tiers.node.tenants import OPERATOR, TenantTable

log = logging.getLogger("hicache.connections")
_warn = RateLimitedLog(log)

HEADROOM_SHARE = 8  # 1/8 of the descriptor limit (at least MIN_HEADROOM) stays for files, attaches, staging
MIN_HEADROOM = 64
TENANT_SHARE = 4  # a configured tenant holds at most 1/4 of the connection budget
STRANGER_CONNECTIONS = 16  # accounts in no tenant, together: enough to be told so (a hello gets forbidden)
_STRANGERS = ""  # their name in the count (no tenant has an empty name)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def connection_budget(fd_limit: int) -> int:
    """Connections the daemon keeps at most, of every tenant together."""
    return max(1, fd_limit - max(MIN_HEADROOM, fd_limit // HEADROOM_SHARE))


class ConnectionGuard:
    """Counts accepted connections by tenant and shuts those past their share (called on the loop thread)."""

    def __init__(self, router: zmq.Socket, ipc_path: str, tenants: TenantTable, fd_limit: int, name: str,
                 idle_s: float = 60.0):
        self.name = name
        self.idle_s = idle_s
        self.budget = connection_budget(fd_limit)
        self.tenant_budget = max(1, self.budget // TENANT_SHARE)
        self._path = ipc_path
        self._tenants = tenants
        self._owner: Dict[int, str] = {}  # descriptor -> tenant name, for connections kept
        # Each tenant's kept connections, least recently in use first (descriptor -> when it last carried a
        # request, perf_counter): its count, and its longest-idle connection at once, whatever the share's size.
        self._by_tenant: Dict[str, "OrderedDict[int, float]"] = {}
        self.refused = 0
        self.reclaimed = 0
        self.monitor: Optional[zmq.Socket] = router.get_monitor_socket(_EVENTS)

    @property
    def connections(self) -> int:
        return len(self._owner)

    def handle_monitor(self) -> None:
        while self.monitor is not None:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._forget(fd)  # its earlier owner left and the number was reused before we heard
                self._accepted(fd)
            else:
                self._forget(fd)

    def active(self, fd: int, now: float) -> None:
        """A request came over connection fd (kept ones only: a number we do not hold is left alone)."""
        name = self._owner.get(fd)
        if name is not None:
            order = self._by_tenant[name]
            order[fd] = now
            order.move_to_end(fd)

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
            if conn.family == socket.AF_UNIX and conn.getsockname() == self._path:
                return conn
        except OSError:
            pass
        conn.close()
        return None

    def _accepted(self, fd: int) -> None:
        conn = self._duplicate(fd)
        if conn is None:
            return  # the connection left meanwhile: nothing to count
        try:
            uid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
            tenant = self._tenants.of_uid(uid)
            why = self._refusal(tenant)
            if why and self._reclaim(tenant, why):
                why = ""
            if why:
                self.refused += 1
                _warn.warning(f"conn:{uid}", "tier %s shut a connection of uid %d: %s", self.name, uid, why)
                conn.shutdown(socket.SHUT_RDWR)  # libzmq sees end-of-file and closes its descriptor
                return
            name = tenant.name if tenant is not None else _STRANGERS
            self._owner[fd] = name
            self._by_tenant.setdefault(name, OrderedDict())[fd] = time.perf_counter()
        except OSError:
            return
        finally:
            conn.close()  # the duplicate only; libzmq keeps its own

    def _refusal(self, tenant) -> str:
        if len(self._owner) >= self.budget:
            return f"the node keeps {self.budget} connections at most"
        if tenant is None:
            if self._held(_STRANGERS) >= min(STRANGER_CONNECTIONS, self.tenant_budget):
                return "accounts in no tenant hold their connections"
        elif tenant is not OPERATOR and self._held(tenant.name) >= self.tenant_budget:
            return f"tenant {tenant.name} holds its {self.tenant_budget} connections"
        return ""

    def _reclaim(self, tenant, why: str) -> bool:
        """Shut the longest-idle connection of the share a newcomer of tenant is refused by, when it has sent
        nothing for idle_s; True when one made room."""
        if len(self._owner) >= self.budget:  # the node's whole budget: any connection but the operator's
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
