"""Helpers of the operations tests: a fake systemd notify socket and a daemon process run as systemd runs it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from tiers.ops.node_runner import ping
from tests.support.nodes import dram_tier, node_toml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NotifyListener:
    """The AF_UNIX datagram socket systemd would listen on (NOTIFY_SOCKET)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages: List[str] = []

    def wait_for(self, field: str, timeout: float = 20.0) -> str:
        """The next message holding field (e.g. 'READY=1'); earlier ones are kept in messages."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                message = self.sock.recv(4096).decode()
            except socket.timeout:
                break
            self.messages.append(message)
            if field in message.split("\n"):
                return message
        raise TimeoutError(f"no {field} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dram_node(*names_and_capacities, log_level: str = "info") -> str:
    """A node of DRAM tiers ((name, capacity) pairs; default one 32 MiB "dram")."""
    tiers = names_and_capacities or (("dram", "32MiB"),)
    return node_toml(*(dram_tier(capacity, name=name, block_size="64KiB") for name, capacity in tiers),
                     log_level=log_level)


class DaemonProcess:
    """``hicache-tiers serve --config FILE --tier NAME`` with systemd's environment."""

    def __init__(self, workdir: str, config_text: str, tier: Optional[str] = "dram", watchdog_usec: Optional[int] = None,
                 env: Optional[Dict[str, str]] = None):
        self.workdir = workdir
        self.config_path = os.path.join(workdir, "node.toml")
        self.write_config(config_text)
        self.runtime_dir = os.path.join(workdir, "run")
        self.endpoint = f"ipc://{self.runtime_dir}/{tier or 'dram'}.sock"
        self.notify = NotifyListener(os.path.join(workdir, "notify.sock"))
        self.log_path = os.path.join(workdir, f"{tier or 'node'}.log")
        self.signalled = False
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHE_TIERS_", "WATCHDOG_"))}
        child_env.update(NOTIFY_SOCKET=self.notify.path, PYTHONUNBUFFERED="1", PYTHONPATH=REPO,
                         HICACHE_TIERS_RUNTIME_DIR=self.runtime_dir,
                         HICACHE_TIERS_DATA_DIR=os.path.join(workdir, "data"))
        if watchdog_usec:
            child_env["WATCHDOG_USEC"] = str(watchdog_usec)
        child_env.update(env or {})
        with open(self.log_path, "ab") as log:
            only = ["--tier", tier] if tier else []  # no tier: every tier, one child process each
            self.proc = subprocess.Popen([sys.executable, "-m", "tiers.cli", "serve", "--config", self.config_path,
                                          *only], stdout=log, stderr=log, env=child_env, cwd=REPO)

    def write_config(self, text: str) -> None:
        with open(self.config_path, "w", encoding="utf-8") as fh:
            fh.write(text)

    def wait_ready(self, timeout: float = 30.0) -> str:
        message = self.notify.wait_for("READY=1", timeout)
        assert ping(self.endpoint, 5.0), "READY=1 arrived but the daemon does not answer"
        return message

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.signalled = self.signalled or signum in (signal.SIGTERM, signal.SIGINT)
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None and not self.signalled:
            self.proc.send_signal(signal.SIGTERM)  # a second one would mean "exit at once"
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.notify.close()
        return code
