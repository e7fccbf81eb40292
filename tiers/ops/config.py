"""The node configuration: one loader, validated at start, with an embedded default.

Precedence, highest first: command-line flags (``--runtime-dir``,
``--data-dir``, ``--log-level``), environment (``HICACHE_TIERS_RUNTIME_DIR``,
``HICACHE_TIERS_DATA_DIR``, ``HICACHE_TIERS_LOG_LEVEL``), the TOML file, the
embedded default below.  Every mistake is a ``ConfigError`` that names the
file, the key and what is allowed.
"""
from __future__ import annotations

import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

SYSTEM_CONFIG = "/etc/hicache-tiers/node.toml"  # read when no --config and no $HICACHE_TIERS_CONFIG

# The embedded default's write policy and chain of tiers (install-units writes the same into its example node.toml).
# write_back by measurement (docs/PERFORMANCE.md, round of issue 16): a backup through DRAM + fsync NVMe
# ran at 0.34 GB/s with write_through (the NVMe tier's own speed) and 6.6 GB/s with write_back, and a
# cache page lost with a crashed DRAM daemon is a miss, not lost data; at most max_dirty_pages wait.
DEFAULT_CHAIN_TOML = """\
write_policy = "write_back"

[[tiers]]
name = "dram"
kind = "dram"
capacity = "4GiB"
policy = "lru"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "64GiB"
policy = "lru"
"""
DEFAULT_CONFIG_TOML = ("# hicache-tiers embedded default: DRAM in front of NVMe; pages are acknowledged in DRAM and "
                       "written to NVMe behind it.\n[node]\n" + DEFAULT_CHAIN_TOML)

from tiers.plugins import PluginError, store_kind, store_targets
from tiers.wire.security import CurveSettings
from tiers.stores.kind_options import KIND_OPTIONS  # public here too (scripts/readme_reference.py)
from tiers.node.tenants import Tenant, parse_tenants, socket_gid
from tiers.config_values import (  # noqa: F401  (ConfigError, parse_size, WRITE_POLICIES: public here too)
    WRITE_POLICIES,
    LOG_LEVELS,
    ConfigError,
    _Problems,
    parse_size,
    _bool,
    _node_default_bool,
    _str,
    _int,
    _choice,
    _port,
    _tier_port,
    _list_of,
    _endpoint,
    _weight,
    _policy)



def _kind(value: Any, where: str) -> str:
    builtin = ("dram", "nvme", "remote", "pool", "mooncake_store")
    if value in builtin:  # no look at the installed plug-ins' metadata (a daemon's start)
        return value
    return _choice(*builtin, *sorted(set(store_targets()) - set(builtin)))(value, where)


def kind_options(kind: str, where: str = "kind") -> Dict[str, tuple]:
    """The options a tier kind accepts: the built-ins' tables below, a plug-in's own declaration."""
    if kind in KIND_OPTIONS:
        return KIND_OPTIONS[kind]
    try:
        return store_kind(kind).options
    except PluginError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# Options of each tier kind: key -> (parser, default, help).  The loader
# rejects keys not listed here, so a typo is an error instead of a silent default.
COMMON_TIER_OPTIONS: Dict[str, tuple] = {
    "name": (_str, None, "tier name, unique on the node (socket and unit instance name)"),
    "kind": (_kind, None, "dram, nvme, remote (client of pool daemons), pool (a remote memory pool daemon), "
                          "mooncake_store, or a plug-in's kind (tiers/plugins.py)"),
    "capacity": (parse_size, "1GiB", "bytes the tier may hold"),
    "policy": (_policy, "lru", "eviction policy: an installed name or an absolute /path/file.py:Class"),
    "max_page_bytes": (parse_size, "64MiB", "largest page accepted"),
    "endpoint": (_str, "", "ZeroMQ endpoint; default ipc://RUNTIME_DIR/NAME.sock"),
    "metrics_port": (_tier_port, -1, "Prometheus port of this daemon; 0 off; default node.metrics_port + tier index"),
    "allow_insecure_tcp": (_node_default_bool, "node", "serve this tier's tcp:// endpoint without CurveZMQ; default node.allow_insecure_tcp"),
    "staging_bytes": (parse_size, "2GiB", "memory that pages of NVMe and remote tiers pass through between host "
                                          "pools and the store, faulted in at start (in the background; under 64 MiB: "
                                          "on use); one session may use half, at least 1 GiB (a batch of 128 pages of "
                                          "8 MiB); a batch that finds it full is served in part"),
    "max_region_bytes": (parse_size, "0", "largest host pool an engine may attach; 0: the machine's RAM"),
    "max_inflight_bytes": (parse_size, "2GiB", "page bytes in frames a daemon holds in flight; above it requests get "
                                               "busy (its memory bound allows this much over its start, plus the "
                                               "index and 256 MiB: past it connections silent for 0.25 s are shut)"),
}


@dataclass
class TierConfig:
    name: str
    kind: str
    capacity: int
    policy: str
    max_page_bytes: int
    endpoint: str
    options: Dict[str, Any] = field(default_factory=dict)
    metrics_port: int = 0  # 0: no Prometheus endpoint
    allow_insecure_tcp: bool = False  # serve a tcp:// endpoint without CurveZMQ (default: the node's setting)
    staging_bytes: int = 2 << 30
    max_region_bytes: int = 0
    max_inflight_bytes: int = 2 << 30
    curve: CurveSettings = field(default_factory=CurveSettings)  # CurveZMQ keys of its tcp:// endpoint(s)

    def fd_socket(self, runtime_dir: str) -> str:
        """AF_UNIX path where host-pool memfds are handed over (ipc tiers only)."""
        return os.path.join(runtime_dir, f"{self.name}.fd.sock")


@dataclass
class NodeConfig:
    tiers: List[TierConfig]
    runtime_dir: str
    data_dir: str
    write_policy: str = "write_back"
    log_level: str = "info"
    max_dirty_pages: int = 1024
    node_name: str = ""
    source: str = "<embedded default>"
    metrics_port: int = 0  # base port: tier i serves metrics on metrics_port + i (0: off)
    metrics_address: str = "127.0.0.1"
    # CurveZMQ on tcp:// endpoints (tiers/wire/security.py): certificate files and the insecure opt-out.
    curve_server_key: str = ""
    curve_client_key: str = ""
    curve_authorized_keys: str = ""
    allow_insecure_tcp: bool = False
    demotion_queue_bytes: int = 256 << 20  # write-back pages on their way down, per daemon
    quotas: Dict[str, int] = field(default_factory=dict)  # namespace prefix -> bytes per tier
    socket_gid: Optional[int] = None  # ipc sockets open to this group (None: the daemon's account only)
    connection_idle_s: float = 60.0  # a tenant's connection idle this long gives its place to a newcomer
    tenants: List[Tenant] = field(default_factory=list)  # [[tenants]]: accounts and keys beside the operator's

    def tier(self, name: str) -> TierConfig:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ConfigError(f"{self.source}: no tier named {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")


def default_runtime_dir() -> str:
    if os.environ.get("RUNTIME_DIRECTORY"):  # set by systemd for RuntimeDirectory=
        return os.environ["RUNTIME_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hicache-tiers-{os.getuid()}"
    return os.path.join(base, "hicache-tiers") if os.environ.get("XDG_RUNTIME_DIR") else base


def default_data_dir() -> str:
    if os.environ.get("STATE_DIRECTORY"):  # set by systemd for StateDirectory=
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "hicache-tiers")


NODE_KEYS = {"name", "runtime_dir", "data_dir", "write_policy", "log_level", "max_dirty_pages",
             "metrics_port", "metrics_address", "curve_server_key", "curve_client_key", "curve_authorized_keys",
             "allow_insecure_tcp", "demotion_queue_bytes", "socket_group", "connection_idle_s"}


def parse_config(text: str, source: str, runtime_dir: Optional[str] = None, data_dir: Optional[str] = None,
                 log_level: Optional[str] = None) -> NodeConfig:
    """Parse and validate TOML text; flags given here win over env and file."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    problems = _Problems()
    unknown = set(raw) - {"node", "tiers", "quotas", "tenants"}
    if unknown:
        problems.append(f"{source}: unknown section(s) {', '.join(sorted(unknown))}; allowed: node, tiers, quotas, "
                        f"tenants")
    node = raw.get("node", {})
    if not isinstance(node, dict):
        problems.append(f"{source}: [node] must be a table")
        node = {}
    for key in node:
        if key not in NODE_KEYS:
            problems.append(f"{source}: node.{key} is not a known key; allowed: {', '.join(sorted(NODE_KEYS))}")
    node = {k: v for k, v in node.items() if k in NODE_KEYS}
    env = os.environ
    runtime = runtime_dir or env.get("HICACHE_TIERS_RUNTIME_DIR") or node.get("runtime_dir") or default_runtime_dir()
    data = data_dir or env.get("HICACHE_TIERS_DATA_DIR") or node.get("data_dir") or default_data_dir()
    level = log_level or env.get("HICACHE_TIERS_LOG_LEVEL") or node.get("log_level", "info")
    check = problems.check
    config = NodeConfig(
        tiers=[],
        runtime_dir=check("/", _str, runtime, f"{source}: node.runtime_dir"),
        data_dir=check("/", _str, data, f"{source}: node.data_dir"),
        write_policy=check("write_back", _choice(*WRITE_POLICIES), node.get("write_policy", "write_back"),
                           f"{source}: node.write_policy"),
        log_level=check("info", _choice(*LOG_LEVELS), level, f"{source}: node.log_level"),
        node_name=check("", _str, node.get("name", socket.gethostname()), f"{source}: node.name"),
        max_dirty_pages=check(1024, _int, node.get("max_dirty_pages", 1024), f"{source}: node.max_dirty_pages"),
        source=source,
        metrics_port=check(0, _port, node.get("metrics_port", 0), f"{source}: node.metrics_port"),
        metrics_address=check("", _str, node.get("metrics_address", "127.0.0.1"), f"{source}: node.metrics_address"),
        curve_server_key=check("", _key_path, node.get("curve_server_key", ""), f"{source}: node.curve_server_key",
                               source),
        curve_client_key=check("", _key_path, node.get("curve_client_key", ""), f"{source}: node.curve_client_key",
                               source),
        curve_authorized_keys=check("", _key_path, node.get("curve_authorized_keys", ""),
                                    f"{source}: node.curve_authorized_keys", source),
        allow_insecure_tcp=check(False, _bool, node.get("allow_insecure_tcp", False), f"{source}: node.allow_insecure_tcp"),
        demotion_queue_bytes=check(0, parse_size, node.get("demotion_queue_bytes", "256MiB"),
                                   f"{source}: node.demotion_queue_bytes"),
        quotas=check({}, _quotas, raw.get("quotas", {}), source),
        socket_gid=check(None, socket_gid, node.get("socket_group", ""), f"{source}: node.socket_group"),
        connection_idle_s=check(60.0, _weight, node.get("connection_idle_s", 60.0), f"{source}: node.connection_idle_s"),
        tenants=check([], parse_tenants, raw.get("tenants", []), source),
    )
    tiers = raw.get("tiers", [])
    if not isinstance(tiers, list) or not tiers:
        problems.append(f"{source}: at least one [[tiers]] table is required")
        tiers = []
    for index, table in enumerate(tiers):
        tier = _parse_tier(table, f"{source}: tiers[{index}]", config, problems)
        if tier is not None:
            config.tiers.append(tier)
    names = [t.name for t in config.tiers]
    if len(set(names)) != len(names):
        problems.append(f"{source}: tier names must be unique, got {', '.join(names)}")
    for tenant in config.tenants:
        unknown = sorted({tier for tier, _ in tenant.tier_quotas} - set(names))
        if unknown:
            problems.append(f"{source}: tenant {tenant.name}'s quota names no tier {', '.join(unknown)} "
                            f"(tiers: {', '.join(names)})")
    problems.raise_any()
    _resolve_metrics_ports(config)
    _attach_curve(config)
    return config


def _quotas(table: Any, source: str) -> Dict[str, int]:
    """[quotas]: namespace or model prefix -> the most bytes its pages may take in any one tier."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [quotas] must be a table of \"prefix\" = size")
    out = {}
    for prefix, size in table.items():
        out[prefix] = parse_size(size, f"{source}: quotas.{prefix}")
        if out[prefix] <= 0:
            raise ConfigError(f"{source}: quotas.{prefix} must be positive")
    return out


def _key_path(value: Any, where: str, source: str) -> str:
    """A key file or directory path; relative paths are taken from the configuration file's directory."""
    path = _str(value, where)
    if path and not os.path.isabs(path) and not source.startswith("<"):
        path = os.path.join(os.path.dirname(os.path.abspath(source)), path)
    return path


def _attach_curve(config: NodeConfig) -> None:
    """Each tier carries the CurveZMQ settings its daemon serves with and its clients (pools included) use."""
    if config.curve_client_key and not config.curve_server_key:
        raise ConfigError(f"{config.source}: node.curve_client_key needs node.curve_server_key (the server's public key)")
    for tier in config.tiers:
        tier.curve = CurveSettings(config.curve_server_key, config.curve_client_key, config.curve_authorized_keys,
                                   tier.allow_insecure_tcp)


def _resolve_metrics_ports(config: NodeConfig) -> None:
    """Tiers without metrics_port take node.metrics_port + their index (node 0: off); no port twice."""
    used: Dict[int, str] = {}
    for index, tier in enumerate(config.tiers):
        if tier.metrics_port < 0:
            tier.metrics_port = config.metrics_port + index if config.metrics_port else 0
        if tier.metrics_port > 65535:
            raise ConfigError(f"{config.source}: tiers[{index}].metrics_port: node.metrics_port + {index} is over 65535")
        if tier.metrics_port and tier.metrics_port in used:
            raise ConfigError(f"{config.source}: tiers[{index}].metrics_port: {tier.metrics_port} is already used by "
                              f"tier {used[tier.metrics_port]}; each daemon needs a port of its own")
        used[tier.metrics_port] = tier.name


def _parse_tier(table: Any, where: str, node: NodeConfig, problems: _Problems) -> Optional[TierConfig]:
    """One [[tiers]] table; its mistakes go to problems (then None)."""
    if not isinstance(table, dict):
        problems.append(f"{where}: must be a table")
        return None
    before = len(problems)
    kind = problems.check(None, COMMON_TIER_OPTIONS["kind"][0], table.get("kind"), f"{where}.kind")
    if kind is None:
        return None
    specs = {**COMMON_TIER_OPTIONS, **problems.check({}, kind_options, kind, f"{where}.kind")}
    for key in table:
        if key not in specs:
            problems.append(f"{where}.{key} is not a known key for a {kind} tier; allowed: {', '.join(sorted(specs))}")
    values = {}
    for key, (parser, default, _help) in specs.items():
        if key not in table and default is None:
            problems.append(f"{where}.{key} is required")
            continue
        values[key] = problems.check(None, parser, table.get(key, default), f"{where}.{key}")
    name, capacity = values.get("name"), values.get("capacity")
    if isinstance(name, str) and not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", name):
        problems.append(f"{where}.name: {name!r} must be 1-32 chars of a-z, 0-9, _ and -")
    if capacity is not None and capacity <= 0:
        problems.append(f"{where}.capacity must be positive")
    elif capacity is not None and values.get("block_size") and capacity < values["block_size"]:
        problems.append(f"{where}.capacity: {capacity} bytes is less than one block "
                        f"(block_size {values['block_size']} bytes)")
    if len(problems) > before:
        return None
    endpoint = values.pop("endpoint") or f"ipc://{os.path.join(node.runtime_dir, name)}.sock"
    if not endpoint.startswith(("ipc://", "tcp://")):
        problems.append(f"{where}.endpoint: {endpoint!r} must start with ipc:// or tcp://")
    if len(problems) > before:
        return None
    common = {k: values.pop(k) for k in ("name", "kind", "capacity", "policy", "max_page_bytes", "metrics_port",
                                         "allow_insecure_tcp", "staging_bytes", "max_region_bytes",
                                         "max_inflight_bytes")}
    if common["allow_insecure_tcp"] is None:
        common["allow_insecure_tcp"] = node.allow_insecure_tcp
    if kind == "nvme" and not values.get("path"):
        values["path"] = os.path.join(node.data_dir, name)
    return TierConfig(endpoint=endpoint, options=values, **common)


def load_config(path: Optional[str] = None, **overrides) -> NodeConfig:
    """Load FILE, or the embedded default when path is None."""
    if path is None:
        return parse_config(DEFAULT_CONFIG_TOML, "<embedded default>", **overrides)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_config(text, path, **overrides)
