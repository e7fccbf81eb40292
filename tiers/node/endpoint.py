"""A daemon's endpoint: the ROUTER socket bound safely (private ipc files, CurveZMQ on tcp://).

ipc:// sockets are created 0600, under umask 077, in a 0700 directory, so no
other account can connect at any moment; a tcp:// endpoint needs CurveZMQ
keys (or allow_insecure_tcp), else ValueError and the daemon refuses to start
(tiers/wire/security.py).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import zmq

from tiers.wire import security

log = logging.getLogger("hicache.daemon")


def private_dir(path: str) -> None:
    """Create path 0700, or tighten it to 0700 when it is ours and open to others (a log line says so)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        log.info("runtime directory %s was mode %o; now 0700 (sockets are for this account only)",
                 path, st.st_mode & 0o777)
        os.chmod(path, 0o700)


def bind_router(context: zmq.Context, endpoint: str, name: str, curve: security.CurveSettings, max_msg_bytes: int,
                hwm: int) -> Tuple[zmq.Socket, Optional[security.Admission]]:
    """A ROUTER bound to endpoint, and its CurveZMQ admission (None for ipc:// and insecure tcp://)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        private_dir(os.path.dirname(path))
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a killed daemon
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    router.setsockopt(zmq.RCVHWM, hwm)
    router.setsockopt(zmq.SNDHWM, hwm)
    admission = None
    try:
        admission = security.secure_router(router, context, endpoint, name, curve)
        old_umask = os.umask(0o077)  # no moment where the socket file is open to others
        try:
            router.bind(endpoint)
        finally:
            os.umask(old_umask)
    except BaseException:
        router.close(linger=0)
        if admission is not None:
            admission.close()
        raise
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)
    return router, admission


def physical_memory() -> int:
    """Bytes of RAM: no host pool can be larger (the default bound on a registered region)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40
