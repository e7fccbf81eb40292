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
victims' connections, accepted before, are never touched.

tcp:// endpoints are left to CurveZMQ (only authorized keys complete a
handshake); their connections count in ``open_fds`` like every descriptor.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Dict, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from tiers.ops.logs import RateLimitedLog
from tiers.ops.tenants import OPERATOR, TenantTable

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

    def __init__(self, router: zmq.Socket, ipc_path: str, tenants: TenantTable, fd_limit: int, name: str):
        self.name = name
        self.budget = connection_budget(fd_limit)
        self.tenant_budget = max(1, self.budget // TENANT_SHARE)
        self._path = ipc_path
        self._tenants = tenants
        self._owner: Dict[int, str] = {}  # descriptor -> tenant name, for connections kept
        self._per_tenant: Dict[str, int] = {}
        self.refused = 0
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

    def _forget(self, fd: int) -> None:
        name = self._owner.pop(fd, None)
        if name is not None:
            left = self._per_tenant[name] - 1
            if left:
                self._per_tenant[name] = left
            else:
                del self._per_tenant[name]

    def _accepted(self, fd: int) -> None:
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # already closed by libzmq: nothing to count
        try:
            if conn.family != socket.AF_UNIX or conn.getsockname() != self._path:
                return  # the number now names another descriptor of ours (the connection left meanwhile)
            uid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
            tenant = self._tenants.of_uid(uid)
            why = self._refusal(tenant)
            if why:
                self.refused += 1
                _warn.warning(f"conn:{uid}", "tier %s shut a connection of uid %d: %s", self.name, uid, why)
                conn.shutdown(socket.SHUT_RDWR)  # libzmq sees end-of-file and closes its descriptor
                return
            name = tenant.name if tenant is not None else _STRANGERS
            self._owner[fd] = name
            self._per_tenant[name] = self._per_tenant.get(name, 0) + 1
        except OSError:
            return
        finally:
            conn.close()  # the duplicate only; libzmq keeps its own

    def _refusal(self, tenant) -> str:
        if len(self._owner) >= self.budget:
            return f"the node keeps {self.budget} connections at most"
        if tenant is None:
            if self._per_tenant.get(_STRANGERS, 0) >= min(STRANGER_CONNECTIONS, self.tenant_budget):
                return "accounts in no tenant hold their connections"
        elif tenant is not OPERATOR and self._per_tenant.get(tenant.name, 0) >= self.tenant_budget:
            return f"tenant {tenant.name} holds its {self.tenant_budget} connections"
        return ""

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
