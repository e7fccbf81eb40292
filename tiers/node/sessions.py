"""A daemon's sessions: each opened by a hello for one namespace, on behalf of one tenant.

Who a peer is comes from its messages' metadata, never their fields
(tiers/node/tenants.py): the peer's uid on ipc (libzmq's Peer-Address, from
SO_PEERCRED), its CurveZMQ key on tcp (User-Id).  A hello opens a session only
for a namespace the peer's tenant may use; every later request must come from
a peer of the same tenant (a session id is no bearer token), and a request
that changes the namespace needs a tenant that may write it.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import zmq

from tiers.node.tenants import OPERATOR, Tenant, TenantTable
from tiers.wire import protocol as P

ADMIN_NAMESPACE = "_admin"  # the operator CLI's session: may act on every namespace
SESSION_LIMIT = 4096  # oldest idle sessions are forgotten beyond this
TENANT_SESSION_LIMIT = 1024  # a configured tenant's: past it its own oldest go, never another's
TENANT_SESSION_IDLE = 900.0  # seconds a configured tenant's session lives unused (then it says hello again)
TENANT_LEASE_SHARE = 0.25  # of the arena, pinned by read leases of one configured tenant at most
PEER_CACHE = 65536  # connections whose tenant is remembered by routing id (then the cache starts over)
_UNKNOWN = object()


@dataclass
class Session:
    ns: str
    client: str
    tenant: Tenant
    owner: int  # whose read leases its are (tiers/shm/arena.py): its own id, or its tenant's
    write: bool  # may change its namespace (puts, deletes, clears, evictions)
    seen: float


class Sessions:
    def __init__(self, tenants: TenantTable, ipc: bool, authenticated: bool):
        self.tenants = tenants
        self._ipc = ipc  # peers are told apart by uid (ipc) or by CurveZMQ key (tcp)
        self._authenticated = authenticated  # a tcp endpoint with CurveZMQ (its peers carry a User-Id)
        self._sessions: Dict[int, Session] = {}
        self._per_tenant: Dict[str, int] = {}  # sessions of each tenant
        self._peer_tenants: Dict[bytes, Optional[Tenant]] = {}
        self._tenant_owners: Dict[str, int] = {}  # a configured tenant's lease owner id (negative: no session's)

    def tenant_of(self, peer: zmq.Frame) -> Optional[Tenant]:
        """Who sent this message (peer: its routing frame); None: nobody this node knows.

        Kept by routing id for the ids the ROUTER made up itself (a 0 byte first: never reused while the
        socket lives, and a peer cannot choose one); a peer that named itself is looked up every time, since
        another process may take the name once it left."""
        ident = peer.bytes
        if ident[:1] != b"\0":
            return self._lookup(peer)
        tenant = self._peer_tenants.get(ident, _UNKNOWN)
        if tenant is _UNKNOWN:
            if len(self._peer_tenants) >= PEER_CACHE:
                self._peer_tenants.clear()
            tenant = self._peer_tenants[ident] = self._lookup(peer)
        return tenant

    def _lookup(self, peer: zmq.Frame) -> Optional[Tenant]:
        try:
            if self._ipc:
                return self.tenants.of_ipc_peer(peer.get("Peer-Address"))
            return self.tenants.of_tcp_peer(peer.get("User-Id") if self._authenticated else None)
        except zmq.ZMQError:  # no such property on this connection
            return None if self._ipc else self.tenants.of_tcp_peer(None)

    def open(self, ns: str, client: str, tenant: Optional[Tenant]) -> int:
        """A new session of tenant on namespace ns (ProtocolError forbidden when it may not use it)."""
        if tenant is None:
            raise P.ProtocolError("forbidden", "this account is no tenant of this node (see [[tenants]] in its "
                                               "configuration)")
        if ns == ADMIN_NAMESPACE:
            if not tenant.admin:
                raise P.ProtocolError("forbidden", f"tenant {tenant.name} may not open an admin session")
        elif not tenant.may_read(ns):
            raise P.ProtocolError("forbidden", f"tenant {tenant.name} may not use namespace {ns}")
        if tenant is not OPERATOR and self._per_tenant.get(tenant.name, 0) >= TENANT_SESSION_LIMIT:
            # A tenant opening session after session forgets its own oldest, not the others' live ones.
            self._forget(min((s for s, v in self._sessions.items() if v.tenant is tenant),
                             key=lambda s: self._sessions[s].seen))
        elif len(self._sessions) >= SESSION_LIMIT:
            self._forget(min(self._sessions, key=lambda s: self._sessions[s].seen))
        sid = secrets.randbits(62)
        owner = self._tenant_owners.setdefault(tenant.name, -2 - len(self._tenant_owners))
        self._sessions[sid] = Session(ns, client, tenant, owner, ns == ADMIN_NAMESPACE or tenant.may_write(ns),
                                      time.monotonic())
        self._per_tenant[tenant.name] = self._per_tenant.get(tenant.name, 0) + 1
        return sid

    def _forget(self, sid: int) -> None:
        session = self._sessions.pop(sid)
        left = self._per_tenant.get(session.tenant.name, 1) - 1
        if left > 0:
            self._per_tenant[session.tenant.name] = left
        else:
            self._per_tenant.pop(session.tenant.name, None)

    def expire(self, now: float, idle: float = TENANT_SESSION_IDLE) -> int:
        """Forget configured tenants' sessions unused for idle seconds (their attachments close with them, and
        their clients open new ones at their next call); the operator's engines keep theirs. How many went."""
        stale = [sid for sid, s in self._sessions.items() if s.tenant is not OPERATOR and now - s.seen > idle]
        for sid in stale:
            self._forget(sid)
        return len(stale)

    def get(self, sid: Optional[int], peer_tenant: Optional[Tenant], write: bool = False) -> Session:
        """The session a request names, checked against the tenant of the peer that sent it."""
        session = self._sessions.get(sid) if sid is not None else None
        if session is None:
            raise P.ProtocolError("no_session", "unknown session; send hello again")
        if session.tenant is not peer_tenant:
            raise P.ProtocolError("forbidden", "this session belongs to another tenant")
        if write and not session.write:
            raise P.ProtocolError("forbidden", f"tenant {session.tenant.name} may read namespace {session.ns}, "
                                               f"not change it")
        session.seen = time.monotonic()
        return session

    def tenant(self, sid: Optional[int]) -> Optional[Tenant]:
        session = self._sessions.get(sid) if type(sid) is int else None
        return session.tenant if session is not None else None

    def lease_owner(self, sid: Optional[int], arena_size: int) -> Tuple[Optional[int], Optional[int]]:
        """Whose read leases a session's are, and the most that owner may hold pinned (None: the tier's own
        bound a session). The operator's sessions lease each for itself; all the sessions of a configured
        tenant lease as one owner, which may pin TENANT_LEASE_SHARE of the arena: a tenant that leases and
        never copies (or opens many sessions to) can starve the writers of the others of that much at most."""
        session = self._sessions.get(sid) if sid is not None else None
        if session is None or session.tenant is OPERATOR:
            return sid, None
        return session.owner, int(arena_size * TENANT_LEASE_SHARE)

    def clients(self) -> int:
        """Distinct clients with a session, the operator's CLI aside."""
        return len({s.client for s in self._sessions.values() if s.ns != ADMIN_NAMESPACE})
