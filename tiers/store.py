"""The interface every tier's page store implements (DRAM arena, NVMe files, ...).

The daemon (tiers/daemon.py) speaks the protocol and resolves page bytes into
memoryviews; a store only keeps pages.  A page is handed over as a *list* of
memoryviews whose concatenation is the page (SGLang's page_first layout gives
2 regions a page, layer_first 2 x layers), so a store can copy or
``os.pwritev``/``os.preadv`` straight from and into the engine's host pool with
no staging copy.

Keys are ``(namespace, key)`` pairs of str; the daemon has validated both.
Methods never raise for a missing key; they raise ``StoreError`` subclasses
for refusals the client should hear about (too large, full, I/O failure).
Stores are called from the daemon thread, and from its I/O pool when
``parallel_io`` is True: such stores must be thread-safe.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PageKey = Tuple[str, str]  # (namespace, key)
Buffers = Sequence[memoryview]


class StoreError(Exception):
    """A store refused an operation; ``code`` is a protocol error code."""

    code = "store_error"


class PageTooLarge(StoreError):
    code = "too_large"


class StoreFull(StoreError):
    code = "full"


class StoreIOError(StoreError):
    code = "io_error"


@dataclass
class StoreStats:
    """Counters every store keeps; extra holds tier-specific figures."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    pages: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    extra: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def total_size(buffers: Buffers) -> int:
    """Bytes in a page given as a list of buffers."""
    return sum(b.nbytes for b in buffers)


class PageStore(ABC):
    """A bounded page store with an eviction policy."""

    parallel_io = False  # True: the daemon may call get/put from a thread pool

    @abstractmethod
    def put(self, key: PageKey, buffers: Buffers, parent: Optional[str] = None) -> None:
        """Store the concatenation of buffers under key, evicting as needed.

        Overwriting an existing key replaces it.  Raises StoreError on refusal;
        after a refusal no partial page is visible.
        """

    @abstractmethod
    def get_into(self, key: PageKey, buffers: Buffers) -> bool:
        """Copy the page into buffers (total size must match); False on miss."""

    @abstractmethod
    def get_bytes(self, key: PageKey) -> Optional[bytes]:
        """The page as one bytes-like object, or None on miss."""

    def peek(self, key: PageKey) -> Optional[bytes]:
        """The page's bytes without counting a read (demotion, flushing)."""
        return self.get_bytes(key)

    def read_count(self, key: PageKey) -> int:
        """Reads since the page was stored (stores that track it override this)."""
        return 0

    @abstractmethod
    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        """Presence of each key; does not count as an access."""

    def held(self, namespace: str, keys: List[str]) -> bytes:
        """One byte per key of namespace, 1 when present (the lookup's answer; stores may do it faster)."""
        return bytes(1 if ok else 0 for ok in self.contains([(namespace, k) for k in keys]))

    @abstractmethod
    def delete(self, keys: Iterable[PageKey]) -> int:
        """Remove keys; returns how many were present."""

    @abstractmethod
    def clear(self, namespace: Optional[str] = None) -> int:
        """Remove every page (of one namespace); returns how many."""

    def evict(self, nbytes: int, namespace: Optional[str] = None) -> Tuple[int, int]:
        """Evict by policy until nbytes are freed (only pages of namespace when given).

        Returns (pages, bytes) evicted.  An operator's tool, not the hot path.
        """
        raise StoreError(f"{type(self).__name__} does not support evict")

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the store's counters."""

    def close(self) -> None:
        """Release resources; a durable store flushes here."""
