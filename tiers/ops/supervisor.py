"""Running tier daemons: one in this process (with systemd's notify protocol), or one child per tier.

Under systemd a daemon follows the notify protocol: READY=1 once its sockets
are bound, WATCHDOG=1 every WatchdogSec/2, RELOADING=1 then READY=1 around a
SIGHUP reload, STOPPING=1 on the way out.  The first SIGTERM/SIGINT drains
(stop accepting, finish in-flight requests, flush) and exits 0; a second one
exits at once with 1.  ``hicache-tiers serve`` (tiers/cli/serve.py) calls these.

A daemon whose loop stops making progress writes every thread's stack to its
log (stderr: the journal under systemd): when its loop has not ticked for at
most two thirds of WatchdogSec (LOOP_STALL_S without systemd's watchdog), and when
killed by SIGABRT, which is what systemd's watchdog sends a daemon that
stopped pinging it (WatchdogSec=30s in the units).  A hang is then a stack to
read, not a silence.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional

import zmq

from tiers.ops.config import ConfigError, NodeConfig, TierConfig

log = logging.getLogger("hicache.serve")

LOOP_STALL_S = 20.0  # without systemd's watchdog: a loop that has not ticked (every 0.5 s) for this long dumps

# Node keys the running daemon uses: a change needs a restart (log_level applies live).
RESTART_NODE_KEYS = ("runtime_dir", "data_dir", "max_dirty_pages", "metrics_address")


def serve_one(config: NodeConfig, tier_name: str, reload_config: Optional[Callable[[], NodeConfig]] = None) -> int:
    """Run one tier's daemon in this process until SIGTERM/SIGINT; SIGHUP reloads."""
    from tiers.ops.notify import sd_notify, watchdog_interval
    from tiers.stores.base import StoreError
    from tiers.ops.tier_factory import build_daemon

    tier = config.tier(tier_name)
    exporter = None
    try:
        daemon = build_daemon(config, tier)
        if tier.metrics_port:  # prometheus_client only where metrics are on (40 ms of a daemon's start)
            from tiers.ops.prometheus import start_exporter
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

    faulthandler.enable()  # SIGABRT (systemd's watchdog), SIGSEGV, SIGBUS: every thread's stack to stderr
    stall_s = 4 * interval / 3 if interval else LOOP_STALL_S  # interval is half of WatchdogSec
    armed = [-stall_s]

    def tick():
        # Re-armed a few times a stall window, not every tick: each arming starts faulthandler's timer thread
        # and joins the last one, on the loop.  A stall is reported after 3/4 to all of stall_s.
        if time.monotonic() - armed[0] >= stall_s / 4:
            faulthandler.dump_traceback_later(stall_s)
            armed[0] = time.monotonic()
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
        faulthandler.cancel_dump_traceback_later()
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


def supervise(config: NodeConfig, names: List[str], serve_flags: List[str]) -> int:
    """One child process per tier (``hicache-tiers serve SERVE_FLAGS --tier NAME``); signals are passed on;
    READY=1 once every child answers."""
    from tiers.ops.node_runner import ping
    from tiers.ops.notify import sd_notify

    base = [sys.executable, "-m", "tiers.cli", "serve", *serve_flags]
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
