"""The dirty set: pages of a tier not yet written to the tier below (write_back and selective).

Its owner is the daemon's Demoter (tiers/node/demotion.py); the daemon marks
pages in it as they are written.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List, Optional, Tuple

from tiers.stores.base import PageKey

MODES = ("through", "back", "selective")


class DirtySet:
    """Pages not yet written below, oldest first: key -> (mode, min_reads)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pages: "OrderedDict[PageKey, Tuple[str, int]]" = OrderedDict()
        self._back = 0  # write-back pages among them (kept, not counted: every write-back put asks)
        self._lock = threading.Lock()

    def add(self, key: PageKey, mode: str, min_reads: int) -> None:
        with self._lock:
            self._forget_locked(key)
            if mode != "through":
                self._pages[key] = (mode, min_reads)
                self._back += mode == "back"

    def pop(self, key: PageKey) -> Optional[Tuple[str, int]]:
        with self._lock:
            return self._forget_locked(key)

    def _forget_locked(self, key: PageKey) -> Optional[Tuple[str, int]]:
        was = self._pages.pop(key, None)
        if was is not None and was[0] == "back":
            self._back -= 1
        return was

    def discard_namespace(self, namespace: Optional[str]) -> None:
        with self._lock:
            for key in [k for k in self._pages if namespace is None or k[0] == namespace]:
                self._forget_locked(key)

    def write_back_count(self) -> int:
        return self._back

    def oldest_write_back(self, n: int) -> List[PageKey]:
        """The n oldest write-back pages (none for n <= 0)."""
        with self._lock:
            out: List[PageKey] = []
            for key, (mode, _) in self._pages.items():
                if len(out) >= n:
                    break
                if mode == "back":
                    out.append(key)
            return out

    def snapshot(self) -> List[Tuple[PageKey, str, int]]:
        with self._lock:
            return [(k, mode, n) for k, (mode, n) in self._pages.items()]

    def __len__(self) -> int:
        return len(self._pages)


def should_demote(mode: str, min_reads: int, reads: int) -> bool:
    return mode == "back" or (mode == "selective" and reads >= min_reads)
