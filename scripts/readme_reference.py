#!/usr/bin/env python3
"""Regenerate the README's option reference from the code (argparse, config schemas, backend settings).

    python3 scripts/readme_reference.py          # print the reference
    python3 scripts/readme_reference.py --write  # replace it in README.md between the markers

tests/test_readme.py fails when the README's copy is out of date, so every
option keeps its README mention.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BEGIN, END = "<!-- reference:begin -->", "<!-- reference:end -->"

NODE_KEY_HELP = {
    "name": "node name in logs and metrics; default: the host name",
    "runtime_dir": "sockets; default $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/hicache-tiers or /tmp/hicache-tiers-UID",
    "data_dir": "NVMe data; default $STATE_DIRECTORY or $XDG_DATA_HOME/hicache-tiers",
    "write_policy": "write_through (default), write_back or selective",
    "log_level": "debug, info (default), warning or error",
    "max_dirty_pages": "acknowledged write-back pages a tier may hold not yet written below, what a crash may "
                       "lose; a put past it writes the oldest below before it is answered (default 1024)",
    "metrics_port": "Prometheus base port: tier i serves on metrics_port + i (default 0: off)",
    "metrics_address": "address the metrics endpoints bind (default 127.0.0.1)",
    "curve_server_key": "CurveZMQ secret key file of this node's tcp:// daemons",
    "curve_client_key": "CurveZMQ secret key file clients of tcp:// daemons use",
    "curve_authorized_keys": "directory of public keys allowed to connect over tcp://",
    "allow_insecure_tcp": "serve tcp:// endpoints without CurveZMQ (default false: refuse to start)",
    "socket_group": "group (name or gid) whose members may connect to the ipc sockets; default none: the "
                    "daemon's account only. Members are served only as a [[tenants]] entry says",
    "demotion_queue_bytes": "pages on their way to the tier below, per daemon (default 256MiB); when the queue "
                            "is full an evicted selective page is dropped and counted (demotion_dropped); "
                            "write-back pages are queued whatever the bound (max_dirty_pages bounds them)",
    "connection_idle_s": "seconds after which a connection of a configured tenant (or of an account in none) "
                         "that sent nothing may be shut to make room for a new one past its share or the node's "
                         "connection budget (default 60); its client reconnects at its next call. The operator's "
                         "connections are never shut",
}
ENVIRONMENT = {
    "HICACHE_TIERS_CONFIG": "node configuration file when --config is not given",
    "HICACHE_TIERS_RUNTIME_DIR": "overrides node.runtime_dir",
    "HICACHE_TIERS_DATA_DIR": "overrides node.data_dir",
    "HICACHE_TIERS_LOG_LEVEL": "overrides node.log_level",
}


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _shown(value) -> str:
    """A default as a user types it: lists comma-joined, checkout paths relative."""
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    # Paths inside the checkout are shown relative to it: the reference must not depend on where it lives.
    return text.replace(ROOT + os.sep, "")


def _default(action) -> str:
    if action.default in (None, False, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
        return ""
    return f"`{_shown(action.default)}`"


def _help(action, prog: str) -> str:
    """The help line as --help prints it (%(default)s and friends expanded)."""
    text = action.help or ""
    if "%" in text:
        params = dict(vars(action), prog=prog, default=_shown(action.default))
        text = text % params
    return text


def _commands(parser: argparse.ArgumentParser, prefix: str, out: list) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                _command(sub, f"{prefix} {name}", helps.get(name, ""), out)


def _command(parser: argparse.ArgumentParser, name: str, summary: str, out: list) -> None:
    options = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and a.help != argparse.SUPPRESS]
    out.append(f"**`{name}`**: {_cell(summary or parser.description or '')}")
    out.append("")
    if options:
        out.append("| option | default | meaning |")
        out.append("|---|---|---|")
        for action in options:
            flag = ", ".join(action.option_strings) or action.metavar or action.dest.upper()
            out.append(f"| `{flag}` | {_default(action)} | {_cell(_help(action, parser.prog))} |")
        out.append("")
    _commands(parser, name, out)


def _options_table(specs: dict, out: list) -> None:
    out.append("| key | default | meaning |")
    out.append("|---|---|---|")
    for key, (_parser, default, help_text) in specs.items():
        shown = "" if default is None else f"`{default}`"
        out.append(f"| `{key}` | {shown} | {_cell(help_text)} |")
    out.append("")


def reference() -> str:
    from hicache_ext.settings import SETTINGS_HELP, BackendSettings
    from tiers.cli import build_parser
    from tiers.ops.config import COMMON_TIER_OPTIONS, KIND_OPTIONS, NODE_KEYS
    from tiers.node.tenants import TENANT_KEY_HELP

    missing = set(NODE_KEYS) ^ set(NODE_KEY_HELP)
    if missing:
        raise SystemExit(f"readme_reference: node keys without help (or stale help): {sorted(missing)}")
    out = ["### Commands", ""]
    _commands(build_parser(), "hicache-tiers", out)
    out += ["### Node configuration (`[node]`)", "", "| key | meaning |", "|---|---|"]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in NODE_KEY_HELP.items()]
    out += ["", "### Quotas (`[quotas]`)", "",
            "`\"PREFIX\" = SIZE`: the pages of every namespace starting with PREFIX (a model name matches all its "
            "shards) may take at most SIZE in any one tier; the longest matching prefix wins. Without a quota a "
            "namespace is held to its fair share only when others need room: capacity / the shares holding pages, "
            "where each of the operator's namespaces is a share and all the namespaces of one [[tenants]] entry "
            "are one (spreading pages over namespaces gains a tenant nothing).",
            ""]
    out += ["### Tenants (`[[tenants]]`)", "",
            "Who may use which namespaces, beside the operator (the daemon's own account, root, and CurveZMQ keys "
            "the node authorized that no tenant names: every namespace and admin). A connection's tenant is what "
            "the kernel (SO_PEERCRED) or the CurveZMQ handshake says, never the message; an account in no tenant "
            "is refused at hello. See docs/RELIABILITY.md (Tenants).", "", "| key | meaning |", "|---|---|"]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in TENANT_KEY_HELP.items()]
    out += ["", "### Tier options (`[[tiers]]`), every kind", ""]
    _options_table(COMMON_TIER_OPTIONS, out)
    for kind, specs in KIND_OPTIONS.items():
        if specs:
            out += [f"### Options of `kind = \"{kind}\"` tiers", ""]
            _options_table(specs, out)
    out += ["### SGLang extra-config keys of the backend", "",
            "Besides SGLang's own (`backend_name`, `module_path`, `class_name`, `interface_v1`, `allocator`, ...):", "",
            "| key | default | meaning |", "|---|---|---|"]
    defaults = BackendSettings()
    for key, help_text in SETTINGS_HELP.items():
        value = getattr(defaults, key)
        out.append(f"| `{key}` | {'' if value is None else f'`{value}`'} | {_cell(help_text)} |")
    out += ["", "### Environment", "", "| variable | meaning |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in ENVIRONMENT.items()]
    return "\n".join(out).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        raise SystemExit("readme_reference: README.md has no reference markers")
    return pattern.sub(lambda _m: f"{BEGIN}\n{body}{END}", readme)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md in place")
    args = parser.parse_args()
    body = reference()
    if not args.write:
        print(body)
        return 0
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(splice(text, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
