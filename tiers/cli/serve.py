"""``serve`` (run the node's tier daemons) and ``install-units`` (put the systemd units in place).

Under systemd a daemon follows the notify protocol: READY=1 once its sockets
are bound, WATCHDOG=1 every WatchdogSec/2, RELOADING=1 then READY=1 around a
SIGHUP reload, STOPPING=1 on the way out.  The first SIGTERM/SIGINT drains
(stop accepting, finish in-flight requests, flush) and exits 0; a second one
exits at once with 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional

import zmq

from tiers.ops.config import ConfigError, NodeConfig, TierConfig, load_config
from tiers.ops.logs import FloodGuard, setup_logging

log = logging.getLogger("hicache.serve")

SYSTEM_CONFIG = "/etc/hicache-tiers/node.toml"
UNIT_DIR = "/etc/systemd/system"
UNIT_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "systemd")
UNIT_EXEC = "/usr/local/bin/hicache-tiers"  # the ExecStart binary as written in scripts/systemd
DOC_DIR = "/usr/share/doc/hicache-tiers"  # where the units' Documentation= points
DOC_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "OPERATIONS.md")
# ProtectHome= and PrivateTmp= in the units hide these from the daemon.
HIDDEN_FROM_UNITS = ("/home/", "/root/", "/run/user/", "/tmp/", "/var/tmp/")
# Node keys the running daemon uses: a change needs a restart (log_level applies live).
RESTART_NODE_KEYS = ("runtime_dir", "data_dir", "max_dirty_pages", "metrics_address")

EXAMPLE_NODE_TOML = """\
# hicache-tiers node configuration (written by `hicache-tiers install-units`).
# Check with `hicache-tiers config check FILE`; see docs/OPERATIONS.md.
# runtime_dir and data_dir are the directories the units create (RuntimeDirectory=,
# StateDirectory=); SGLang and the CLI read them from this file too.
[node]
write_policy = "write_through"
log_level = "info"
runtime_dir = "/run/hicache-tiers"
data_dir = "/var/lib/hicache-tiers"
# Prometheus: tier i serves http://metrics_address:(metrics_port + i)/metrics; 0 turns it off.
metrics_port = 9470
metrics_address = "127.0.0.1"

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
# path = "/var/lib/hicache-tiers/stores/nvme"  (a path elsewhere needs ReadWritePaths= in a unit drop-in)

# [[tiers]]
# name = "remote"
# kind = "remote"
# capacity = "256GiB"
"""

EXAMPLE_POOL_TOML = """\
# hicache-tiers remote memory pool (written by `hicache-tiers install-units`);
# served by hicache-pool.service on a memory node.  Set endpoint to an address
# the compute nodes reach; list it in their remote tier's `pools`.
[node]
log_level = "info"
runtime_dir = "/run/hicache-tiers"
data_dir = "/var/lib/hicache-tiers"
metrics_port = 9480
metrics_address = "127.0.0.1"

[[tiers]]
name = "pool"
kind = "pool"
capacity = "64GiB"
endpoint = "tcp://192.0.2.10:7700"
protocol = "rdma"
"""
EXAMPLES = {"node.toml": EXAMPLE_NODE_TOML, "pool.toml": EXAMPLE_POOL_TOML}


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
    return supervise(args, config, [t.name for t in tiers])


def serve_one(config: NodeConfig, tier_name: str, reload_config: Optional[Callable[[], NodeConfig]] = None) -> int:
    """Run one tier's daemon in this process until SIGTERM/SIGINT; SIGHUP reloads."""
    from tiers.ops.notify import sd_notify, watchdog_interval
    from tiers.ops.prometheus import start_exporter
    from tiers.stores.base import StoreError
    from tiers.node.tier_factory import build_daemon

    tier = config.tier(tier_name)
    exporter = None
    try:
        daemon = build_daemon(config, tier)
        exporter = start_exporter(daemon, tier.kind, tier.metrics_port, config.metrics_address)
        daemon.bind()
    except Exception as exc:  # one line for what an operator can fix, a traceback for a bug
        log.error("tier %s cannot start: %s", tier_name, exc, exc_info=not isinstance(exc, (OSError, ValueError, StoreError)))
        if exporter is not None:
            exporter.close()
        return 1
    state = {"signals": 0, "reload": False}

    def on_stop(signum, _frame):
        state["signals"] += 1
        if state["signals"] > 1:
            os._exit(1)  # a second signal: leave now
        log.info("tier %s stopping (signal %d): finishing in-flight requests", tier_name, signum)
        sd_notify("STOPPING=1")
        daemon.stop()

    def on_hup(_signum, _frame):
        state["reload"] = True  # done on the loop thread, at the next tick

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    interval = watchdog_interval()
    last_ping = [0.0]
    status = f"serving {tier.kind} tier {tier.name} on {tier.endpoint}"

    def tick():
        if interval and time.monotonic() - last_ping[0] >= interval:
            sd_notify("WATCHDOG=1")
            last_ping[0] = time.monotonic()
        if state["reload"] and state["signals"] == 0:
            state["reload"] = False
            reload(config, tier_name, reload_config, status)

    sd_notify(f"READY=1\nSTATUS={status}")
    log.info("tier %s (%s, %d bytes, %s) serving on %s", tier.name, tier.kind, tier.capacity, tier.policy, tier.endpoint)
    try:
        daemon.serve_forever(tick=min(0.5, interval) if interval else 0.5, on_tick=tick)
    finally:
        if exporter is not None:
            exporter.close()
        # Sockets still open close at once; the router, closed with a linger, gets its last replies out first.
        zmq.Context.instance().destroy(linger=0)
    log.info("tier %s stopped", tier_name)
    return 0


def reload(config: NodeConfig, tier_name: str, reload_config: Optional[Callable[[], NodeConfig]], status: str) -> None:
    """SIGHUP: re-read the configuration, apply the log level, name what needs a restart."""
    from tiers.ops.notify import sd_notify

    sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    try:
        if reload_config is None:
            raise ConfigError("no configuration source to reload")
        new = reload_config()
        new_tier = new.tier(tier_name)
    except ConfigError as exc:
        log.error("reload failed, keeping the running configuration: %s", exc)
        sd_notify(f"READY=1\nSTATUS={status} (last reload failed: {str(exc)[:200]})")
        return
    if new.log_level != config.log_level:
        log.warning("log level %s -> %s", config.log_level, new.log_level)  # said before a stricter level hides it
        logging.getLogger().setLevel(new.log_level.upper())
        config.log_level = new.log_level
    changed = restart_needed(config, config.tier(tier_name), new, new_tier)
    if changed:
        log.warning("reload: %s changed; restart the daemon (hicache-tier@%s) to apply", ", ".join(changed), tier_name)
    else:
        log.info("reload: configuration re-read from %s; nothing else changed", new.source)
    sd_notify(f"READY=1\nSTATUS={status}" + (f" (restart to apply: {', '.join(changed)})" if changed else ""))


def restart_needed(old: NodeConfig, old_tier: TierConfig, new: NodeConfig, new_tier: TierConfig) -> List[str]:
    """Settings of this daemon that differ between old and new (they apply only at start)."""
    changed = [f"node.{key}" for key in RESTART_NODE_KEYS if getattr(old, key) != getattr(new, key)]
    old_t, new_t = dataclasses.asdict(old_tier), dataclasses.asdict(new_tier)
    changed += [f"tier {old_tier.name}: {key}" for key in old_t if old_t[key] != new_t.get(key)]
    if [t.name for t in old.tiers] != [t.name for t in new.tiers]:
        changed.append("the list of tiers")
    return changed


def supervise(args, config: NodeConfig, names: List[str]) -> int:
    """One child process per tier; signals are passed on; READY=1 once every child answers."""
    from tiers.ops.node_runner import ping
    from tiers.ops.notify import sd_notify

    base = [sys.executable, "-m", "tiers.cli", "serve"]
    path = config_path(args)
    if path:
        base += ["--config", path]
    for flag in ("runtime_dir", "data_dir", "log_level"):
        value = getattr(args, flag, None)
        if value:
            base += [f"--{flag.replace('_', '-')}", value]
    # The children are not the main process systemd watches: readiness is ours to tell.
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    # Their own session: a terminal's Ctrl-C reaches them once, through us, not twice ("exit at once").
    children = [subprocess.Popen(base + ["--tier", name], env=env, start_new_session=True) for name in names]

    def forward(signum, _frame):
        if signum != signal.SIGHUP:
            sd_notify("STOPPING=1")
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    pending = {name: config.tier(name) for name in names}
    while pending and all(child.poll() is None for child in children):
        pending = {name: t for name, t in pending.items() if not ping(t.endpoint, 0.2, t.curve)}
    if not pending:
        sd_notify(f"READY=1\nSTATUS=serving tiers {', '.join(names)}")
    codes = [child.wait() for child in children]
    return 0 if all(code == 0 for code in codes) else 1


def cmd_install_units(args) -> int:
    """Install the units (ExecStart pointing at this installation) and an example node.toml."""
    exec_path = args.exec_path or shutil.which("hicache-tiers") or os.path.join(os.path.dirname(sys.executable), "hicache-tiers")
    try:
        sources = sorted(f for f in os.listdir(args.source) if f.endswith(".service"))
    except OSError as exc:
        print(f"hicache-tiers: cannot read unit files in {args.source}: {exc.strerror} (pass --source DIR)", file=sys.stderr)
        return 1
    if not sources:
        print(f"hicache-tiers: no unit files in {args.source} (pass --source DIR)", file=sys.stderr)
        return 1
    if not os.access(exec_path, os.X_OK):
        print(f"hicache-tiers: warning: {exec_path} is not an executable; pass --exec PATH", file=sys.stderr)
    _warn_if_hidden_from_units(exec_path)
    config_dir = os.path.abspath(args.config_dir)
    doc_dir = os.path.abspath(args.doc_dir)
    try:
        os.makedirs(args.prefix, exist_ok=True)
        for name in sources:
            with open(os.path.join(args.source, name), encoding="utf-8") as fh:
                text = fh.read()
            text = text.replace(UNIT_EXEC, exec_path).replace(os.path.dirname(SYSTEM_CONFIG) + "/", config_dir + "/")
            text = text.replace(f"file://{DOC_DIR}/", f"file://{doc_dir}/")
            write_file(os.path.join(args.prefix, name), text, 0o644)
            print(f"installed {os.path.join(args.prefix, name)}")
        if os.path.exists(DOC_SOURCE):
            os.makedirs(doc_dir, mode=0o755, exist_ok=True)
            with open(DOC_SOURCE, encoding="utf-8") as fh:
                write_file(os.path.join(doc_dir, "OPERATIONS.md"), fh.read(), 0o644)
            print(f"installed {os.path.join(doc_dir, 'OPERATIONS.md')} (the units' Documentation=)")
        os.makedirs(config_dir, mode=0o755, exist_ok=True)
        for name, text in EXAMPLES.items():
            example = os.path.join(config_dir, name)
            if os.path.exists(example):
                print(f"kept {example} (exists)")
                continue
            write_file(example, text, 0o644)
            print(f"wrote {example} (an example: review it, then `hicache-tiers config check {example}`)")
    except OSError as exc:
        print(f"hicache-tiers: cannot install: {exc}", file=sys.stderr)
        return 1
    print("next: systemctl daemon-reload && systemctl enable --now hicache-tier@dram hicache-tier@nvme")
    return 0


def _warn_if_hidden_from_units(exec_path: str) -> None:
    """The units set ProtectHome= and PrivateTmp=: an install under /home, /root or /tmp cannot start."""
    import tiers
    for what, path in (("executable", os.path.realpath(exec_path)),
                       ("package", os.path.realpath(os.path.dirname(tiers.__file__)))):
        if (path + "/").startswith(HIDDEN_FROM_UNITS):
            print(f"hicache-tiers: warning: the {what} {path} is where the units' ProtectHome=/PrivateTmp= hide it; "
                  "install hicache-tiers system-wide (a root pip install, or a venv under /opt) or relax them "
                  "in a drop-in", file=sys.stderr)
            return


def write_file(path: str, text: str, mode: int) -> None:
    """Write through a temporary file and os.replace: never a half-written unit."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
