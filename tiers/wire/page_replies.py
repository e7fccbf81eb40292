"""What a daemon's replies to a client's page requests come to: a flag a page, held flags of a lookup, leased
pages copied out of the daemon's arena, pages sent as frames.

A reply that refuses, or does not fit what was asked (a flag count, checksums, descriptors), is a miss for
every page it covers, never an error raised into the engine; each kind of trouble is warned about at most
once in a while (tiers/logs.py), naming the tier.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import zmq

from tiers.logs import RateLimitedLog
from tiers.shm.buffers import MemoryFault
from tiers.shm.page_runs import PageRuns
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire.arena_map import ArenaMap
from tiers.wire.channel import Reply


class PageReplies:
    """One tier's replies, read on behalf of its client."""

    def __init__(self, tier: str, warn: RateLimitedLog):
        self.tier = tier
        self._warn = warn

    def flags(self, reply: Optional[Reply], n: int) -> List[bool]:
        """A flag a page (stored, found) of a put's or a get's reply; all False for a refusal or a bad count."""
        if reply is None:
            return [False] * n
        header = reply.header
        if not header.ok:
            self._warn.warning(f"err:{self.tier}:{header.code}", "tier %s refused a request: %s %s",
                               self.tier, header.code, header.msg)
            return [False] * n
        raw = header.flags()
        if len(raw) != n:
            return [False] * n
        if isinstance(header, M.PutReply) and header.refusal:
            self._warn.warning(f"refusal:{self.tier}", "tier %s stored part of a batch: %s", self.tier,
                               header.refusal)
        return [b != 0 for b in raw]

    def copy_leased(self, reply: Optional[Reply], arena: ArenaMap, n: int, dst: PageRuns, expiry: float,
                    sums: Optional[List[int]], copied: Optional[List[int]],
                    alive: Optional[Callable[[], bool]] = None) -> Tuple[List[bool], int, bool]:
        """The pages a get's reply leased, copied out of the arena into dst while the lease holds (a streamed
        one's as they are read, while alive() says the daemon is there):
        (a flag a page, the lease to give back (0: none), whether the lease named an arena we have not
        mapped: the daemon restarted and the client must attach again)."""
        found = self.flags(reply, n)
        if not any(found):
            return found, 0, False
        got: M.GetReply = reply.header
        try:
            if got.arena != arena.arena_id:
                raise P.ProtocolError("bad_request", "the daemon's arena changed (restart)")
            extents = PageRuns(*P.decode_descriptor_arrays(got.desc, got.regions_per_page, sum(found), arena.size))
        except P.ProtocolError as exc:
            self._warn.warning(f"lease:{self.tier}", "tier %s: unusable read lease: %s", self.tier, exc.msg)
            return [False] * n, 0, True
        try:
            if got.board is not None:  # streamed: each page copied as it is read, its sum on the board
                out, board_sums = arena.copy_streamed(extents, dst, found, got.board, expiry, copied, alive)
                if sums is not None:
                    sums[:] = board_sums
                return out, got.lease, False
            found_sums = P.decode_sums(got.sums, sum(found))
            if sums is not None:
                sums[:] = spread(found, found_sums)
            out = arena.copy_out(extents, dst, found, expiry, copied)
        except P.ProtocolError as exc:  # pages we cannot verify are no hits
            self._warn.warning(f"sums:{self.tier}", "tier %s: malformed get reply: %s", self.tier, exc.msg)
            out = [False] * n
        except (MemoryFault, ValueError) as exc:
            self._warn.warning(f"copy:{self.tier}", "tier %s: copy of leased pages failed: %s", self.tier, exc)
            out = [False] * n
        return out, got.lease, False

    def framed_pages(self, reply: Optional[Reply], n: int,
                     sums: Optional[List[int]]) -> Tuple[List[bool], List[zmq.Frame]]:
        """(a flag a page, the found pages' frames in order) of a get's reply without a lease."""
        found = self.flags(reply, n)
        frames = reply.frames if reply is not None else []
        try:
            found_sums = P.decode_sums(reply.header.sums if reply is not None else None, sum(found))
        except P.ProtocolError as exc:  # a reply we cannot verify is no hit
            self._warn.warning(f"sums:{self.tier}", "tier %s: malformed get reply: %s", self.tier, exc.msg)
            frames = []
        if len(frames) != sum(found):
            return [False] * n, []
        if sums is not None:
            sums[:] = spread(found, found_sums)
        return found, frames


def held_flags(reply: Optional[Reply], n: int) -> Optional[bytes]:
    """The held flags of a lookup reply, or None when it failed or is malformed."""
    if reply is None or not reply.header.ok:
        return None
    held = reply.header.held
    return held if len(held) == n else None


def spread(found: List[bool], found_sums: List[int]) -> List[int]:
    """One checksum a key from one a found key (0 where not found)."""
    it = iter(found_sums)
    return [next(it) if ok else 0 for ok in found]
