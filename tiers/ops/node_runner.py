"""Start, stop, kill and restart a node's tier daemons as real processes.

Used by ``hicache-tiers demo``, the benchmarks and the tests: each tier runs
as ``python -m tiers.cli serve --tier NAME`` exactly as systemd runs it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence

import zmq

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire import security
from tiers.ops.config import NodeConfig, parse_config


class NodeRunner:
    """The daemons of one node configuration, each in its own process."""

    def __init__(self, config_text: str, runtime_dir: str, data_dir: str, config_path: Optional[str] = None,
                 log_path: Optional[str] = None, log_level: str = "warning", launcher: Sequence[str] = ()):
        self.runtime_dir = runtime_dir
        self.data_dir = data_dir
        self.config_path = config_path or os.path.join(runtime_dir, "node.toml")
        os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
        with open(self.config_path, "w", encoding="utf-8") as fh:
            fh.write(config_text)
        self.config: NodeConfig = parse_config(config_text, self.config_path, runtime_dir=runtime_dir, data_dir=data_dir)
        self.log_path = log_path or os.path.join(runtime_dir, "daemons.log")
        self.log_level = log_level
        self.procs: Dict[str, subprocess.Popen] = {}
        self.limit_fds: Optional[tuple] = None  # RLIMIT_NOFILE (soft, hard) of daemons started from now on
        # A prefix that runs each daemon elsewhere (``ip netns exec NS``: a node of a cluster rehearsal). Its
        # tcp:// endpoints may not be reachable from here, so readiness then comes by systemd's notify
        # protocol over a unix socket in runtime_dir (a path: it crosses network namespaces).
        self.launcher = list(launcher)
        self._notify: Dict[str, socket.socket] = {}

    def command(self, tier: str) -> list:
        return [*self.launcher, sys.executable, "-m", "tiers.cli", "serve", "--config", self.config_path, "--runtime-dir",
                self.runtime_dir, "--data-dir", self.data_dir, "--tier", tier, "--log-level", self.log_level]

    def start(self, tier: Optional[str] = None, timeout: float = 30.0, env: Optional[Dict[str, str]] = None) -> None:
        """Start one tier (or all) and wait until each answers a hello; env: variables added for these daemons."""
        names = [tier] if tier else [t.name for t in self.config.tiers]
        log = open(self.log_path, "ab")
        for name in names:
            if name in self.procs and self.procs[name].poll() is None:
                continue
            environ = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
            if self.launcher:
                environ["NOTIFY_SOCKET"] = self._notify_socket(name)
            self.procs[name] = subprocess.Popen(self.command(name), stdout=log, stderr=log, env=environ,
                                                preexec_fn=self._limits if self.limit_fds else None)
        log.close()
        try:
            for name in names:
                self.wait_ready(name, timeout)
        except BaseException:
            self.kill(tier)  # a start that fails leaves no daemon behind
            raise

    def _limits(self) -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, self.limit_fds)

    def _notify_socket(self, tier: str) -> str:
        old = self._notify.pop(tier, None)
        if old is not None:
            old.close()
        path = os.path.join(self.runtime_dir, f".notify-{tier}")
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(path)
        self._notify[tier] = sock
        return path

    def _notified_ready(self, tier: str, wait: float) -> bool:
        sock = self._notify[tier]
        sock.settimeout(wait)
        try:
            return b"READY=1" in sock.recv(4096).split(b"\n")
        except socket.timeout:
            return False

    def wait_ready(self, tier: str, timeout: float = 30.0) -> None:
        endpoint, curve = self.config.tier(tier).endpoint, self.config.tier(tier).curve
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            proc = self.procs.get(tier)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"tier {tier} exited with {proc.returncode}; see {self.log_path}")
            if tier in self._notify:
                if self._notified_ready(tier, 0.1):
                    return
                continue
            if ping(endpoint, 0.5, curve):
                return
            time.sleep(0.05)
        raise TimeoutError(f"tier {tier} did not answer within {timeout}s; see {self.log_path}")

    def stop(self, tier: Optional[str] = None, timeout: float = 30.0) -> Dict[str, int]:
        """SIGTERM (graceful) and wait; returns exit codes."""
        return self._signal(tier, signal.SIGTERM, timeout)

    def kill(self, tier: Optional[str] = None) -> Dict[str, int]:
        """SIGKILL: a crash, no flushing."""
        return self._signal(tier, signal.SIGKILL, 10.0)

    def _signal(self, tier: Optional[str], signum: int, timeout: float) -> Dict[str, int]:
        names = [tier] if tier else list(self.procs)
        codes = {}
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is not None:
                codes[name] = wait_or_kill(proc, timeout)
            notify = self._notify.pop(name, None)
            if notify is not None:
                notify.close()
        return codes

    def pid(self, tier: str) -> int:
        return self.procs[tier].pid

    def __enter__(self) -> "NodeRunner":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    """Its exit code, waiting at most timeout before SIGKILL."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM a process (a helper the demo, benchmarks or tests started), SIGKILL after timeout; its exit code."""
    if proc.poll() is None:
        proc.terminate()
    return wait_or_kill(proc, timeout)


def ping(endpoint: str, timeout: float = 0.5, curve: Optional[security.CurveSettings] = None) -> bool:
    """True when a daemon answers a hello on endpoint within timeout."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A daemon still starting has no socket yet: libzmq retries the connect every RECONNECT_IVL (100 ms by
    # default), which a start's wait would add to every restart it times.
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    try:
        security.apply_client(sock, endpoint, curve)  # CurveZMQ keys of a tcp:// endpoint that has them
        sock.connect(endpoint)
        sock.send_multipart([P.request("hello", 1, ns="_ping", client="ping")])
        if not sock.poll(int(timeout * 1000)):
            return False
        return M.decode_reply("hello", sock.recv_multipart()[0]).ok
    except (zmq.ZMQError, P.ProtocolError):
        return False
    finally:
        sock.close(linger=0)
