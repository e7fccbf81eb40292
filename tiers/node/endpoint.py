"""A daemon's endpoint: the ROUTER socket bound safely (private ipc files, CurveZMQ on tcp://).

ipc:// sockets are created 0600, under umask 077, in a 0700 directory, so no
other account can connect at any moment; with ``node.socket_group`` they are
opened to that group afterwards (socket 0660, directory 0710: members may
connect, not list), and who connects is then the kernel's word
(tiers/node/tenants.py).  A tcp:// endpoint needs CurveZMQ keys (or
allow_insecure_tcp), else ValueError and the daemon refuses to start
(tiers/wire/security.py).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import zmq

from tiers.wire import security

log = logging.getLogger("hicache.daemon")

# libzmq drops a tcp connection whose ZMTP/CurveZMQ handshake is not done by then (its default is 30 s): a
# client's takes milliseconds, a connection opened and left silent holds a descriptor until it goes.
HANDSHAKE_S = 5.0


def private_dir(path: str, group: Optional[int] = None) -> None:
    """Create path 0700, or tighten it to 0700 when it is ours and open to others (a log line says so);
    with group, 0710 owned by that group (its members reach the sockets inside, and list nothing)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    want = 0o710 if group is not None else 0o700
    if st.st_uid != os.getuid():
        return
    if group is not None and st.st_gid != group:
        os.chown(path, -1, group)
    if st.st_mode & 0o777 != want:
        if st.st_mode & 0o077 & ~want:
            log.info("runtime directory %s was mode %o; now %o", path, st.st_mode & 0o777, want)
        os.chmod(path, want)


def open_socket_file(path: str, group: Optional[int]) -> None:
    """A socket file just bound (0600 under umask 077): the group's too (0660) when one is configured."""
    if group is None:
        os.chmod(path, 0o600)
        return
    os.chown(path, -1, group)
    os.chmod(path, 0o660)


def bind_router(context: zmq.Context, endpoint: str, name: str, curve: security.CurveSettings, max_msg_bytes: int,
                hwm: int, socket_gid: Optional[int] = None) -> Tuple[zmq.Socket, Optional[security.Admission]]:
    """A ROUTER bound to endpoint, and its CurveZMQ admission (None for ipc:// and insecure tcp://)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        private_dir(os.path.dirname(path), socket_gid)
        if os.path.exists(path):
            os.unlink(path)  # a stale socket from a killed daemon
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    router.setsockopt(zmq.RCVHWM, hwm)
    router.setsockopt(zmq.SNDHWM, hwm)
    # A reply to a peer whose queue is full (it does not read) or that is gone raises instead of being dropped
    # silently, so the daemon counts it (reply_dropped, reply_unroutable).
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if endpoint.startswith("tcp://"):
        router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
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
        open_socket_file(endpoint[len("ipc://"):], socket_gid)
    return router, admission


def physical_memory() -> int:
    """Bytes of RAM: no host pool can be larger (the default bound on a registered region)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40
