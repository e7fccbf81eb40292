"""The NVMe tier's bookkeeping: index, policy, byte counts and counters, under one lock, no I/O.

The store owns sizes and the policy only says what to evict (the cachetools
split).  Capacity counts on-disk bytes: committed chunks plus reservations
of writes in flight.  A write reserves before it touches the disk (evicting
as needed) and then commits or releases; the victims it gets back are already
out of the index and their bytes already freed, so the caller deletes their
files before writing its own and the disk never holds more than capacity.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from tiers.policies import make_policy
from tiers.store import PageKey, StoreFull, StoreStats


@dataclass
class Entry:
    path: str
    ns_hash: int
    disk_size: int
    page_key: Optional[PageKey] = None  # None until read (an index rebuilt from names)
    raw_size: Optional[int] = None
    reads: int = 0
    touched: float = 0.0  # monotonic time of the last mtime refresh


Victim = Tuple[int, Entry]


class Ledger:
    """Entries by digest, their policy and byte counts; every method takes the lock."""

    def __init__(self, capacity: int, policy: str):
        self.capacity = capacity
        self.lock = threading.Lock()
        self._index: Dict[int, Entry] = {}
        self._policy = make_policy(policy)
        self.used = 0
        self.reserved = 0
        self.stats = StoreStats(capacity_bytes=capacity)
        self.extra: Dict[str, float] = {"corrupt_removed": 0, "read_errors": 0, "enospc_retries": 0,
                                        "raw_bytes_in": 0, "stored_bytes_in": 0}

    def load(self, chunks: Iterable[Tuple[int, int, int, int, str]]) -> List[Victim]:
        """Index scanned chunks (oldest first); returns victims when they exceed capacity."""
        with self.lock:
            for _mtime, digest, ns_hash, size, path in chunks:
                self._index[digest] = Entry(path, ns_hash, size)
                self._policy.insert(digest)
                self.used += size
            victims = []
            while self.used > self.capacity and len(self._policy):  # capacity lowered since the last run
                victims.append(self._pop_victim_locked())
            return victims

    def get(self, digest: int) -> Optional[Entry]:
        return self._index.get(digest)

    def __contains__(self, digest: int) -> bool:
        return digest in self._index  # one dict lookup: atomic under the GIL, no lock needed

    def _pop_victim_locked(self) -> Optional[Victim]:
        digest = self._policy.pop_victim()
        if digest is None:
            return None
        entry = self._index.pop(digest)
        self.used -= entry.disk_size
        self.stats.evictions += 1
        return digest, entry

    def reserve(self, nbytes: int) -> List[Victim]:
        """Claim nbytes, evicting as needed (StoreFull when writes in flight alone fill it)."""
        with self.lock:
            if self.reserved + nbytes > self.capacity:
                raise StoreFull(f"{self.reserved} bytes of writes in flight, capacity {self.capacity}")
            victims = []
            while self.used + self.reserved + nbytes > self.capacity:
                victim = self._pop_victim_locked()
                if victim is None:  # cannot happen while used counts only indexed chunks
                    break
                victims.append(victim)
            self.reserved += nbytes
            return victims

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose write failed."""
        with self.lock:
            self.reserved -= nbytes

    def evict_bytes(self, nbytes: int) -> List[Victim]:
        """Evict at least nbytes of chunks (the device is fuller than our count says)."""
        with self.lock:
            victims, freed = [], 0
            while freed < nbytes:
                victim = self._pop_victim_locked()
                if victim is None:
                    break
                victims.append(victim)
                freed += victim[1].disk_size
            if victims:
                self.extra["enospc_retries"] += 1
            return victims

    def commit(self, digest: int, entry: Entry, parent: Optional[int]) -> None:
        """A reserved write is on disk under its final name: index it, replacing any older version."""
        with self.lock:
            self.reserved -= entry.disk_size
            old = self._index.pop(digest, None)
            if old is not None:
                self.used -= old.disk_size
                self._policy.remove(digest)
            self._index[digest] = entry
            self.used += entry.disk_size
            self._policy.insert(digest, parent)

    def wrote(self, raw: int, stored: int) -> None:
        with self.lock:
            self.stats.inserts += 1
            self.stats.bytes_written += raw
            self.extra["raw_bytes_in"] += raw
            self.extra["stored_bytes_in"] += stored

    def drop(self, digest: int, entry: Entry, corrupt: bool = False) -> bool:
        """Forget digest if it still maps to entry (a newer version is left alone); True if it did."""
        with self.lock:
            if corrupt:
                self.extra["corrupt_removed"] += 1
            if self._index.get(digest) is not entry:
                return False
            del self._index[digest]
            self.used -= entry.disk_size
            self._policy.remove(digest)
            return True

    def pop_many(self, digests: Iterable[int]) -> List[Victim]:
        """Take digests out of the index (delete, clear); returns what was present."""
        with self.lock:
            out = []
            for digest in digests:
                entry = self._index.pop(digest, None)
                if entry is not None:
                    self.used -= entry.disk_size
                    self._policy.remove(digest)
                    out.append((digest, entry))
            return out

    def digests(self, ns_hash: Optional[int] = None) -> List[int]:
        """Every digest (of one namespace hash)."""
        with self.lock:
            return [d for d, e in self._index.items() if ns_hash is None or e.ns_hash == ns_hash]

    def hit(self, digest: int, entry: Entry, key: PageKey, raw_size: int, now: float, every: float) -> bool:
        """Count a verified read; True when the file's mtime should be refreshed."""
        with self.lock:
            if self._index.get(digest) is entry:
                entry.reads += 1
                entry.page_key, entry.raw_size = key, raw_size
                self._policy.touch(digest)
            self.stats.hits += 1
            self.stats.bytes_read += raw_size
            if now - entry.touched > every:
                entry.touched = now
                return True
            return False

    def miss(self, read_error: bool = False) -> bool:
        """Count a miss; returns False for the caller to return."""
        with self.lock:
            self.stats.misses += 1
            if read_error:
                self.extra["read_errors"] += 1
        return False

    def snapshot(self) -> StoreStats:
        with self.lock:
            snap = StoreStats(**{k: v for k, v in self.stats.__dict__.items() if k != "extra"})
            snap.pages = len(self._index)
            snap.used_bytes = self.used
            extra = dict(self.extra)
            extra["reserved_bytes"] = self.reserved
        raw, stored = extra.pop("raw_bytes_in"), extra.pop("stored_bytes_in")
        extra["compression_ratio"] = raw / stored if stored else 1.0  # of pages written since start
        snap.extra = extra
        return snap
