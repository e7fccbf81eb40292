"""``serve`` (run the node's tier daemons) and ``sglang-args`` (flags that connect SGLang to them)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import List, Optional

from tiers.config import ConfigError, NodeConfig, load_config
from tiers.logs import setup_logging

log = logging.getLogger("hicache.serve")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config, --runtime-dir, --data-dir: shared by every command that reads the node config."""
    parser.add_argument("--config", metavar="FILE", help="node configuration (TOML); default: the embedded default")
    parser.add_argument("--runtime-dir", metavar="DIR", help="sockets live here (default $XDG_RUNTIME_DIR/hicache-tiers or /tmp/hicache-tiers-UID)")
    parser.add_argument("--data-dir", metavar="DIR", help="NVMe chunk files live under here (default $XDG_DATA_HOME/hicache-tiers)")


def config_from_args(args) -> NodeConfig:
    return load_config(args.config, runtime_dir=args.runtime_dir, data_dir=args.data_dir,
                       log_level=getattr(args, "log_level", None))


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the node's tier daemons in the foreground",
                       description="Run tier daemons in the foreground. One --tier runs that tier in this "
                                   "process (as systemd's hicache-tier@NAME does); otherwise every configured "
                                   "tier runs in a child process of its own. SIGTERM stops gracefully; a "
                                   "second signal exits at once.")
    add_config_args(p)
    p.add_argument("--tier", action="append", metavar="NAME", help="serve only this tier (repeatable)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity (default info)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sglang-args", help="print the SGLang flags that connect a server to this node",
                       description="Print the SGLang launch flags for this node's daemons.")
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print only the extra-config JSON object")
    p.add_argument("--write-policy", choices=["write_through", "write_back", "selective"],
                   help="override the node's default write policy for this server")
    p.add_argument("--no-shm", action="store_true", help="do not ask SGLang for a memfd host pool (pages then travel as frames)")
    p.set_defaults(func=cmd_sglang_args)


def extra_config(config: NodeConfig, args) -> dict:
    """The --hicache-storage-backend-extra-config object for this node."""
    extra = {
        "backend_name": "hicache_tiers",
        "module_path": "hicache_ext",
        "class_name": "TieredHiCacheStorage",
        "interface_v1": 1,
        "runtime_dir": config.runtime_dir,
    }
    if not args.no_shm:
        extra["allocator"] = "shm"
    if args.config:
        extra["tiers_config"] = os.path.abspath(args.config)
    if getattr(args, "write_policy", None):
        extra["write_policy"] = args.write_policy
    return extra


def cmd_sglang_args(args) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"hicache-tiers: {exc}", file=sys.stderr)
        return 2
    extra = extra_config(config, args)
    if args.json:
        print(json.dumps(extra))
        return 0
    print("--enable-hierarchical-cache --hicache-storage-backend dynamic "
          f"--hicache-storage-backend-extra-config {shlex.quote(json.dumps(extra))}")
    return 0


def cmd_serve(args) -> int:
    try:
        config = config_from_args(args)
        tiers = [config.tier(name) for name in args.tier] if args.tier else config.tiers
    except ConfigError as exc:
        print(f"hicache-tiers: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    os.makedirs(config.runtime_dir, mode=0o700, exist_ok=True)
    if len(tiers) == 1:
        return serve_one(config, tiers[0].name)
    return supervise(args, [t.name for t in tiers])


def serve_one(config: NodeConfig, tier_name: str) -> int:
    """Run one tier's daemon in this process until SIGTERM/SIGINT."""
    from tiers.notify import sd_notify, watchdog_interval
    from tiers.tier_factory import build_daemon

    tier = config.tier(tier_name)
    try:
        daemon = build_daemon(config, tier)
        daemon.bind()
    except (OSError, ValueError) as exc:
        log.error("tier %s cannot start: %s", tier_name, exc)
        return 1
    signals = {"count": 0}

    def on_signal(signum, _frame):
        signals["count"] += 1
        if signals["count"] > 1:
            os._exit(1)  # a second signal: leave now
        log.info("tier %s stopping (signal %d)", tier_name, signum)
        sd_notify("STOPPING=1")
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    interval = watchdog_interval()
    last_ping = [0.0]

    def tick():
        if interval and time.monotonic() - last_ping[0] >= interval:
            sd_notify("WATCHDOG=1")
            last_ping[0] = time.monotonic()

    sd_notify(f"READY=1\nSTATUS=serving {tier.kind} tier {tier.name} on {tier.endpoint}")
    log.info("tier %s (%s, %d bytes, %s) serving on %s", tier.name, tier.kind, tier.capacity, tier.policy, tier.endpoint)
    daemon.serve_forever(tick=min(0.5, interval) if interval else 0.5, on_tick=tick)
    log.info("tier %s stopped", tier_name)
    return 0


def supervise(args, names: List[str]) -> int:
    """One child process per tier; SIGTERM is passed on; exits when all have."""
    base = [sys.executable, "-m", "tiers.cli", "serve"]
    for flag in ("config", "runtime_dir", "data_dir", "log_level"):
        value = getattr(args, flag, None)
        if value:
            base += [f"--{flag.replace('_', '-')}", value]
    children = [subprocess.Popen(base + ["--tier", name]) for name in names]

    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    return 0 if all(code == 0 for code in codes) else 1
