"""Write-back and selective pages: what must still reach the next tier, and the link that takes it there.

A page written with mode ``back`` is dirty until it has been copied to the
next tier down; one written with mode ``selective`` goes down only if it was
read at least ``min_reads`` times.  Dirty pages are demoted when the store
evicts them, when the dirty set grows past its bound (oldest first, in the
background) and on graceful shutdown.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from tiers.client import Deadlines, TierClient
from tiers.logs import RateLimitedLog
from tiers.store import PageKey

log = logging.getLogger("hicache.demotion")
_warn = RateLimitedLog(log)

MODES = ("through", "back", "selective")


class DirtySet:
    """Pages not yet written below, oldest first: key -> (mode, min_reads)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pages: "OrderedDict[PageKey, Tuple[str, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: PageKey, mode: str, min_reads: int) -> None:
        with self._lock:
            self._pages.pop(key, None)
            if mode != "through":
                self._pages[key] = (mode, min_reads)

    def pop(self, key: PageKey) -> Optional[Tuple[str, int]]:
        with self._lock:
            return self._pages.pop(key, None)

    def discard_namespace(self, namespace: Optional[str]) -> None:
        with self._lock:
            for key in [k for k in self._pages if namespace is None or k[0] == namespace]:
                del self._pages[key]

    def write_back_count(self) -> int:
        with self._lock:
            return sum(1 for mode, _ in self._pages.values() if mode == "back")

    def oldest_over_limit(self) -> List[PageKey]:
        """Write-back pages beyond the bound, oldest first (selective pages wait for eviction)."""
        with self._lock:
            back = [k for k, (mode, _) in self._pages.items() if mode == "back"]
        return back[:max(0, len(back) - self.limit)]

    def snapshot(self) -> List[Tuple[PageKey, str, int]]:
        with self._lock:
            return [(k, mode, n) for k, (mode, n) in self._pages.items()]

    def __len__(self) -> int:
        return len(self._pages)


def should_demote(mode: str, min_reads: int, reads: int) -> bool:
    return mode == "back" or (mode == "selective" and reads >= min_reads)


class DemotionLink:
    """Puts pages into the next tier down, one session per namespace."""

    def __init__(self, name: str, endpoint: str, deadlines: Optional[Deadlines] = None):
        self.name = name
        self.endpoint = endpoint
        self.deadlines = deadlines or Deadlines()
        self._clients: Dict[str, TierClient] = {}
        self._lock = threading.Lock()
        self.demoted = 0
        self.failed = 0

    def _client(self, namespace: str) -> TierClient:
        with self._lock:
            client = self._clients.get(namespace)
            if client is None:
                client = TierClient(self.name, self.endpoint, namespace, "demotion", self.deadlines)
                self._clients[namespace] = client
            return client

    def push(self, key: PageKey, views: Sequence[memoryview]) -> bool:
        """Store one page below; True once the lower tier acknowledged it."""
        nbytes = sum(v.nbytes for v in views)
        ok = self._client(key[0]).put_frames([key[1]], [list(views)], nbytes)[0]
        with self._lock:
            if ok:
                self.demoted += 1
            else:
                self.failed += 1
        if not ok:
            _warn.warning("demote", "could not demote a page of %s to %s; it is lost from this tier", key[0], self.name)
        return ok

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
