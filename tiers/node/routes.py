"""Where each request's work runs in a daemon, declared beside its handler (tiers/node/daemon.py ``handlers``).

Every handler runs on the loop thread and checks its request there (a refusal is answered at once).  A
``LOOP`` handler returns its reply: memory work of microseconds (lookups, stats, releases, a DRAM lease).
Any other returns the work that makes the reply, and its route says where that runs: the I/O pool for
page copies and disk work, so a long batch never stalls a lookup (the reply leaves when the work is done,
through tiers/node/replies.py), or the loop where the work is memory only for this store.
"""
from __future__ import annotations

import enum
from typing import Callable, NamedTuple

from tiers.wire import messages as M


class Where(enum.Enum):
    LOOP = "loop"  # the handler's return is the reply
    POOL = "pool"  # page copies (puts, reads as frames): always in the pool
    STORE_IO = "store_io"  # in the pool for a store that does disk or network I/O (parallel_io), else on the loop
    READ = "read"  # a get: on the loop when it leases pages where they lie (a store with its own arena) or streams


class Route(NamedTuple):
    handler: Callable  # handler(msg, frames): the reply (LOOP), else the work: () -> reply
    where: Where


def answered_early(msg: M.Request, streams: bool) -> bool:
    """A leased get that asks to be streamed, to a daemon that streams (tiers/node/streamed_reads.py): answered
    on the loop before its reads, which run in the pool and time the request when they end."""
    return streams and type(msg) is M.Get and msg.lease is not None and msg.stream


def in_pool(where: Where, msg: M.Request, parallel_io: bool, stages: bool, streams: bool) -> bool:
    """Whether the work of msg on this route runs in the I/O pool; parallel_io: the store does I/O from
    several threads; stages: its pages pass through staging blocks (it exports no arena of its own);
    streams: a leased get that asks for it is answered on the loop, its reads started in the pool
    (tiers/node/streamed_reads.py)."""
    if where is Where.POOL:
        return True
    if where is Where.STORE_IO:
        return parallel_io
    if where is Where.READ:
        return msg.lease is None or (stages and not answered_early(msg, streams))
    return False
