"""How long a client's calls may take: a call's give-up time from its bytes, back-off, the reply spin."""
from __future__ import annotations

from dataclasses import dataclass

from tiers.wire import held_wait


@dataclass
class Deadlines:
    """How long a call may take: base + bytes / min_bandwidth."""

    base: float = 1.0  # seconds for any call
    min_bandwidth: float = 100e6  # bytes/s below which a transfer is given up (a loaded disk does 0.2 GB/s)
    lookup: float = 0.5  # seconds for a lookup
    margin: float = 0.1  # the daemon's deadline is this much earlier than ours
    connect_wait: float = 0.5  # at most this (and half the call's timeout) for a connection to come up; a put
    # waits half its timeout (tiers/wire/channel.py send)
    backoff_min: float = 0.2
    backoff_max: float = 5.0
    # A daemon that refuses connections (killed, restarting) is tried again at least this often, so
    # service is back within about this long after it answers; one that connects and stays silent
    # costs a deadline a try and backs off up to backoff_max.
    reconnect_max: float = 0.5  # a refused ipc connect costs microseconds: trying twice a second is free
    # hello, lookups and leased gets wait this long for their reply holding the GIL (tiers/wire/held_wait.py);
    # 0: every call waits without it
    reply_spin: float = held_wait.DEFAULT_REPLY_SPIN_S

    def for_bytes(self, nbytes: int) -> float:
        return self.base + nbytes / self.min_bandwidth
