"""A client's way to one daemon: a DEALER socket for each calling thread, and the send of one request.

A request is sent without blocking (a socket that cannot take it yet gets a
short wait to connect, never one on an ipc daemon whose socket file is
gone); its reply is gathered by a FanOut (tiers/wire/fanout.py) until the
caller's give-up time.  A request nobody can take, or a reply that does not
come in time, resets that thread's socket (dropping anything late) and tells
the owner the daemon is lost (``on_lost``): its client then serves misses
until a probe of its own finds the daemon again (tiers/wire/client.py).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import zmq

from tiers.wire import held_wait
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire import security

class Sent:
    """A request handed to this thread's socket, or waiting for the socket to connect (unsent: its parts)."""

    __slots__ = ("sock", "req_id", "give_up", "unsent", "connect_by", "big")

    def __init__(self, sock: zmq.Socket, req_id: int, give_up: float, unsent: Optional[list] = None,
                 connect_by: float = 0.0, big: bool = False):
        self.sock = sock
        self.req_id = req_id
        self.give_up = give_up  # time.monotonic() after which its reply is not waited for
        self.unsent = unsent
        self.connect_by = connect_by  # an unsent request's daemon is lost if the socket is not up by then
        self.big = big  # frames sent without a copy


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
        self.spins = held_wait.SpinRecord()  # whether this daemon's replies come within the spin, by operation
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
        if self.spins.misses and not self.spins.worth_spinning(op):
            return None
        return held_wait.shared()

    def send(self, op: str, timeout: float, fields: dict, frames: Sequence = (), session: Optional[int] = None,
             held: Optional[held_wait.HeldWait] = None) -> Optional[Sent]:
        """Send one request (a single-part one by held when given); where to wait for its reply, or None when
        the daemon is unreachable.  A fresh socket that cannot take it yet (connecting; longer on a loaded
        machine) keeps it unsent: push() sends it once the socket is up, so a caller asking several daemons
        at once never waits for one's connection before asking the next (tiers/wire/fanout.py)."""
        req_id = next(self._ids)
        daemon_deadline = time.time() + max(0.01, timeout - self.deadlines.margin)
        header = P.request(op, req_id, deadline=daemon_deadline, session=session, **fields)
        sock = self.socket()
        now = time.monotonic()
        if held is not None and not frames and held.send(sock, header):
            self.refused = False
            return Sent(sock, req_id, now + timeout)
        # A put (SGLang's backup thread, off every request's path) waits for a fresh socket's connection up to
        # half its timeout: on the real server a CPU-bound prefill kept the first backup's handshake past
        # connect_wait, the put was refused as "not connected" and SGLang never backs a batch up again.
        connect_wait = timeout / 2 if op == "put" else min(timeout / 2, self.deadlines.connect_wait)
        sent = Sent(sock, req_id, now + timeout, [header, *frames], now + connect_wait,
                    any(getattr(f, "nbytes", 0) >= 65536 for f in frames))
        if self.push(sent):  # a connected socket takes the message at once: no poll on the hot path
            return sent
        if self._ipc_path and not os.path.exists(self._ipc_path):
            self.refuse()  # an ipc daemon whose socket file is gone: no connection to wait for
            return None
        return sent

    def send_and_forget(self, op: str, fields: dict, session: int) -> bool:
        """Send a request nobody waits for a reply to (touch), waiting up to connect_wait for this thread's
        socket to connect (a sender thread of its own calls this, never an engine's call), after dropping
        the replies of those sent before; False when not sent."""
        sock = getattr(self._local, "sock", None)
        try:
            while sock is not None and sock.recv_multipart(zmq.NOBLOCK):
                pass
        except zmq.Again:
            pass
        sent = self.send(op, self.deadlines.connect_wait, fields, (), session)
        if sent is None:
            return False
        if sent.unsent is not None and sent.sock.poll(int(self.deadlines.connect_wait * 1000), zmq.POLLOUT):
            self.push(sent)
        return sent.unsent is None

    def push(self, sent: Sent) -> bool:
        """Send an unsent request if its socket takes it now; True once it is sent."""
        try:
            sent.sock.send_multipart(sent.unsent, flags=zmq.NOBLOCK, copy=not sent.big)
        except zmq.Again:
            return False
        sent.unsent = None
        self.refused = False
        return True

    def given_up_here(self) -> int:
        """How many calls this thread gave up on (no reply in time): a caller tells a slow tier from a miss."""
        return getattr(self._local, "given_up", 0)

    def refuse(self) -> None:
        """This thread's socket did not connect in time: the daemon is not listening."""
        self.reset_socket()
        self.refused = True
        self._on_lost("not connected")

    def give_up(self, op: str) -> None:
        """A call on this thread's socket got no reply in time: drop the late reply and anything queued."""
        self.reset_socket()
        self._local.given_up = self.given_up_here() + 1
        self._on_lost(f"{op} got no reply in time")
