"""Short calls to a daemon that keep the GIL while they wait (tiers/_heldwait.c).

pyzmq gives up the GIL around every send, poll and receive.  In a serving
engine another thread is always waiting for it (SGLang's scheduler loop,
which yields only between iterations of 0.5-1 ms), so each release costs the
call one of those iterations: in the real server a 128-key lookup that takes
~250 us alone took 1-3 ms, and a leased read's request as long again.  For
the calls whose reply is small and quick (hello, lookup, a leased get) the
client sends without blocking and spins on the socket for up to
``Deadlines.reply_spin`` (1 ms by default; CPython lets any thread hold the
GIL for 5 ms) without giving the GIL up, then receives what came.  A reply
that takes longer is waited for as before, without the GIL.  A daemon whose
replies to an operation keep coming later (SpinRecord) is not spun for: the
spin would hold the GIL, and one core, for nothing.

Used only where tiers._heldwait is built and the libzmq that pyzmq loaded is
found (Linux: /proc/self/maps); elsewhere every call takes pyzmq's path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import List, Optional

import zmq

log = logging.getLogger("hicache.client")

MAX_PARTS = 8  # a small reply is a header and at most a few frames
DEFAULT_REPLY_SPIN_S = 0.001  # Deadlines.reply_spin and the backend's reply_spin_us unless set
# A daemon whose replies to an operation keep coming after the spin (an NVMe or remote tier's leased read
# waits on its device: 5-15 ms for 128 pages here) is not spun for: each such spin held the GIL, and one core
# of two, for the whole spin, for nothing.  After SPIN_MISSES_TO_STOP spins in a row that ended empty, that
# operation on that daemon waits without the GIL, and spins again on one call in SPIN_PROBE_EVERY (a tier
# that became quick, a page cache that warmed up, is found again).
SPIN_MISSES_TO_STOP = 2
SPIN_PROBE_EVERY = 32


class HeldWait:
    """The compiled send and spin-receive, bound to the libzmq pyzmq uses."""

    def __init__(self, lib: ctypes.PyDLL):
        self._lib = lib
        self._parts = (ctypes.c_ubyte * (64 * MAX_PARTS))  # zmq_msg_t is 64 bytes

    def send(self, sock: zmq.Socket, data: bytes) -> bool:
        """Send one single-part message without blocking; False when it could not go at once."""
        return self._lib.heldwait_send(sock.underlying, data, len(data)) == 0

    def send_routed(self, sock: zmq.Socket, ident: bytes, data: bytes) -> int:
        """A ROUTER's reply (the peer's routing id, then one part) sent without blocking and without giving up
        the GIL: 0, else the errno (EAGAIN: the peer's queue is full; EHOSTUNREACH: the peer is gone)."""
        return self._lib.heldwait_send_routed(sock.underlying, ident, len(ident), data, len(data))

    def receive(self, sock: zmq.Socket, spin_s: float) -> Optional[List[bytes]]:
        """The parts of the next message if one is there within spin_s, else None (nothing is consumed
        then, unless the message was malformed: more than MAX_PARTS parts or a receive error)."""
        msgs = self._parts()
        parts = self._lib.heldwait_recv(sock.underlying, int(spin_s * 1e9), msgs, MAX_PARTS)
        if parts <= 0:
            return None
        try:
            size = ctypes.c_int64()
            out = []
            for i in range(parts):
                data = self._lib.heldwait_part(msgs, i, ctypes.byref(size))
                out.append(ctypes.string_at(data, size.value) if size.value else b"")
            return out
        finally:
            self._lib.heldwait_close(msgs, parts)


class SpinRecord:
    """Whether spinning pays for one daemon's replies, operation by operation (a heuristic: threads share it
    without a lock, and a lost update costs one spin or one wait without it).  The quick path, every reply
    within its spin, costs a look at an empty dict (a lookup is ~60 us, every microsecond shows)."""

    __slots__ = ("misses", "_skipped")

    def __init__(self) -> None:
        self.misses: dict = {}  # op -> spins in a row that ended without the reply (absent: the last one had it)
        self._skipped: dict = {}  # op -> calls not spun for since the last spin

    def stopped(self, op: str) -> bool:
        """Whether op's calls are not spun for now (but for a probe now and then)."""
        return self.misses.get(op, 0) >= SPIN_MISSES_TO_STOP

    def worth_spinning(self, op: str) -> bool:
        if self.misses.get(op, 0) < SPIN_MISSES_TO_STOP:
            return True
        skipped = self._skipped.get(op, 0) + 1
        if skipped >= SPIN_PROBE_EVERY:
            self._skipped[op] = 0
            return True  # a probe: one spin, to learn whether the replies became quick
        self._skipped[op] = skipped
        return False

    def spun(self, op: str, replied: bool) -> None:
        """A spin for op ended: with its reply (replied) or without."""
        if replied:
            if self.misses:
                self.misses.pop(op, None)
        else:
            self.misses[op] = self.misses.get(op, 0) + 1


@functools.lru_cache(maxsize=None)
def shared() -> Optional[HeldWait]:
    """The process's HeldWait, or None where it cannot be built or bound."""
    try:
        from importlib.util import find_spec
        spec = find_spec("tiers._heldwait")
        zmq_path = _loaded_libzmq()
        if spec is None or not spec.origin or zmq_path is None:
            return None
        lib = ctypes.PyDLL(spec.origin)  # PyDLL: called with the GIL held
        z = ctypes.CDLL(zmq_path)  # the library already loaded: the same handle, no second copy
        names = ("zmq_send", "zmq_getsockopt", "zmq_msg_init", "zmq_msg_recv", "zmq_msg_close", "zmq_msg_data",
                 "zmq_msg_size", "zmq_msg_more")
        lib.heldwait_bind(*[ctypes.cast(getattr(z, name), ctypes.c_void_p) for name in names])
        lib.heldwait_send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
        lib.heldwait_send.restype = ctypes.c_int
        lib.heldwait_send_routed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p,
                                             ctypes.c_int64]
        lib.heldwait_send_routed.restype = ctypes.c_int
        lib.heldwait_recv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.heldwait_recv.restype = ctypes.c_int64
        lib.heldwait_part.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
        lib.heldwait_part.restype = ctypes.c_void_p
        lib.heldwait_close.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.heldwait_close.restype = None
        return HeldWait(lib)
    except (OSError, AttributeError, ImportError) as exc:
        log.info("calls wait without the GIL only (tiers._heldwait unusable: %s)", exc)
        return None


def _loaded_libzmq() -> Optional[str]:
    """The path of the libzmq this process loaded for pyzmq: the one a pyzmq wheel bundles (pyzmq.libs beside
    the zmq package), else the only one mapped; None when several are mapped and none is pyzmq's (calling the
    wrong copy with pyzmq's sockets would be undefined)."""
    import os
    zmq.zmq_version()  # pyzmq's backend is loaded, and with it libzmq
    bundled = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(zmq.__file__))), "pyzmq.libs")
    mapped = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                name = os.path.basename(path)
                if name.startswith("libzmq") and ".so" in name:
                    mapped.add(path)
    except OSError:
        return None
    ours = [path for path in mapped if os.path.dirname(path) == bundled]
    if len(ours) == 1:
        return ours[0]
    return next(iter(mapped)) if len(mapped) == 1 else None
