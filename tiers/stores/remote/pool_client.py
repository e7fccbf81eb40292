"""One node's control calls to one pool daemon, for one namespace.

A thin layer over TierClient (deadlines, back-off, hello again after a pool
restart): each call returns parsed, validated fields or None, never raises.
A pool that does not answer within ``timeout`` is marked down for a growing
back-off, during which its keys miss at once; the first call after the
back-off says hello again, so a restarted pool rejoins by itself.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire.client import Deadlines, TierClient
from tiers.logs import RateLimitedLog
from tiers.wire.security import CurveSettings

log = logging.getLogger("hicache.remote.pool_client")
_warn = RateLimitedLog(log)

Extents = List[Tuple[int, int]]


@dataclass
class Grant:
    """A pool's answer to alloc or locate: per key, the address extents (None: not granted / not found)."""

    lease: int
    segment: str
    extents: List[Optional[Extents]]
    sizes: List[int]
    sums: List[int]  # locate: each found page's checksum (0: unknown or not found)


class PoolClient:
    def __init__(self, endpoint: str, namespace: str, timeout: float, retry_max: float, client_name: str = "",
                 curve: Optional[CurveSettings] = None):
        self.endpoint = endpoint
        self.timeout = timeout
        # reply_spin 0: a daemon waits for its pools without holding the GIL.  The spin pays only in an engine
        # whose scheduler fights for the GIL; here it spun a core away while the pool and the engine (spinning
        # for our reply) needed both of a 2-core node's: a 1-key remote lookup took 1.4 ms, 0.3 ms without it.
        deadlines = Deadlines(base=timeout, lookup=timeout, margin=min(0.05, timeout / 4),
                              connect_wait=min(0.1, timeout), backoff_min=min(0.2, retry_max),
                              backoff_max=retry_max, reply_spin=0.0)
        self._done: List[int] = []  # read leases to release with the next locate
        self._done_lock = threading.Lock()
        self._client = TierClient(f"pool {endpoint}", endpoint, namespace, client_name=client_name,
                                  deadlines=deadlines, curve=curve)

    def is_down(self) -> bool:
        return self._client.is_down()

    def _ok(self, reply, op: str) -> Optional[M.Reply]:
        if reply is None:
            return None
        header = reply.header
        if not header.ok:
            _warn.warning(f"{self.endpoint}:{op}:{header.code}", "pool %s refused %s: %s %s",
                          self.endpoint, op, header.code, header.msg)
            return None
        return header

    def _grant(self, header: Union[M.AllocReply, M.LocateReply, None], n: int,
               sizes: Optional[Sequence[int]]) -> Optional[Grant]:
        if header is None:
            return None
        lease, segment, flags = header.lease, header.seg, header.flags()
        if len(flags) != n:
            return None
        found = [i for i, b in enumerate(flags) if b]
        found_sums = [0] * len(found)
        if sizes is None:  # locate: the pool says how large each found page is, and its checksum
            try:
                found_sizes = P.decode_sizes(header.sizes, len(found), 1 << 40)
                found_sums = P.decode_sums(header.sums, len(found))
            except P.ProtocolError:
                _warn.warning(f"{self.endpoint}:malformed", "pool %s sent malformed sizes or sums", self.endpoint)
                return None
        else:
            found_sizes = [sizes[i] for i in found]
        pages = P.decode_pool_extents(header.desc, header.regions_per_page, found_sizes)
        if pages is None:
            _warn.warning(f"{self.endpoint}:malformed", "pool %s sent a malformed %s reply", self.endpoint,
                          type(header).__name__)
            return None
        # Each found page's (address, length) runs, as decoded, at its position among the keys.
        extents: List[Optional[Extents]] = [None] * n
        all_sizes, all_sums = [0] * n, [0] * n
        for i, page, size, checksum in zip(found, pages, found_sizes, found_sums):
            extents[i], all_sizes[i], all_sums[i] = page, size, checksum
        return Grant(lease, segment, extents, all_sizes, all_sums)

    # ------------------------------------------------------------ calls
    def alloc(self, keys: List[str], sizes: List[int], parents: List[Optional[str]], ttl: float,
              sums: Optional[List[int]] = None) -> Optional[Grant]:
        """Reserve room for pages, each kept with its checksum (sums, 0: unknown) once committed."""
        fields = dict(keys=keys, sizes=P.encode_sizes(sizes), ttl=ttl)
        if any(parents):
            fields["parents"] = parents
        if sums and any(sums):
            fields["sums"] = P.encode_sums(sums)
        header = self._ok(self._client.call("alloc", self.timeout, **fields), "alloc")
        if header is not None and header.refusal:
            _warn.warning(f"{self.endpoint}:refusal", "pool %s refused part of an alloc: %s", self.endpoint,
                          header.refusal)
        return self._grant(header, len(keys), sizes)

    def commit(self, lease: int, keys: List[str]) -> List[bool]:
        header = self._ok(self._client.call("commit", self.timeout, lease=lease, keys=keys), "commit")
        raw = header.flags() if header is not None else b""
        if len(raw) != len(keys):
            return [False] * len(keys)
        return [b != 0 for b in raw]

    def locate(self, keys: List[str], ttl: float) -> Optional[Grant]:
        """Pin and find pages; read leases released with release_later go along."""
        with self._done_lock:
            done, self._done = self._done[:P.MAX_DONE_LEASES], self._done[P.MAX_DONE_LEASES:]
        header = self._ok(self._client.call("locate", self.timeout, keys=keys, ttl=ttl, done=done), "locate")
        return self._grant(header, len(keys), None)

    def release(self, lease: int) -> None:
        self._client.call("release", self.timeout, lease=lease)

    def release_later(self, lease: int) -> None:
        """Release a read lease with the next locate (it ends by itself at its ttl otherwise)."""
        with self._done_lock:
            self._done.append(lease)
            overflow = len(self._done) > 4 * P.MAX_DONE_LEASES
        if overflow:  # no locate for a long while: say it now
            with self._done_lock:
                done, self._done = self._done, []
            for lease_id in done:
                self.release(lease_id)

    def lookup(self, keys: List[str]) -> Optional[bytes]:
        return self._client.lookup(keys)

    def delete(self, keys: List[str]) -> int:
        return self._client.delete(keys)

    def clear(self, everything: bool = False) -> Optional[int]:
        return self._client.clear(everything)

    def stats(self) -> Optional[dict]:
        return self._client.stats()

    def close(self) -> None:
        self._client.close()
