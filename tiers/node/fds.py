"""File descriptors of a daemon: raise the soft limit to the hard one, and count what is open.

libzmq aborts the whole process when its ipc listener cannot accept for lack
of descriptors (EMFILE in ipc_listener.cpp), and it has no way to pause
accepting (unbinding also drops every connection accepted through the
endpoint).  So a daemon starts with its soft RLIMIT_NOFILE raised to the hard
limit: the common soft limit of 1,024 would fall to about a thousand idle
local connections, while the systemd units' LimitNOFILE=65536 takes tens of
thousands.  The count of open descriptors is in stats (``open_fds``) and
Prometheus, so an operator sees a client hoarding connections long before.
"""
from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("hicache.fds")


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_fds() -> int:
    """Descriptors this process has open."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
