"""A client of one tier daemon that never raises and never waits past a deadline.

Lazy-pirate style: each calling thread has its own DEALER socket (the
client's channel, tiers/wire/channel.py); a call that times out closes that
socket (dropping anything still queued) and marks the tier down.  While it is down, calls fail at once, and a thread of the
client's own says hello again with a growing back-off: no engine call ever
waits on a tier that was down.  A ``no_session`` reply (the daemon
restarted) re-opens the session and retries once.

Engine clients attach (``attach=True``): they map the daemon's arena
read-only and copy leased pages out of it themselves (tiers/shm/arena.py);
the registration of host pools and the arena's mapping live in
tiers/wire/attachment.py.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import zmq

from tiers.wire import direct_reads
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire import security
from tiers.wire.arena_map import ArenaMap
from tiers.wire.attachment import Attachment
from tiers.wire.channel import Channel, Reply, Sent  # noqa: F401  (Reply: public here too)
from tiers.wire.deadlines import Deadlines  # noqa: F401  (public here too)
from tiers.wire.fanout import Call, FanOut
from tiers.wire.page_replies import PageReplies, held_flags
from tiers.shm import progress
from tiers.shm.page_runs import PageRuns
from tiers.logs import RateLimitedLog

log = logging.getLogger("hicache.client")


class TierClient:
    """Calls to one tier daemon on behalf of one namespace."""

    def __init__(self, name: str, endpoint: str, namespace: str, client_name: str = "",
                 deadlines: Optional[Deadlines] = None, context: Optional[zmq.Context] = None,
                 attach: bool = False, curve: Optional[security.CurveSettings] = None):
        self.name = name
        self.endpoint = endpoint
        self.curve = curve  # CurveZMQ keys for a tcp:// endpoint (the tier's TierConfig.curve)
        self.namespace = P.check_namespace(namespace)
        self.client_name = client_name or f"pid{os.getpid()}"
        self.deadlines = deadlines or Deadlines()
        self._channel = Channel(endpoint, curve, self.deadlines, context or zmq.Context.instance(), self._lost)
        self._lock = threading.RLock()
        self._session: Optional[int] = None
        self._down = False
        self._probing = False
        self._backoff = self.deadlines.backoff_min
        self._done_leases: List[int] = []  # read leases copied out: released with the next get
        self.max_page_bytes = 64 << 20
        self.fd_socket = ""
        self.answers_digests = False  # the tier takes lookups by packed key digests (its hello says so)
        self.dir_ns = 0  # our namespace's number in the tier's page directory (its hello and leases say)
        self._warn = RateLimitedLog(log)
        self._attachment = Attachment(name, attach, self._warn)  # host pool handed over, daemon arena mapped
        self._replies = PageReplies(name, self._warn)  # what the daemon's page replies come to
        self._toucher = direct_reads.Toucher(name, self._send_touch)  # direct reads told to the daemon
        self._closed = False

    @property
    def region_id(self) -> Optional[int]:
        """The registered host pool's id in the current session (None: pages travel as frames)."""
        return self._attachment.region_id

    @property
    def arena(self) -> Optional[ArenaMap]:
        """The daemon's arena, mapped read-only (engines copy leased reads out of it)."""
        return self._attachment.arena

    # ------------------------------------------------------------- plumbing
    def _lost(self, why: str) -> None:
        """The channel found no daemon, or no reply in time (a probe's own tries are its business)."""
        if not self._down:
            self._mark_down(why)

    def _mark_down(self, why: str) -> None:
        with self._lock:
            self._session = None
            self._attachment.forget_region()
            self._down = True
            start = not self._probing and not self._closed
            self._probing = self._probing or start
        if start:
            threading.Thread(target=self._probe, args=(why == "not connected",), name=f"probe-{self.name}",
                             daemon=True).start()
        self._warn.warning(f"down:{self.name}", "tier %s at %s unavailable (%s); serving misses",
                           self.name, self.endpoint, why)

    def _probe(self, refused: bool) -> None:
        """Say hello until the daemon answers, off every engine call; then the tier is up again."""
        # A daemon that refuses connections (restarting) is tried at least every reconnect_max; one that
        # connects and stays silent (frozen) costs a probe a lookup timeout, so it backs off further.
        # Judged again after every try: a daemon SIGKILLed mid-call first looks silent (the call timed
        # out), then refuses while it restarts; judged once, its probes backed off to 1.6-3.2 s and the
        # ranks came back up to 2.6 s after it answered (tests/test_chaos.py, limit 2 s).
        wait = self.deadlines.backoff_min
        while not self._closed:
            time.sleep(min(wait, self.deadlines.reconnect_max) if refused else wait)
            with self._lock:
                if self._closed:
                    break
                answered = self._hello_locked()
            if answered:
                with self._lock:
                    self._down = False
                    self._probing = False
                return
            refused = self._channel.refused
            wait = min(wait * 2, self.deadlines.backoff_max)
        with self._lock:
            self._probing = False

    def is_down(self) -> bool:
        return self._down

    def calls_given_up(self) -> int:
        """Calls of this thread that got no reply in time, since its first: a read that ends in one was slow."""
        return self._channel.given_up_here()

    def _hello_locked(self) -> bool:
        fields = {"ns": self.namespace, "client": self.client_name}
        held = self._channel.held_wait("hello", fields)
        sent = self._channel.send("hello", self.deadlines.lookup, fields, held=held)
        # Not through start(): a hello opens the session start() would need.
        reply = None if sent is None else _wait_for(
            lambda done: Call("hello", sent, held, self._channel, lambda got: done(got)))
        if reply is None or not reply.header.ok:
            if reply is not None:
                self._warn.warning(f"hello:{self.name}", "tier %s refused hello: %s", self.name, reply.header.msg)
            return False
        hello: M.HelloReply = reply.header
        self.max_page_bytes = hello.max_page_bytes or self.max_page_bytes
        self.fd_socket = hello.fd_socket
        self.answers_digests = hello.digests
        self.dir_ns = hello.dir_ns
        self._backoff = self.deadlines.backoff_min
        self._warn.clear(f"down:{self.name}")
        if self._attachment.wanted:
            self._attachment.register(self.fd_socket, hello.session, self.deadlines.lookup)
        # Published last: _ensure_session reads it without the lock, and a call that sees it finds the
        # session whole (its host pool registered, the tier's key format known).
        self._session = hello.session
        return True

    def _ensure_session(self) -> Optional[int]:
        session = self._session
        if session is not None and not self._down and not self._closed:
            # Read without the lock (on the path of every call): a session lost meanwhile costs this call
            # a no_session reply or its deadline, as a daemon lost just after the lock would.
            return session
        if self._closed or self._down:
            return None
        with self._lock:
            if self._session is None and not self._hello_locked():
                return None
            return self._session

    def connect(self) -> bool:
        """Open the session now (hello, and the region's registration); False when the tier cannot answer."""
        return self._ensure_session() is not None

    def start(self, op: str, timeout: float, on_reply: Callable[[Optional[Reply]], None], frames: Sequence = (),
              retried: bool = False, **fields) -> Optional[Call]:
        """Send a request in this client's session without waiting for its reply (tiers/wire/fanout.py).

        on_reply is called exactly once: with the reply when a FanOut gathers it, or with None (no
        reply in time, or, before this returns None, a tier that cannot be asked).  A ``no_session``
        reply (the daemon restarted) opens a new session and sends the request once more."""
        session = self._ensure_session()
        sent, held = None, None
        if session is not None and not retried:
            self._toucher.take(fields)  # pages read through the directory: counted before this request
        if session is not None and "region" in fields:
            # A region belongs to the session that registered it: after a new hello
            # (daemon restart) name the region registered with it, never the old one.
            fields["region"] = self.region_id  # None: not registered in this session (the caller sends frames)
        if session is not None and fields.get("region", 0) is not None:
            held = self._channel.held_wait(op, fields) if not frames else None
            sent = self._channel.send(op, timeout, fields, frames, session, held)
        if sent is None:
            on_reply(None)
            return None

        def settle(reply: Optional[Reply]) -> Optional[Call]:
            if reply is not None and not reply.header.ok and reply.header.code == "no_session":
                with self._lock:
                    if self._session == session:
                        self._session = None
                if not retried:
                    return self.start(op, timeout, on_reply, frames, retried=True, **fields)
                reply = None
            on_reply(reply)
            return None
        return Call(op, sent, held, self._channel, settle)

    def call(self, op: str, timeout: float, frames: Sequence = (), **fields) -> Optional[Reply]:
        """A request in this client's session and its reply; None when the tier cannot answer."""
        return _wait_for(lambda done: self.start(op, timeout, done, frames, **fields))

    # ---------------------------------------------------- shared memory
    def attach_region(self, fd: int, size: int) -> None:
        """Remember a host-pool memfd; it is (re-)registered after every hello."""
        with self._lock:
            self._attachment.remember(fd, size)
            if self._session is not None:
                self._attachment.register(self.fd_socket, self._session, self.deadlines.lookup)

    # ------------------------------------------------------- operations
    # Each operation comes twice: start_<op> sends it and hands its outcome to a callback once a FanOut
    # gathered the reply (the node's tiers asked at once: tiers/wire/lookup.py, hicache_ext/router.py);
    # <op> is the same call waited for at once.

    def _lookup_fields(self, keys: List[str], digests: Optional[bytes]) -> dict:
        """The keys as the tier takes them: packed digests (one field, one native call there) or the list."""
        if not self.answers_digests:
            return {"keys": keys}
        return {"digests": digests if digests is not None else P.pack_key_digests(self.namespace, keys)}

    def lookup(self, keys: List[str], digests: Optional[bytes] = None) -> Optional[bytes]:
        """One byte per key (1 held), or None when the tier cannot answer.  digests: the keys' packed
        digests in this client's namespace (P.pack_key_digests), when the caller has them already."""
        return _wait_for(lambda done: self.start_lookup(keys, digests, done))

    def start_lookup(self, keys: List[str], digests: Optional[bytes],
                     on_held: Callable[[Optional[bytes]], None]) -> Optional[Call]:
        """lookup, sent; on_held gets its flags (None: the tier did not answer)."""
        if self._ensure_session() is None:
            on_held(None)
            return None
        fields = self._lookup_fields(keys, digests)
        self._add_done(fields)
        return self.start("lookup", self.deadlines.lookup, lambda reply: on_held(held_flags(reply, len(keys))),
                          **fields)

    def put_region(self, keys: List[str], desc: bytes, counts: bytes, nbytes: int,
                   parents: Optional[List[Optional[str]]] = None, **extra) -> List[bool]:
        """Pages from the registered host pool; extra: mode, min_reads, promote, sums (P.encode_sums)."""
        return _wait_for(lambda done: self.start_put_region(keys, desc, counts, nbytes, parents, done, **extra))

    def start_put_region(self, keys: List[str], desc: bytes, counts: bytes, nbytes: int,
                         parents: Optional[List[Optional[str]]], on_stored: Callable[[List[bool]], None],
                         **extra) -> Optional[Call]:
        """put_region, sent; on_stored gets a flag a page."""
        region = self.region_id
        if region is None:
            on_stored([False] * len(keys))
            return None
        fields = dict(keys=keys, region=region, desc=desc, regions_per_page=counts, **extra)
        if parents:
            fields["parents"] = parents
        self._add_done(fields)
        return self.start("put", self.deadlines.for_bytes(nbytes),
                          lambda reply: on_stored(self._replies.flags(reply, len(keys))), **fields)

    def put_frames(self, keys: List[str], pages: Sequence[Sequence], nbytes: int,
                   parents: Optional[List[Optional[str]]] = None, **extra) -> List[bool]:
        """Pages as lists of buffers, sent as one frame per buffer; extra as for put_region."""
        return _wait_for(lambda done: self.start_put_frames(keys, pages, nbytes, parents, done, **extra))

    def start_put_frames(self, keys: List[str], pages: Sequence[Sequence], nbytes: int,
                         parents: Optional[List[Optional[str]]], on_stored: Callable[[List[bool]], None],
                         **extra) -> Optional[Call]:
        """put_frames, sent; on_stored gets a flag a page."""
        frames, counts = [], []
        for page in pages:
            frames.extend(page)
            counts.append(len(page))
        fields = dict(keys=keys, **extra)
        if any(c != 1 for c in counts):
            fields["frames_per_page"] = counts
        if parents:
            fields["parents"] = parents
        self._add_done(fields)
        return self.start("put", self.deadlines.for_bytes(nbytes),
                          lambda reply: on_stored(self._replies.flags(reply, len(keys))), frames=frames, **fields)

    def spin_stopped(self, op: str) -> bool:
        """Whether calls of op to this daemon now wait for their replies without holding the GIL (their last
        spins ended before the reply came: tiers/wire/held_wait.py SpinRecord)."""
        return self._channel.spins.stopped(op)

    def can_lease(self) -> bool:
        return self.arena is not None and not self._down

    def reads_direct(self) -> bool:
        """Whether hits may be read through the daemon's page directory (tiers/wire/direct_reads.py): mapped,
        our namespace numbered, and the daemon that wrote it still there (a dead one's stays mapped)."""
        arena = self.arena
        if arena is None or arena.directory is None or self.dir_ns == 0 or self._down:
            return False
        if not self._attachment.daemon_alive():
            # The daemon exited (or restarted): the next call says hello again and attaches anew, as after a
            # no_session reply; one that finds no daemon marks the tier down.  Marking it down here instead
            # made the calls right after a restart misses, and SGLang stops backing up at a failed put.
            with self._lock:
                if self.arena is arena:
                    self._session = None
            return False
        return True

    def read_direct(self, keys: List[str], dst: PageRuns, summed: bool) -> direct_reads.Found:
        """The pages found in the page directory, copied into dst; the daemon is not asked."""
        arena = self.arena
        if arena is None or self._down:
            return [False] * len(keys), [0] * len(keys), []
        return direct_reads.read_direct(arena, self.namespace, self.dir_ns, keys, dst, summed)

    def held_direct(self, keys: List[str], digests: Optional[bytes] = None) -> Optional[bytes]:
        """The keys' held flags from the page directory (None: ask the daemon)."""
        arena = self.arena
        if arena is None or not self.reads_direct():
            return None
        return arena.held_direct(self.dir_ns, digests or P.pack_key_digests(self.namespace, keys))

    def touch(self, keys: List[str], size: int) -> None:
        """Tell the daemon these pages were read through its directory (later, from the touch thread)."""
        self._toucher.touch(keys, size)

    def _send_touch(self, fields: dict) -> None:
        session = self._ensure_session()
        if session is not None:
            self._channel.send_and_forget("touch", fields, session)

    def get_leased(self, keys: List[str], dst: Union[PageRuns, Sequence[Sequence[Tuple[int, int]]]],
                   sums: Optional[List[int]] = None, copied: Optional[List[int]] = None) -> List[bool]:
        """Copy pages into dst (page runs of this process, or a list of (address, length) runs a page) by a
        leased read.

        The daemon pins the pages in its arena until our own give-up time; we
        copy them out in one call, and keep them only if the copy ended by then.  A page
        is never written after this call returns.  sums, when given, gets each page's checksum
        (0: unknown or not found) for the caller to verify what it copied; copied, when given,
        the checksum of each page as copied into dst (0: not copied), hashed in the same call.
        """
        return _wait_for(lambda done: self.start_get_leased(keys, dst, sums, copied, done))

    def start_get_leased(self, keys: List[str], dst: Union[PageRuns, Sequence[Sequence[Tuple[int, int]]]],
                         sums: Optional[List[int]], copied: Optional[List[int]],
                         on_found: Callable[[List[bool]], None]) -> Optional[Call]:
        """get_leased, sent; the pages are copied when the reply is gathered, then on_found gets a flag a page."""
        arena = self.arena
        n = len(keys)
        if sums is not None:
            sums[:] = [0] * n
        if not isinstance(dst, PageRuns):
            dst = PageRuns.of_lists(dst)
        sizes = dst.sizes()
        timeout = self.deadlines.for_bytes(sum(sizes))
        # CLOCK_MONOTONIC is one clock for the whole machine; a daemon refuses a lease past MAX_LEASE_SECONDS.
        timeout = min(timeout, P.MAX_LEASE_SECONDS - 1.0)
        expiry = time.monotonic() + timeout
        if arena is None:
            on_found([False] * n)
            return None
        fields = dict(keys=keys, lease=expiry, sizes=P.encode_sizes(sizes))
        if progress.built():  # a daemon that reads into staging answers at once and marks pages as read
            fields["stream"] = True
        self._add_done(fields)
        return self.start("get", timeout, lambda reply: on_found(self._copy_leased(reply, arena, n, dst, expiry,
                                                                                   sums, copied)), **fields)

    def _copy_leased(self, reply: Optional[Reply], arena: ArenaMap, n: int, dst: PageRuns, expiry: float,
                     sums: Optional[List[int]], copied: Optional[List[int]]) -> List[bool]:
        found, lease, unusable = self._replies.copy_leased(reply, arena, n, dst, expiry, sums, copied,
                                                           self._attachment.daemon_alive)
        if reply is not None and reply.header.ok and reply.header.dir_ns:
            self.dir_ns = reply.header.dir_ns  # the daemon may have renumbered a namespace that held nothing
        with self._lock:
            if unusable and self.arena is arena:
                self._session = None  # attach again on the next call
            if lease:
                self._done_leases.append(lease)  # given back with the next request
        return found

    def _add_done(self, fields: dict) -> None:
        """Leases of earlier reads, copied out: released by the next request of any kind (no message
        of their own), so a write right after a read finds the blocks free."""
        if not self._done_leases:
            return
        with self._lock:
            done, self._done_leases = self._done_leases[:P.MAX_DONE_LEASES], self._done_leases[P.MAX_DONE_LEASES:]
        if done:
            fields["done"] = done

    def get_frames(self, keys: List[str], nbytes: int,
                   sums: Optional[List[int]] = None) -> Tuple[List[bool], List[zmq.Frame]]:
        """(found flags, one frame per found page in key order); sums as for get_leased."""
        return _wait_for(lambda done: self.start_get_frames(keys, nbytes, sums,
                                                            lambda found, frames: done((found, frames))))

    def start_get_frames(self, keys: List[str], nbytes: int, sums: Optional[List[int]],
                         on_got: Callable[[List[bool], List[zmq.Frame]], None]) -> Optional[Call]:
        """get_frames, sent; on_got gets the found flags and the found pages' frames."""
        if sums is not None:
            sums[:] = [0] * len(keys)
        return self.start("get", self.deadlines.for_bytes(nbytes),
                          lambda reply: on_got(*self._replies.framed_pages(reply, len(keys), sums)), keys=keys)

    def delete(self, keys: List[str]) -> int:
        reply = self.call("delete", self.deadlines.base, keys=keys)
        return reply.header.deleted if reply is not None and reply.header.ok else 0

    def clear(self, everything: bool = False) -> Optional[int]:
        reply = self.call("clear", self.deadlines.base, all=everything)
        return reply.header.cleared if reply is not None and reply.header.ok else None

    def stats(self) -> Optional[dict]:
        reply = self.call("stats", self.deadlines.base)
        return reply.header.stats if reply is not None and reply.header.ok else None

    def close(self) -> None:
        self._closed = True
        self._toucher.close()
        with self._lock:
            self._channel.close()
            self._attachment.close()


def _wait_for(start: Callable[[Callable], Optional[Call]]):
    """What a call started by start(done) hands to done, waited for at once (done is called exactly once)."""
    outcome = []
    call = start(outcome.append)
    if call is not None:
        FanOut.of(call).wait()
    return outcome[0]
