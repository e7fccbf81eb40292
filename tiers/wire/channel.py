"""A client's way to one daemon: a DEALER socket for each calling thread, and one request's send and receive.

A request is sent without blocking (a socket that cannot take it yet gets a
short wait to connect, never one on an ipc daemon whose socket file is
gone); its reply is waited for until the caller's give-up time, the small
quick ones first holding the GIL for up to ``Deadlines.reply_spin``
(tiers/wire/held_wait.py).  A request nobody can take, or a reply that does
not come in time, resets that thread's socket (dropping anything late) and
tells the owner the daemon is lost (``on_lost``): its client then serves
misses until a probe of its own finds the daemon again (tiers/wire/client.py).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import zmq

from tiers.wire import held_wait
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire import security

Sent = Tuple[zmq.Socket, int, float]  # the socket, the request id, the give-up time (time.monotonic)


@dataclass
class Reply:
    header: M.Reply  # the operation's reply Struct (tiers/wire/messages.py)
    frames: List[zmq.Frame]


class Channel:
    def __init__(self, endpoint: str, curve: Optional[security.CurveSettings], deadlines, context: zmq.Context,
                 on_lost: Callable[[str], None]):
        self.endpoint = endpoint
        self.curve = curve  # CurveZMQ keys for a tcp:// endpoint
        self.deadlines = deadlines
        self._ipc_path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
        self._ctx = context
        self._on_lost = on_lost
        self._local = threading.local()
        self._sockets: List[zmq.Socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.refused = False  # the last send found no connection (the daemon is not listening)

    # ---------------------------------------------------------------- sockets
    def socket(self) -> zmq.Socket:
        """This thread's socket, connected on first use."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
            security.apply_client(sock, self.endpoint, self.curve)  # CurveZMQ keys for a tcp:// endpoint that has them
            sock.connect(self.endpoint)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def reset_socket(self) -> None:
        """Close this thread's socket (and whatever late replies it holds); the next call opens another."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()

    # --------------------------------------------------------------- requests
    def held_wait(self, op: str, fields: dict) -> Optional[held_wait.HeldWait]:
        """The GIL-holding send and wait, for the calls whose reply is small and quick."""
        if self.deadlines.reply_spin <= 0 or not (op in ("hello", "lookup") or (op == "get" and "lease" in fields)):
            return None
        return held_wait.shared()

    def send(self, op: str, timeout: float, fields: dict, frames: Sequence = (), session: Optional[int] = None,
             held: Optional[held_wait.HeldWait] = None) -> Optional[Sent]:
        """Send one request (a single-part one by held when given); where to wait for its reply, or None when
        the daemon is unreachable."""
        req_id = next(self._ids)
        daemon_deadline = time.time() + max(0.01, timeout - self.deadlines.margin)
        header = P.request(op, req_id, deadline=daemon_deadline, session=session, **fields)
        sock = self.socket()
        if held is not None and not frames and held.send(sock, header):
            self.refused = False
            return sock, req_id, time.monotonic() + timeout
        parts = [header, *frames]
        big = any(getattr(f, "nbytes", 0) >= 65536 for f in frames)
        try:
            try:  # a connected socket takes the message at once: no poll on the hot path
                sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=not big)
            except zmq.Again:
                # A fresh socket needs a moment to connect (longer on a loaded machine); an ipc
                # daemon whose socket file is gone fails at once instead of waiting.
                if self._ipc_path and not os.path.exists(self._ipc_path):
                    raise
                if not sock.poll(int(min(timeout / 2, self.deadlines.connect_wait) * 1000), zmq.POLLOUT):
                    raise
                sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=not big)
        except zmq.Again:
            self.reset_socket()
            self.refused = True
            self._on_lost("not connected")
            return None
        self.refused = False
        return sock, req_id, time.monotonic() + timeout

    def held_reply(self, sock: zmq.Socket, req_id: int, give_up: float, held: held_wait.HeldWait,
                   op: str = "lookup") -> Optional[Reply]:
        """The reply to req_id if it comes within the reply spin (or give_up), waited for holding the GIL."""
        until = min(give_up, time.monotonic() + self.deadlines.reply_spin)
        while True:
            parts = held.receive(sock, until - time.monotonic())
            if parts is None:
                return None
            try:
                reply = M.decode_reply(op, parts[0])
            except P.ProtocolError:
                continue
            if reply.id == req_id:
                return Reply(reply, [zmq.Frame(part) for part in parts[1:]])

    def receive(self, sock: zmq.Socket, req_id: int, give_up: float, op: str,
                held: Optional[held_wait.HeldWait] = None) -> Optional[Reply]:
        """The reply to req_id, or None after give_up (the socket is then reset and the daemon lost)."""
        if held is not None:
            reply = self.held_reply(sock, req_id, give_up, held, op)
            if reply is not None:
                return reply
        while True:
            left = give_up - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                self.give_up(op)
                return None
            parts = sock.recv_multipart(copy=False)
            try:
                reply = M.decode_reply(op, parts[0].buffer)
            except P.ProtocolError:
                continue
            if reply.id == req_id:
                return Reply(reply, parts[1:])
            # A reply to an earlier call that timed out: ignore it.

    def give_up(self, op: str) -> None:
        """A call on this thread's socket got no reply in time: drop the late reply and anything queued."""
        self.reset_socket()
        self._on_lost(f"{op} got no reply in time")

    def roundtrip(self, op: str, timeout: float, fields: dict, frames: Sequence = (),
                  session: Optional[int] = None) -> Optional[Reply]:
        """One request and its reply, or None (timeout, no daemon)."""
        held = self.held_wait(op, fields) if not frames else None
        sent = self.send(op, timeout, fields, frames, session, held)
        return None if sent is None else self.receive(*sent, op, held)
