"""``serve`` and ``install-units``: their arguments, and the configuration flags every command shares.

The work is in tiers/ops/supervisor.py (daemons, signals, systemd's notify
protocol) and tiers/ops/systemd.py (units and example configurations).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from tiers.ops.config import SYSTEM_CONFIG, ConfigError, NodeConfig, load_config
from tiers.logs import FloodGuard, setup_logging
from tiers.ops.supervisor import serve_one, supervise
from tiers.ops.systemd import DOC_DIR, UNIT_DIR, UNIT_SOURCE, install_units


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config, --runtime-dir, --data-dir: shared by every command that reads the node config."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"node configuration (TOML); default $HICACHE_TIERS_CONFIG, then {SYSTEM_CONFIG} "
                             "if it exists, then the embedded default")
    parser.add_argument("--runtime-dir", metavar="DIR", help="sockets live here (default $XDG_RUNTIME_DIR/hicache-tiers or /tmp/hicache-tiers-UID)")
    parser.add_argument("--data-dir", metavar="DIR", help="NVMe chunk files live under here (default $XDG_DATA_HOME/hicache-tiers)")


def config_path(args) -> Optional[str]:
    """--config, else $HICACHE_TIERS_CONFIG, else the system file if present, else None (embedded default)."""
    path = getattr(args, "config", None) or os.environ.get("HICACHE_TIERS_CONFIG")
    if path:
        return path
    return SYSTEM_CONFIG if os.path.exists(SYSTEM_CONFIG) else None


def config_from_args(args) -> NodeConfig:
    return load_config(config_path(args), runtime_dir=args.runtime_dir, data_dir=args.data_dir,
                       log_level=getattr(args, "log_level", None))


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the node's tier daemons in the foreground",
                       description="Run tier daemons in the foreground. One --tier runs that tier in this "
                                   "process (as systemd's hicache-tier@NAME does); otherwise every configured "
                                   "tier runs in a child process of its own. SIGTERM stops gracefully (finish "
                                   "in-flight requests, flush, exit 0); a second signal exits at once (1). "
                                   "SIGHUP re-reads the configuration. Exit codes: 0 stopped cleanly, 1 failed, "
                                   "2 usage or configuration error.")
    add_config_args(p)
    p.add_argument("--tier", action="append", metavar="NAME", help="serve only this tier (repeatable)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity (default info)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("install-units", help="install the systemd units and example configuration files",
                       description="Copy hicache-tier@.service and hicache-pool.service into --prefix and write "
                                   "example node.toml and pool.toml files into --config-dir unless they exist. Then: systemctl "
                                   "daemon-reload && systemctl enable --now hicache-tier@dram hicache-tier@nvme. "
                                   "Exit codes: 0 installed, 1 failed (unit sources missing, cannot write), 2 usage.")
    p.add_argument("--prefix", metavar="DIR", default=UNIT_DIR, help=f"unit directory (default {UNIT_DIR})")
    p.add_argument("--config-dir", metavar="DIR", default=os.path.dirname(SYSTEM_CONFIG),
                   help=f"where node.toml lives (default {os.path.dirname(SYSTEM_CONFIG)}); also written into ExecStart")
    p.add_argument("--exec", metavar="PATH", dest="exec_path",
                   help="the hicache-tiers executable for ExecStart (default: the one on PATH)")
    p.add_argument("--source", metavar="DIR", default=UNIT_SOURCE, help="where the unit files are (default scripts/systemd)")
    p.add_argument("--doc-dir", metavar="DIR", default=DOC_DIR,
                   help=f"where OPERATIONS.md goes, for the units' Documentation= (default {DOC_DIR})")
    p.set_defaults(func=cmd_install_units)


def cmd_serve(args) -> int:
    try:
        config = config_from_args(args)
        tiers = [config.tier(name) for name in args.tier] if args.tier else config.tiers
    except ConfigError as exc:
        print(f"hicache-tiers: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    guard = FloodGuard()
    for handler in logging.getLogger().handlers:
        handler.addFilter(guard)
    os.makedirs(config.runtime_dir, mode=0o700, exist_ok=True)
    if len(tiers) == 1:
        return serve_one(config, tiers[0].name, reload_config=lambda: config_from_args(args))
    return supervise(config, [t.name for t in tiers], serve_flags(args))


def serve_flags(args) -> List[str]:
    """The flags a child of ``serve`` gets: the same configuration as ours."""
    flags = []
    path = config_path(args)
    if path:
        flags += ["--config", path]
    for flag in ("runtime_dir", "data_dir", "log_level"):
        value = getattr(args, flag, None)
        if value:
            flags += [f"--{flag.replace('_', '-')}", value]
    return flags


def cmd_install_units(args) -> int:
    return install_units(args.source, args.prefix, args.config_dir, args.doc_dir, args.exec_path)
