"""systemd's notify protocol (sd_notify), without libsystemd.

A no-op when NOTIFY_SOCKET is unset, so the same daemon runs under systemd
and in a terminal.
"""
from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Send state (e.g. 'READY=1') to systemd; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or 0 when off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return 0.0
    try:
        return int(usec) / 2e6
    except ValueError:
        return 0.0
