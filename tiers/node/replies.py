"""How a daemon's replies leave: from the loop at once, or from the I/O pool through a wake pipe.

Only the loop thread touches the ROUTER (a ZeroMQ socket is not thread-safe).
A request whose work runs in the pool leaves a Future; when it is done, its
reply is queued here and a byte written to a pipe the loop polls, and the
loop sends it.  Each such request's frames count against the daemon's
``max_inflight_bytes`` until its reply is queued, and (``counted``) as its
peer's work in flight (tiers/node/peers.py) until the reply is sent.  A
reply the ROUTER cannot queue (the peer does not read, or left) is dropped
and counted, never waited for.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Optional

import zmq

from tiers.node.metrics import DaemonMetrics
from tiers.node.peers import PeerReplies
from tiers.stores.base import StoreError
from tiers.wire import protocol as P
from tiers.wire.held_wait import HeldWait

ZERO_COPY_BYTES = 64 << 10  # a reply part this large is sent from its buffer, not copied (pyzmq's advice)
# Flags as plain ints: pyzmq's enum arithmetic costs ~1-2 us an operation, a tenth of a lookup's own work.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK

log = logging.getLogger("hicache.daemon")


class Replies:
    def __init__(self, metrics: DaemonMetrics, peers: PeerReplies, held: Optional[HeldWait] = None):
        self.metrics = metrics
        self.peers = peers
        # Small replies sent holding the GIL (tiers/_heldwait.c): pyzmq gives it up around each send, and a
        # worker thread running Python meanwhile kept the loop (every peer's next reply) waiting for it, up
        # to CPython's switch interval (5 ms) a send.  None: pyzmq's sends only.
        self.held = held
        self.router: Optional[zmq.Socket] = None  # the daemon's ROUTER, once bound
        self._done: deque = deque()
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.in_flight = 0  # requests whose work runs in the pool
        self.inflight_bytes = 0  # their frames' bytes

    def send(self, ident: bytes, reply: list) -> None:
        """Send reply to the peer ident now (the loop thread only)."""
        # Zero-copy pays for pages only: a small reply sent without copying costs a zmq.Frame a part and a
        # message to pyzmq's garbage-collector thread, ~20 us of a 60 us lookup.
        # The ROUTER is mandatory (tiers/node/endpoint.py): a reply it cannot queue raises instead of
        # vanishing, and is counted.
        router = self.router
        try:
            if len(reply) == 1 and len(reply[0]) < ZERO_COPY_BYTES:  # a header alone (lookups, puts): the common reply
                if self.held is not None:
                    self._sent_held(router, ident, reply[0])
                    return
                router.send(ident, _MORE_NOBLOCK)
                router.send(reply[0], _NOBLOCK)
                return
            big = sum(memoryview(part).nbytes for part in reply)
            if big < ZERO_COPY_BYTES:
                router.send_multipart([ident, *reply], flags=_NOBLOCK)
                return
            # Pages leave without a copy; libzmq holds them until the peer reads them: counted until then.
            self.peers.sent(ident, router.send_multipart([ident, *reply], copy=False, track=True,
                                                         flags=_NOBLOCK), big)
        except zmq.Again:  # the peer does not read its replies (its queue is full): it loses this one, nobody waits
            self.metrics.error("reply_dropped")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.metrics.error("reply_unroutable")  # the peer left before its reply was ready

    def _sent_held(self, router: zmq.Socket, ident: bytes, header: bytes) -> None:
        """The reply sent without giving up the GIL, its failures as pyzmq's send would raise them."""
        err = self.held.send_routed(router, ident, bytes(header))
        if err == errno.EAGAIN:
            raise zmq.Again()
        if err:
            raise zmq.ZMQError(err)

    def later(self, work: Future, ident: bytes, req_id: int, op: str, started: float, nbytes: int,
              counted: bool) -> None:
        """The reply is work's result, sent by the loop once the pool has it (the loop thread only)."""
        self.in_flight += 1
        self.inflight_bytes += nbytes
        if counted:
            self.peers.started(ident)
        work.add_done_callback(lambda fut: self._finished(fut, ident, req_id, op, started, nbytes, counted))

    def _finished(self, fut: Future, ident: bytes, req_id: int, op: str, started: float, nbytes: int,
                  counted: bool) -> None:
        # A pool thread: the reply is queued and the loop woken; it sends.
        try:
            reply = fut.result()
        except Exception as exc:
            reply = self.error(req_id, op, exc)
        self.metrics.observe(op, time.perf_counter() - started)
        self._done.append((ident, reply, nbytes, counted))
        self.wake()

    def error(self, req_id: int, op: str, exc: Exception) -> list:
        """The reply to a request that raised (called inside the except): refusals keep their code; a bug is
        logged with its traceback and answered as internal, and must not end the daemon."""
        if isinstance(exc, P.ProtocolError):
            code, message = exc.code, exc.msg
            req_id = req_id or exc.req_id  # a request that failed to decode still gets its own id back
        elif isinstance(exc, StoreError):
            code, message = exc.code, str(exc)
        else:
            log.exception("internal error serving %s", op)
            code, message = "internal", f"{type(exc).__name__}: {exc}"
        self.metrics.error(code)
        return [P.reply_error(req_id, code, message)]

    def wake(self) -> None:
        """Wake the loop from its poll (a reply is ready, or the daemon is stopping)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def send_done(self) -> None:
        """Send every reply the pool has finished (the loop thread only)."""
        while self._done:
            ident, reply, nbytes, counted = self._done.popleft()
            self.in_flight -= 1
            self.inflight_bytes -= nbytes
            if counted:
                self.peers.finished(ident)
            self.send(ident, reply)

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._wake_w)
