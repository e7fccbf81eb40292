"""Tenants: who a connection is, as the kernel or CurveZMQ says, and which namespaces it may touch.

A message cannot say who sent it: a tenant is what the node can verify.  On an
ipc:// socket that is the peer's uid (SO_PEERCRED, which libzmq reads when the
connection is made and hands on as the ``Peer-Address`` of every message); on
a tcp:// endpoint, the client's CurveZMQ public key (the ``User-Id`` the
handshake's authenticator set).  A ``hello`` is checked against the tenant of
the connection it came on and its session carries that tenant; session ids
are 62 random bits known only to the connection that said hello.

The daemon's own account and root are the node's operator: every namespace,
admin requests, the arena mapped for zero-copy reads.  So are CurveZMQ keys
the node authorized and no tenant names (other nodes' daemons, which name
namespaces on their engines' behalf).  Any other account needs a
``[[tenants]]`` entry, and the daemon's sockets must be opened to its group
(``node.socket_group``): by default they are the daemon account's alone.

    [[tenants]]
    name = "team-a"
    uids = [1001, "alice"]          # accounts (ipc sockets)
    keys = ["<z85 public key>"]     # CurveZMQ client keys (tcp endpoints)
    namespaces = ["llama3-70b*"]    # read and write (fnmatch patterns)
    read_namespaces = ["shared-*"]  # read only (a namespace several tenants share; its owner writes)
    admin = false                   # list, clear and evict every namespace
    map_arena = false               # map the daemon's arena (leased reads; sees every namespace's bytes)
"""
from __future__ import annotations

import fnmatch
import grp
import os
import pwd
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

from tiers.config_values import ConfigError, parse_size

TENANT_KEY_HELP = {  # the README's reference is written from this (scripts/readme_reference.py)
    "name": "the tenant's name in refusals and logs",
    "uids": "accounts (uid or user name) whose ipc connections are this tenant (SO_PEERCRED)",
    "keys": "CurveZMQ client public keys (Z85) whose tcp connections are this tenant",
    "namespaces": "namespaces it reads and writes: fnmatch patterns (\"llama3-70b*\" matches every shard)",
    "read_namespaces": "namespaces it may read but not change (one another tenant writes, shared)",
    "admin": "may open an _admin session: stats of every namespace, clear and evict across them (default false)",
    "map_arena": "may map the daemon's arena for zero-copy leased reads; the arena holds every namespace's "
                 "pages, so only a tenant trusted with them (default false: its reads come as frames)",
    "quota": "bytes all its namespaces may hold together in each tier (e.g. \"4GiB\"), or a table by tier name "
             "({dram = \"4GiB\", nvme = \"1TiB\"}; tiers it does not name: none); default: none, its fair "
             "share only",
}
TENANT_KEYS = tuple(TENANT_KEY_HELP)


class TenantError(ConfigError):
    """A [[tenants]] table or socket_group that cannot be used; the message names it."""


@dataclass(frozen=True)
class Tenant:
    name: str
    uids: FrozenSet[int] = frozenset()
    keys: FrozenSet[str] = frozenset()
    namespaces: Tuple[str, ...] = ()
    read_namespaces: Tuple[str, ...] = ()
    admin: bool = False
    map_arena: bool = False
    quota: int = 0  # bytes its namespaces may hold together in each tier (0: none)
    tier_quotas: Tuple[Tuple[str, int], ...] = ()  # (tier name, bytes): a quota by tier, instead of quota

    def quota_in(self, tier: str) -> int:
        """Bytes its namespaces may hold together in the tier of this name (0: no quota)."""
        if not self.tier_quotas:
            return self.quota
        return dict(self.tier_quotas).get(tier, 0)

    def may_write(self, namespace: str) -> bool:
        return any(fnmatch.fnmatchcase(namespace, pattern) for pattern in self.namespaces)

    def may_read(self, namespace: str) -> bool:
        return self.may_write(namespace) or any(fnmatch.fnmatchcase(namespace, p) for p in self.read_namespaces)


OPERATOR = Tenant("operator", namespaces=("*",), admin=True, map_arena=True)


@dataclass
class TenantTable:
    """Who each connection is: the operator's accounts, the configured tenants, nobody else."""
    tenants: List[Tenant] = field(default_factory=list)
    operator_uids: FrozenSet[int] = field(default_factory=lambda: frozenset({0, os.getuid()}))
    _by_uid: Dict[int, Tenant] = field(init=False, repr=False)
    _by_key: Dict[str, Tenant] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_uid = {uid: t for t in self.tenants for uid in t.uids}
        self._by_key = {key: t for t in self.tenants for key in t.keys}

    def of_uid(self, uid: Optional[int]) -> Optional[Tenant]:
        if uid is None:
            return None
        if uid in self.operator_uids:
            return OPERATOR
        return self._by_uid.get(uid)

    def of_ipc_peer(self, peer_address: Optional[str]) -> Optional[Tenant]:
        """The tenant of an ipc connection: libzmq's Peer-Address ends ':uid:gid:pid' (SO_PEERCRED)."""
        return self.of_uid(_peer_uid(peer_address))

    def of_tcp_peer(self, user_id: Optional[str]) -> Tenant:
        """The tenant of a tcp connection: User-Id is the client's Z85 public key, set when the CurveZMQ
        handshake admitted it.  An authorized key no tenant claims is another node's daemon; an insecure
        endpoint (allow_insecure_tcp, the operator's choice) has no key and only the operator's peers."""
        return self._by_key.get(user_id, OPERATOR) if user_id else OPERATOR


def _peer_uid(peer_address: Optional[str]) -> Optional[int]:
    """The uid in an ipc Peer-Address ('...:uid:gid:pid'), None when it has none."""
    if not peer_address or peer_address.count(":") < 3:
        return None
    try:
        return int(peer_address.rsplit(":", 3)[1])
    except ValueError:
        return None


def parse_tenants(tables: Any, source: str) -> List[Tenant]:
    """[[tenants]] tables; TenantError naming the first mistake."""
    if not isinstance(tables, list):
        raise TenantError(f"{source}: [[tenants]] must be an array of tables")
    tenants, seen_uids, seen_keys = [], {}, {}
    for index, table in enumerate(tables):
        where = f"{source}: tenants[{index}]"
        if not isinstance(table, dict):
            raise TenantError(f"{where}: must be a table")
        unknown = set(table) - set(TENANT_KEYS)
        if unknown:
            raise TenantError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(TENANT_KEYS)}")
        name = table.get("name")
        if not isinstance(name, str) or not name:
            raise TenantError(f"{where}.name: a non-empty string is required")
        uids = frozenset(_uid(u, f"{where}.uids") for u in _list(table.get("uids", []), f"{where}.uids"))
        keys = frozenset(_strings(table, "keys", where))
        if not uids and not keys:
            raise TenantError(f"{where}: name at least one of uids or keys (who this tenant is)")
        for uid in uids:
            if uid in seen_uids:
                raise TenantError(f"{where}.uids: uid {uid} is tenant {seen_uids[uid]}'s already")
            seen_uids[uid] = name
        for key in keys:
            if key in seen_keys:
                raise TenantError(f"{where}.keys: a key is tenant {seen_keys[key]}'s already")
            seen_keys[key] = name
        tenants.append(Tenant(
            name, uids, keys,
            _strings(table, "namespaces", where), _strings(table, "read_namespaces", where),
            _bool(table.get("admin", False), f"{where}.admin"), _bool(table.get("map_arena", False), f"{where}.map_arena"),
            *_quotas(table.get("quota", 0), f"{where}.quota")))
    return tenants


def _quotas(value: Any, where: str) -> Tuple[int, Tuple[Tuple[str, int], ...]]:
    """(quota in every tier, quotas by tier name) of a tenant's quota: one size, or a table of them."""
    if isinstance(value, dict):
        by_tier = tuple((str(tier), parse_size(size, f"{where}.{tier}")) for tier, size in value.items())
        return 0, by_tier
    return parse_size(value, where), ()


def socket_gid(group: Any, where: str) -> Optional[int]:
    """node.socket_group as a gid (None: the sockets stay the daemon account's alone)."""
    if group in ("", None):
        return None
    return _system_id(group, where, "group", "gid", lambda name: grp.getgrnam(name).gr_gid)


def _uid(value: Any, where: str) -> int:
    return _system_id(value, where, "account", "uid", lambda name: pwd.getpwnam(name).pw_uid)


def _system_id(value: Any, where: str, what: str, number: str, by_name) -> int:
    """A non-negative id as given, or the id of the name by_name looks up on this machine."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return by_name(value)
        except KeyError:
            raise TenantError(f"{where}: no {what} named {value!r} on this machine") from None
    raise TenantError(f"{where}: {value!r} is neither a {number} nor {'an' if what[0] in 'aeiou' else 'a'} "
                      f"{what} name")


def _strings(table: dict, key: str, where: str) -> Tuple[str, ...]:
    """A list of non-empty strings under key (absent: none)."""
    return tuple(_str(v, f"{where}.{key}") for v in _list(table.get(key, []), f"{where}.{key}"))


def _list(value: Any, where: str) -> Iterable:
    if not isinstance(value, list):
        raise TenantError(f"{where}: a list is required")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise TenantError(f"{where}: non-empty strings are required")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise TenantError(f"{where}: true or false")
    return value
