"""What each peer of a daemon leaves waiting: page replies it has not read, work in flight.

A reply of pages leaves the daemon without a copy (zero-copy frames), and
libzmq holds it until the peer reads it: a peer that asks and never reads
would make the daemon hold every reply, up to the high-water mark of 64
messages (8 peers x 64 reads of 4 MiB grew a daemon by 2 GiB).  So a frames
read is refused (``busy``) while its peer has PEER_UNREAD_BYTES of replies
unread, or PEER_FRAME_READS requests in flight (a client calls one at a time a
thread), or all peers together leave the daemon's ``max_inflight_bytes``
unread.  Leased reads (the engine copies out of the arena) hold nothing here.
A disk tier's puts, clears, deletes and evictions run in the I/O pool too and
are counted the same way: a peer that sends them without waiting for the
replies queues at most PEER_FRAME_READS of them (a put naming a host pool
carries no bytes, so the daemon's byte bound never saw a flood of them: 200
sent at once held every I/O thread and the staging arena ahead of everyone).
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Tuple

import zmq

from tiers.wire import protocol as P

PEER_UNREAD_BYTES = 64 << 20
PEER_FRAME_READS = 4


class PeerReplies:
    def __init__(self, max_unread_bytes: int):
        self.max_unread_bytes = max_unread_bytes
        self._unread: Dict[bytes, Deque[Tuple[zmq.MessageTracker, int]]] = {}
        self._unread_bytes = 0
        self._reads: Dict[bytes, int] = {}  # frames reads and pool store work in flight, by peer
        self.refused = 0

    def admit(self, ident: bytes) -> None:
        """A frames read (or pool store work) of this peer may start (ProtocolError busy if not); call started()
        when it does."""
        mine = self._settle(ident)
        if self._unread_bytes > self.max_unread_bytes:
            self.prune()
        reads = self._reads.get(ident, 0)
        if mine > PEER_UNREAD_BYTES or reads >= PEER_FRAME_READS or self._unread_bytes > self.max_unread_bytes:
            self.refused += 1
            raise P.ProtocolError("busy", f"this peer has {mine} bytes of replies unread and {reads} reads in flight "
                                          f"({self._unread_bytes} bytes unread by all); read them first")

    def started(self, ident: bytes) -> None:
        self._reads[ident] = self._reads.get(ident, 0) + 1

    def finished(self, ident: bytes) -> None:
        left = self._reads.get(ident, 0) - 1
        if left > 0:
            self._reads[ident] = left
        else:
            self._reads.pop(ident, None)

    def sent(self, ident: bytes, tracker, nbytes: int) -> None:
        """A reply of nbytes left without a copy; tracker says when libzmq let go of it."""
        if tracker is not None and not tracker.done:
            self._unread.setdefault(ident, deque()).append((tracker, nbytes))
            self._unread_bytes += nbytes

    def _settle(self, ident: bytes) -> int:
        """Forget the peer's replies libzmq let go of; the bytes it still leaves unread."""
        pending = self._unread.get(ident)
        if not pending:
            return 0
        while pending and pending[0][0].done:
            self._unread_bytes -= pending.popleft()[1]
        if not pending:
            del self._unread[ident]
            return 0
        return sum(n for _t, n in pending)

    def prune(self) -> None:
        """Settle every peer (housekeeping): peers that left or read are forgotten."""
        for ident in list(self._unread):
            self._settle(ident)

    def unread_bytes(self) -> int:
        return self._unread_bytes
