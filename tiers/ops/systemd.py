"""Installing the systemd units (scripts/systemd) and the example node and pool configurations.

The units run ``hicache-tiers serve`` under Type=notify with a watchdog and
a hardened sandbox (ProtectHome=, PrivateTmp=, ProtectSystem=strict): an
installation under /home, /root or /tmp cannot start there, which is said at
install time.  docs/OPERATIONS.md is installed beside them (Documentation=).
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

from tiers.ops.config import DEFAULT_CHAIN_TOML, SYSTEM_CONFIG

UNIT_DIR = "/etc/systemd/system"
UNIT_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "systemd")
UNIT_EXEC = "/usr/local/bin/hicache-tiers"  # the ExecStart binary as written in scripts/systemd
DOC_DIR = "/usr/share/doc/hicache-tiers"  # where the units' Documentation= points
DOC_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "OPERATIONS.md")
# ProtectHome= and PrivateTmp= in the units hide these from the daemon.
HIDDEN_FROM_UNITS = ("/home/", "/root/", "/run/user/", "/tmp/", "/var/tmp/")
# The embedded default's tiers, in the directories the units create (RuntimeDirectory=, StateDirectory=).
EXAMPLE_NODE_TOML = """\
# hicache-tiers node configuration (written by `hicache-tiers install-units`).
# Check with `hicache-tiers config check FILE`; see docs/OPERATIONS.md.
# runtime_dir and data_dir are the directories the units create (RuntimeDirectory=,
# StateDirectory=); SGLang and the CLI read them from this file too.  An NVMe
# tier's path elsewhere than under data_dir needs ReadWritePaths= in a unit drop-in.
[node]
log_level = "info"
runtime_dir = "/run/hicache-tiers"
data_dir = "/var/lib/hicache-tiers"
# Prometheus: tier i serves http://metrics_address:(metrics_port + i)/metrics; 0 turns it off.
metrics_port = 9470
metrics_address = "127.0.0.1"
""" + DEFAULT_CHAIN_TOML

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



def install_units(source: str, prefix: str, config_dir: str, doc_dir: str, exec_path: Optional[str] = None) -> int:
    """Install the units of source into prefix (ExecStart: exec_path, default the installed hicache-tiers; the
    configuration in config_dir; Documentation= in doc_dir) and example configurations; an exit code."""
    exec_path = exec_path or shutil.which("hicache-tiers") or os.path.join(os.path.dirname(sys.executable),
                                                                           "hicache-tiers")
    try:
        sources = sorted(f for f in os.listdir(source) if f.endswith(".service"))
    except OSError as exc:
        print(f"hicache-tiers: cannot read unit files in {source}: {exc.strerror} (pass --source DIR)", file=sys.stderr)
        return 1
    if not sources:
        print(f"hicache-tiers: no unit files in {source} (pass --source DIR)", file=sys.stderr)
        return 1
    if not os.access(exec_path, os.X_OK):
        print(f"hicache-tiers: warning: {exec_path} is not an executable; pass --exec PATH", file=sys.stderr)
    _warn_if_hidden_from_units(exec_path)
    config_dir = os.path.abspath(config_dir)
    doc_dir = os.path.abspath(doc_dir)
    try:
        os.makedirs(prefix, exist_ok=True)
        for name in sources:
            with open(os.path.join(source, name), encoding="utf-8") as fh:
                text = fh.read()
            text = text.replace(UNIT_EXEC, exec_path).replace(os.path.dirname(SYSTEM_CONFIG) + "/", config_dir + "/")
            text = text.replace(f"file://{DOC_DIR}/", f"file://{doc_dir}/")
            write_file(os.path.join(prefix, name), text, 0o644)
            print(f"installed {os.path.join(prefix, name)}")
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
