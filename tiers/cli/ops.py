"""Operator commands: ``status``, ``stats``, ``evict``, ``clear`` (through an ``_admin`` session)
and ``config check`` / ``config show``.

Exit codes: 0 success, 1 a tier is down or refused, 2 usage or configuration error.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

from tiers.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from tiers.cli.serve import add_config_args, config_from_args, config_path
from tiers.wire.client import Deadlines, TierClient
from tiers.wire.security import refused_before_heard
from tiers.wire import messages as M
from tiers.ops.config import NODE_KEYS, ConfigError, NodeConfig, TierConfig, load_config, parse_size
from tiers.node.sessions import ADMIN_NAMESPACE
from tiers.logs import setup_logging

SIZE_KEYS = ("capacity", "max_page_bytes", "block_size")


def register(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_config_args(common)
    common.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="error",
                        help="log verbosity of this command (default error)")

    def ops_parser(name: str, help_: str, description: str, timeout: float) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_,
                           description=f"{description} Exit codes: 0 ok, 1 a tier is down or refused, "
                                       "2 usage or configuration error.")
        p.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                       help=f"how long each tier may take to answer (default {timeout:g})")
        return p

    p = ops_parser("status", "a table of every configured tier: usage, hit rate, evictions, sessions",
                   "Ask every configured tier for its stats and print one row per tier; a tier that does not "
                   "answer is shown as down.", 2.0)
    p.add_argument("--tier", action="append", metavar="NAME", help="only this tier (repeatable)")
    p.set_defaults(func=cmd_status)

    p = ops_parser("stats", "every counter of every tier (text or --json)",
                   "Print every counter the tiers report; with --json one object keyed by tier name "
                   "(null for a tier that does not answer).", 2.0)
    p.add_argument("--tier", action="append", metavar="NAME", help="only this tier (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_stats)

    p = ops_parser("evict", "evict pages from a tier by its eviction policy",
                   "Evict pages by the tier's policy until SIZE bytes are freed (or the tier is empty), "
                   "across every namespace unless --namespace is given.", 60.0)
    p.add_argument("--tier", required=True, metavar="NAME", help="the tier to evict from")
    p.add_argument("--bytes", required=True, metavar="SIZE", help="bytes to free (4GiB, 512MB, 65536)")
    p.add_argument("--namespace", metavar="NS", help="only pages of this namespace (one engine's model)")
    p.set_defaults(func=cmd_evict)

    p = ops_parser("clear", "remove every page of a namespace, or of every namespace, from a tier",
                   "Remove pages from a tier: those of --namespace NS, or every page with --all.", 60.0)
    p.add_argument("--tier", required=True, metavar="NAME", help="the tier to clear")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="NS", help="only pages of this namespace")
    which.add_argument("--all", action="store_true", help="every page of every namespace")
    p.set_defaults(func=cmd_clear)

    p = sub.add_parser("config", help="check or show the node configuration",
                       description="Check a configuration file, or show the effective configuration. "
                                   "Exit codes: 0 valid, 2 invalid or usage error.")
    config_sub = p.add_subparsers(dest="config_command", metavar="ACTION")
    p.set_defaults(func=lambda args: p.print_help() or EXIT_USAGE)
    c = config_sub.add_parser("check", help="validate FILE and print a summary",
                              description="Validate FILE: exit 0 and a summary when valid, exit 2 and the "
                                          "error (file, key, what is allowed) otherwise.")
    c.add_argument("file", metavar="FILE", help="the TOML file to check")
    c.set_defaults(func=cmd_config_check)
    c = config_sub.add_parser("show", help="print the effective configuration as TOML",
                              description="Print the configuration in effect after flags, environment "
                                          "(HICACHE_TIERS_RUNTIME_DIR, _DATA_DIR, _LOG_LEVEL), file and "
                                          "defaults, as TOML that `config check` accepts.")
    add_config_args(c)
    c.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="as serve --log-level")
    c.set_defaults(func=cmd_config_show)


# --------------------------------------------------------------- helpers

def fail(message: str, code: int) -> int:
    print(f"hicache-tiers: {message}", file=sys.stderr)
    return code


def config_errors_exit_2(command):
    """A command whose configuration mistakes (unknown tier, invalid file, bad size) exit 2 with the message."""
    @functools.wraps(command)
    def run(args) -> int:
        try:
            return command(args)
        except ConfigError as exc:
            return fail(str(exc), EXIT_USAGE)
    return run


def human(nbytes: float) -> str:
    """4294967296 -> '4.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def peers(stats: dict) -> str:
    """Pools a remote tier reaches ('2/3 pools up'), '-' for tiers without peers."""
    if "pools" not in stats:
        return "-"
    return f"{stats['pools'] - stats.get('pools_down', 0)}/{stats['pools']} pools up"


def admin_client(tier: TierConfig, timeout: float) -> TierClient:
    """A session in the _admin namespace: may act on every namespace."""
    deadlines = Deadlines(base=timeout, lookup=timeout, connect_wait=min(timeout, 1.0))
    return TierClient(tier.name, tier.endpoint, ADMIN_NAMESPACE, client_name=f"hicache-tiers-cli-{os.getpid()}",
                      deadlines=deadlines, curve=tier.curve)


def selected_tiers(args) -> List[TierConfig]:
    """The node's tiers (or those named by --tier); ConfigError for an unknown name."""
    setup_logging(args.log_level)
    config = config_from_args(args)
    names = args.tier if isinstance(args.tier, list) else [args.tier] if args.tier else None
    return [config.tier(name) for name in names] if names else config.tiers


def report_down(tiers: List[TierConfig], results: Dict[str, Optional[dict]]) -> bool:
    """Name the tiers that gave no answer on stderr, each with why when the reason is known before asking
    (no client key); True when there were any."""
    down = []
    for tier in tiers:
        if results[tier.name] is None:
            why = refused_before_heard(tier.curve, tier.endpoint)
            down.append(f"{tier.name} ({why})" if why else tier.name)
    if down:
        print(f"down: {', '.join(down)}", file=sys.stderr)
    return bool(down)


def query_stats(tiers: List[TierConfig], timeout: float) -> Dict[str, Optional[dict]]:
    """Each tier's stats, or None for a tier that does not answer."""
    out = {}
    for tier in tiers:
        client = admin_client(tier, timeout)
        try:
            out[tier.name] = client.stats()
        finally:
            client.close()
    return out


def admin_call(args, op: str, **fields) -> Tuple[int, Optional[M.Reply]]:
    """One admin operation on --tier: (exit code, the operation's reply Struct, None on failure)."""
    tier = selected_tiers(args)[0]
    client = admin_client(tier, args.timeout)
    try:
        reply = client.call(op, args.timeout, **fields)
    finally:
        client.close()
    if reply is None:
        why = refused_before_heard(tier.curve, tier.endpoint)
        return fail(f"tier {tier.name} at {tier.endpoint} did not answer within {args.timeout:g}s"
                    + (f": {why}" if why else ""), EXIT_FAILED), None
    if not reply.header.ok:
        return fail(f"tier {tier.name} refused {op}: {reply.header.code}: {reply.header.msg}", EXIT_FAILED), None
    return EXIT_OK, reply.header


# -------------------------------------------------------------- commands

@config_errors_exit_2
def cmd_status(args) -> int:
    tiers = selected_tiers(args)
    results = query_stats(tiers, args.timeout)
    header = ("TIER", "KIND", "STATE", "CAPACITY", "USED", "PAGES", "HIT RATE", "EVICTIONS", "DIRTY", "SESSIONS", "REGIONS",
              "PEERS")
    rows = [header]
    for tier in tiers:
        s = results[tier.name]
        if s is None:
            rows.append((tier.name, tier.kind, "down", human(tier.capacity)) + ("-",) * (len(header) - 4))
            continue
        lookups = s.get("hits", 0) + s.get("misses", 0)
        capacity = s.get("capacity_bytes", 0)
        used = s.get("used_bytes", 0)
        rows.append((tier.name, tier.kind, "up", human(capacity),
                     f"{human(used)} ({100 * used / capacity:.0f}%)" if capacity else human(used),
                     str(s.get("pages", 0)), f"{100 * s.get('hits', 0) / lookups:.1f}%" if lookups else "-",
                     str(s.get("evictions", 0)), str(s.get("dirty_pages", 0)), str(s.get("sessions", 0)),
                     str(s.get("regions", 0)), peers(s)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return EXIT_FAILED if report_down(tiers, results) else EXIT_OK


@config_errors_exit_2
def cmd_stats(args) -> int:
    tiers = selected_tiers(args)
    results = query_stats(tiers, args.timeout)
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        for name, stats in results.items():
            print(f"[{name}]" + ("" if stats is not None else " down"))
            for key, value in sorted((stats or {}).items()):
                print(f"{key} = {json.dumps(value, sort_keys=True)}")
    return EXIT_FAILED if report_down(tiers, results) else EXIT_OK


@config_errors_exit_2
def cmd_evict(args) -> int:
    fields = {"bytes": parse_size(args.bytes, "--bytes")}
    if args.namespace:
        fields["ns"] = args.namespace
    code, reply = admin_call(args, "evict", **fields)
    if code != EXIT_OK:
        return code
    print(f"tier {args.tier}: evicted {reply.evicted_pages} pages, {reply.evicted_bytes} bytes "
          f"({human(reply.evicted_bytes)})" + (f" of namespace {args.namespace}" if args.namespace else ""))
    return EXIT_OK


@config_errors_exit_2
def cmd_clear(args) -> int:
    code, reply = admin_call(args, "clear", **({"all": True} if args.all else {"ns": args.namespace}))
    if code != EXIT_OK:
        return code
    print(f"tier {args.tier}: cleared {reply.cleared or 0} pages"
          + ("" if args.all else f" of namespace {args.namespace}"))
    return EXIT_OK


def cmd_config_check(args) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        if len(exc.problems) == 1:
            return fail(exc.problems[0], EXIT_USAGE)
        for problem in exc.problems:
            fail(problem, EXIT_USAGE)
        return fail(f"{args.file}: {len(exc.problems)} errors", EXIT_USAGE)
    disk_errors = disk_problems(config)
    for level, message in disk_errors:
        print(f"{args.file}: {level}: {message}", file=sys.stderr)
    if any(level == "error" for level, _ in disk_errors):
        return EXIT_USAGE
    metrics = (f"metrics on {config.metrics_address}" if any(t.metrics_port for t in config.tiers) else "metrics off")
    print(f"{args.file}: valid")
    print(f"node {config.node_name}: write_policy {config.write_policy}, log_level {config.log_level}, "
          f"runtime_dir {config.runtime_dir}, data_dir {config.data_dir}, {metrics}")
    for tier in config.tiers:
        port = f", metrics port {tier.metrics_port}" if tier.metrics_port else ""
        print(f"  tier {tier.name}: {tier.kind}, {human(tier.capacity)}, policy {tier.policy}, {tier.endpoint}{port}")
    return EXIT_OK


def disk_problems(config) -> list:
    """NVMe capacities against the disk under their path on this machine: (level, message) pairs."""
    out = []
    for tier in config.tiers:
        if tier.kind != "nvme":
            continue
        path = tier.options.get("path") or ""
        existing = path
        while existing and not os.path.exists(existing):
            existing = os.path.dirname(existing.rstrip(os.sep)) or os.sep
        if not existing:
            continue
        usage = shutil.disk_usage(existing)
        if tier.capacity > usage.total:
            out.append(("error", f"tier {tier.name}: capacity {human(tier.capacity)} is more than the whole disk "
                                 f"under {path} ({human(usage.total)})"))
        elif tier.capacity > usage.free:
            out.append(("warning", f"tier {tier.name}: capacity {human(tier.capacity)} is more than the "
                                   f"{human(usage.free)} free under {path}; the tier evicts when the disk fills"))
    return out


@config_errors_exit_2
def cmd_config_show(args) -> int:
    config = config_from_args(args)
    sys.stdout.write(to_toml(config, config_path(args) or "<embedded default>"))
    return EXIT_OK


# ------------------------------------------------------------------ TOML

def toml_line(key: str, value: Any) -> str:
    """One key = value line (tomli-w writes the value), sizes annotated for people."""
    import tomli_w
    comment = f"  # {human(value)}" if key in SIZE_KEYS and isinstance(value, int) else ""
    return tomli_w.dumps({key: list(value) if isinstance(value, tuple) else value}).rstrip("\n") + comment + "\n"


def to_toml(config: NodeConfig, source: str) -> str:
    """The effective configuration as TOML that parse_config accepts."""
    out = [f"# effective configuration from {source} (flags > environment > file > defaults)\n", "[node]\n"]
    for f in dataclasses.fields(config):
        key = "name" if f.name == "node_name" else f.name
        if key in NODE_KEYS:
            out.append(toml_line(key, getattr(config, f.name)))
    for tier in config.tiers:
        out.append("\n[[tiers]]\n")
        for f in dataclasses.fields(tier):
            if f.name not in ("options", "curve"):  # curve: derived from the node's keys
                out.append(toml_line(f.name, getattr(tier, f.name)))
        for key, value in tier.options.items():
            out.append(toml_line(key, value))
    return "".join(out)
