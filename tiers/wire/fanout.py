"""Several daemons asked at once: each request sent without waiting, the replies gathered on the calling thread.

A ``Call`` is one request sent on this thread's socket to one daemon, the
time its caller gives up on it, and what to do with its reply (``settle``:
the client's handling, which may send the request once more after a
``no_session`` reply and returns that new call).  ``FanOut.wait`` gathers
the replies of all its calls together, one poll over their sockets, and
settles each as it comes; a call past its give-up time is settled with None
and its daemon marked lost, as a single call's would be.  Replies that come
within the reply spin are waited for holding the GIL first, as long as every
call out is a quick one (hello, lookup, leased get; tiers/wire/held_wait.py):
in a serving engine each release of the GIL costs a scheduler iteration.

Every call of a client goes through here (TierClient.call is a fan-out of
one), and so do the lookups, reads and writes across a node's tiers
(tiers/wire/lookup.py, hicache_ext/router.py): no thread is started to ask a
tier, and no thread waits for another.  A fan-out is used by the thread that
made its calls (the sockets are that thread's), and never holds two calls on
one socket at once.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import zmq

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire.channel import Channel, Reply, Sent
from tiers.wire.held_wait import HeldWait

# settle(reply, or None when none came in time) -> the call sent again in its place, or None when done
Settle = Callable[[Optional[Reply]], Optional["Call"]]


class Call:
    """A request on its way to one daemon, and its reply still to come."""

    __slots__ = ("op", "sent", "sock", "held", "channel", "settle")

    def __init__(self, op: str, sent: Sent, held: Optional[HeldWait], channel: Channel, settle: Settle):
        self.op = op
        self.sent = sent  # its socket, id and give-up time; unsent while the socket connects
        self.sock = sent.sock
        self.held = held  # the GIL-holding wait when the reply is small and quick, else None
        self.channel = channel
        self.settle = settle

    def until(self) -> float:
        """When the call is given up: its reply's give-up time, or the connection's while it is unsent."""
        return self.sent.connect_by if self.sent.unsent is not None else self.sent.give_up


class FanOut:
    """Calls out at once, and the wait for their replies."""

    __slots__ = ("_out",)

    def __init__(self) -> None:
        self._out: List[Call] = []

    @classmethod
    def of(cls, call: Call) -> "FanOut":
        """A fan-out of one call (a client's single call)."""
        fan = cls()
        fan._out.append(call)
        return fan

    def add(self, call: Optional[Call]) -> None:
        """A call to gather (None: a request that could not be sent, already settled by its client)."""
        if call is not None:
            for other in self._out:
                if other.sock is call.sock:
                    raise ValueError("one call a socket at a time: its replies could not be told apart by operation")
            self._out.append(call)

    def __len__(self) -> int:
        return len(self._out)

    def wait(self, done: Optional[Callable[[], bool]] = None, stop_at: Optional[float] = None) -> None:
        """Settle replies as they come until no call is out, done() holds (asked after each reply), or stop_at
        (time.monotonic()) passes.  Calls still out then stay out: a later wait may gather them, and a reply
        nobody waits for any more is skipped by its id on that socket's next call."""
        if len(self._out) == 1 and done is None and stop_at is None:
            if self._wait_one():  # the common case, a single call: no more Python than it needs
                return
        elif self._wait_held(done, stop_at):
            return
        while self._out:
            if done is not None and done():
                return
            now = time.monotonic()
            if stop_at is not None and now >= stop_at:
                return
            until = min(call.until() for call in self._out)
            if stop_at is not None:
                until = min(until, stop_at)
            timeout_ms = max(0, int((until - now) * 1000)) + 1
            if len(self._out) == 1:  # one call: no poller to build
                call = self._out[0]
                event = zmq.POLLOUT if call.sent.unsent is not None else zmq.POLLIN
                ready = [(call.sock, event)] if call.sock.poll(timeout_ms, event) else []
            else:
                poller = zmq.Poller()
                for call in self._out:
                    poller.register(call.sock, zmq.POLLOUT if call.sent.unsent is not None else zmq.POLLIN)
                ready = poller.poll(timeout_ms)
            for sock, event in ready:
                if event & zmq.POLLIN:
                    parts = sock.recv_multipart(copy=False)
                    self._deliver(sock, parts[0].buffer, parts[1:])
                else:  # connected: the request goes now
                    call = next(call for call in self._out if call.sock is sock)
                    call.channel.push(call.sent)
            now = time.monotonic()
            for call in [call for call in self._out if call.until() <= now]:
                self._out.remove(call)
                if call.sent.unsent is not None:
                    call.channel.refuse()  # the socket never connected: the daemon is not listening
                else:
                    call.channel.give_up(call.op)  # resets this thread's socket: a late reply is dropped with it
                self.add(call.settle(None))

    def _wait_one(self) -> bool:
        """The reply of the one call out, if it comes within the reply spin, waited for holding the GIL (one
        spin in C); True when nothing is out any more."""
        call = self._out[0]
        held, sent = call.held, call.sent
        if held is None or sent.unsent is not None:
            return False
        until = min(time.monotonic() + call.channel.deadlines.reply_spin, sent.give_up)
        while self._out and self._out[0] is call:
            left = until - time.monotonic()
            parts = held.receive(call.sock, left) if left > 0 else None
            spins = call.channel.spins
            if parts is None:
                spins.spun(call.op, False)
                return False
            if spins.misses:  # the quick path is one look at an empty dict
                spins.spun(call.op, True)
            self._deliver(call.sock, parts[0], [zmq.Frame(part) for part in parts[1:]])
        return not self._out  # a call sent again in its place (no_session) is waited for as any other

    def _wait_held(self, done: Optional[Callable[[], bool]], stop_at: Optional[float]) -> bool:
        """The replies that come within the reply spin, waited for holding the GIL, while every call out is
        a quick one; True when the wait is over (nothing out, or done)."""
        if not self._out or any(call.held is None or call.sent.unsent is not None for call in self._out):
            return False
        spin = min(call.channel.deadlines.reply_spin for call in self._out)
        until = time.monotonic() + spin
        if stop_at is not None:
            until = min(until, stop_at)
        while self._out and all(call.held is not None and call.sent.unsent is None for call in self._out):
            left = until - time.monotonic()
            if left <= 0:
                for call in self._out:  # their replies did not come within the spin
                    call.channel.spins.spun(call.op, False)
                return False
            for call in list(self._out):
                # One call: spin in C for the whole time; several: one look at each in turn.
                parts = call.held.receive(call.sock, left if len(self._out) == 1 else 0.0)
                if parts is not None:
                    call.channel.spins.spun(call.op, True)
                    self._deliver(call.sock, parts[0], [zmq.Frame(part) for part in parts[1:]])
            if done is not None and done():
                return True
        return not self._out

    def _deliver(self, sock: zmq.Socket, header, frames: list) -> None:
        """Settle the call a reply on sock answers; a reply that answers none (late, malformed) is skipped."""
        for call in self._out:
            if call.sock is sock:
                break
        else:
            return
        if call.sent.unsent is not None:
            return
        try:
            reply = M.decode_reply(call.op, header)
        except P.ProtocolError:
            return
        if reply.id != call.sent.req_id:
            return  # a reply to an earlier call that timed out
        self._out.remove(call)
        self.add(call.settle(Reply(reply, frames)))
