"""The interface every tier's page store implements (DRAM arena, NVMe files, ...).

The daemon (tiers/node/daemon.py) speaks the protocol and resolves page bytes into
memoryviews; a store only keeps pages.  A page is handed over as a *list* of
memoryviews whose concatenation is the page (SGLang's page_first layout gives
2 regions a page, layer_first 2 x layers).  The views are always daemon-owned
memory (ZeroMQ frames, the DRAM arena, staging blocks of the daemon's arena):
the daemon alone reads an engine's host pool, through a SIGBUS-guarded copy
(tiers/node/transfers.py), and nothing writes into one but the engine itself.

Each page may carry its writer's checksum (xxh3_64 of its bytes, 0 for
unknown: tiers/wire/protocol.py ``sums``).  A store that declares
``keeps_checksums`` keeps it with the page and returns it with every read
(the ``*_with_sum`` methods); the defaults keep nothing and answer 0, and
the engine then verifies nothing, so a store written before checksums
still serves.

Keys are ``(namespace, key)`` pairs of str; the daemon has validated both.
Methods never raise for a missing key; they raise ``StoreError`` subclasses
for refusals the client should hear about (too large, full, I/O failure).
Stores are called from the daemon thread, and from its I/O pool when
``parallel_io`` is True: such stores must be thread-safe.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from tiers.shm.buffers import as_bytes_view

PageKey = Tuple[str, str]  # (namespace, key)
# get_many_into_with_sums' hold: keep the buffers of a page (its position in the batch) out of use until
# the returned function is called.
HoldPage = Callable[[int], Callable[[], None]]
# put_many_filled's fill: bring the bytes of the pages at these positions of the batch into their buffers
# and return each one's checksum as taken from those bytes (FillFailed when it cannot).
FillPages = Callable[[List[int]], List[int]]
Buffers = Sequence[memoryview]
# get_many_streamed's report: these positions of the batch are final, each with its checksum (None: a miss).
OnFinal = Callable[[List[int], List[Optional[int]]], None]
# RAM a page held in a Python index costs outside any arena (DRAM tier, remote pool): its key and parent as
# SGLang sends them (64 hex characters each), its entry, the index's and the policy's entries.  Measured with
# anonymous_bytes() over 50,000-200,000 pages: 906-912 B under LRU, 960-966 under S3-FIFO, alike in both
# stores; tests hold index_bytes() above what they measure.  Without it the daemon's memory bound
# (tiers/node/memory_guard.py) took a tier of a million pages for a flood of unfinished messages and shut
# idle engines' connections.
INDEX_BYTES_PER_PAGE = 1024


class StoreError(Exception):
    """A store refused an operation; ``code`` is a protocol error code (tiers/wire/protocol.py ERROR_CODES)."""

    code = "io_error"


class Unsupported(StoreError):
    """The store does not offer this operation."""

    code = "bad_request"


class SourceGone(StoreError):
    """The page's source memory went away during the copy (the engine truncated its host pool)."""

    code = "bad_request"


class FillFailed(StoreError):
    """The bytes of a put's pages could not be brought into its buffers (FillPages): the source went away,
    the deadline passed.  code says which (a protocol error code)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class PageTooLarge(StoreError):
    code = "too_large"


class StoreFull(StoreError):
    code = "full"


class StoreIOError(StoreError):
    code = "io_error"


class EvictionListener(ABC):
    """Hears of pages a store evicts, before their memory is reused (the daemon's demotion to the tier below).

    A store that evicts takes one at construction (``StoreKind.build``'s
    ``evictions``; None: nobody listens) and calls page_evicted for each page
    its policy evicts, not for deletes or overwrites.
    """

    @abstractmethod
    def page_evicted(self, key: PageKey, views: Sequence[memoryview], reads: int, checksum: int = 0) -> None:
        """key's page (views valid only during the call, checksum kept with it) was evicted after reads hits.

        Called inside the store's lock: it must not block, and must copy what it keeps.
        """


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
    # namespace -> {bytes, pages, hits, evictions, ...}, the largest few only (bounded metric labels)
    per_namespace: Dict[str, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def total_size(buffers: Buffers) -> int:
    """Bytes in a page given as a list of buffers."""
    return sum(b.nbytes for b in buffers)


def accepted_page(buffers: Buffers, max_page_bytes: int) -> Tuple[List[memoryview], int]:
    """A page's non-empty buffers as byte views, and its size; PageTooLarge for an empty page or one larger
    than max_page_bytes."""
    src = [v for v in (as_bytes_view(b) for b in buffers) if v.nbytes]
    size = total_size(src)
    if size == 0 or size > max_page_bytes:
        raise PageTooLarge(f"page of {size} bytes not accepted (max {max_page_bytes})")
    return src, size


class PageStore(ABC):
    """A bounded page store with an eviction policy."""

    parallel_io = False  # True: the daemon may call get/put from a thread pool
    batched = False  # True: put_many / get_many_into move a whole batch at once (the remote tier)
    persistent = False  # True: pages survive a restart of the daemon (a store built on the same path finds them)
    keeps_checksums = False  # True: the *_with_sum methods keep each page's checksum and return it
    # True (with batched): put_many_filled fills a batch a part at a time as it writes it and keeps the sums the
    # fill returns; the daemon then copies (and hashes) each part only when the store asks for it.
    fills_in_parts = False
    answers_digests = False  # True: held_digests answers lookups named by key digests (its daemon says so)
    # True: get_many_streamed tells of each page as its own read ends, and the daemon answers a leased get at
    # once, streaming the pages to the engine (tiers/shm/progress.py); such stores need no hold.
    streams_reads = False

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

    def pin_page(self, key: PageKey, owner: int) -> Optional[Tuple[int, list, int]]:
        """Stores with an arena (``export_arena``): pin key's blocks without counting a read, for a copy
        out of the arena by (offset, length); (lease id, extents, checksum), or None when absent or not supported.
        The caller ends the lease with ``export_arena().release(lease, owner)``."""
        return None

    def read_count(self, key: PageKey) -> int:
        """Reads since the page was stored (stores that track it override this)."""
        return 0

    @abstractmethod
    def contains(self, keys: Iterable[PageKey]) -> List[bool]:
        """Presence of each key; does not count as an access."""

    def held(self, namespace: str, keys: List[str]) -> bytes:
        """One byte per key of namespace, 1 when present (the lookup's answer; stores may do it faster)."""
        return bytes(1 if ok else 0 for ok in self.contains([(namespace, k) for k in keys]))

    def held_digests(self, namespace: str, digests: bytes) -> bytes:
        """held for keys named by their packed digests (16 bytes each, tiers/wire/protocol.py key_digest).

        Stores with ``answers_digests`` index pages by those digests; the daemon
        sends no digests to any other (its hello says the tier takes keys).
        """
        raise NotImplementedError(f"{type(self).__name__} answers lookups by key only")

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
        raise Unsupported(f"{type(self).__name__} does not support evict")

    def assign_tenant(self, namespace: str, tenant: str, quota: Optional[int] = None) -> None:
        """namespace is tenant's: its pages count toward that tenant's one fair share, and toward its quota
        (bytes all its namespaces may hold together in this tier) when one is given. The daemon says so at
        each hello of a configured tenant (tiers/node/tenants.py); a namespace never assigned is a tenant of
        its own. Stores without a fair share ignore it."""

    def index_bytes(self) -> int:
        """Bytes of RAM the store's index of pages takes outside any arena, growing with the pages it holds
        (what the daemon's memory bound allows for it: tiers/node/memory_guard.py). 0: nothing worth counting."""
        return 0

    def prune(self) -> int:
        """Forget per-namespace state of namespaces that hold nothing; how many. Called by the daemon between
        requests (each tick). Stores that keep none return 0."""
        return 0

    # ------------------------------------------------ optional capabilities
    def export_arena(self):
        """The BlockArena (tiers/shm/arena.py) this store keeps its pages in, when engines may read them from it.

        None (the default): the daemon stages reads in an arena of its own.
        A store that returns its arena implements ``lease_pages``.
        """
        return None

    def export_directory(self):
        """The PageDirectory (tiers/shm/directory.py) of export_arena(), when engines may find pages in it
        without asking the daemon; None (the default): every read asks.  A store that returns one
        implements ``directory_namespace`` and ``touch_reads``."""
        return None

    def directory_namespace(self, namespace: str) -> int:
        """The number namespace's pages are filed under in export_directory() (0: none)."""
        return 0

    def touch_reads(self, namespace: str, keys: Sequence[str], sizes: Sequence[int]) -> Tuple[int, int]:
        """Pages an engine read through export_directory(), counted as reads after the fact: (pages still
        held at those sizes, their bytes)."""
        raise Unsupported(f"{type(self).__name__} keeps no page directory")

    def lease_pages(self, keys: Sequence[PageKey], sizes: Sequence[int], owner: int, expiry: float,
                    max_bytes: int):
        """(lease id or None, extents in export_arena() of each page or None, checksum of each page);
        see tiers/shm/arena.py."""
        raise Unsupported(f"{type(self).__name__} keeps no exported arena")

    # A store that exports an arena is written into in three steps, the copy outside its lock:
    # reserve blocks, copy the page into them (the daemon does, guarded), then commit or abort.
    def reserve(self, key: PageKey, size: int, evict: bool = True):
        """An Alloc of export_arena() for a page of size bytes of key's namespace, evicting as needed; with
        evict=False, None where it would have to evict."""
        raise Unsupported(f"{type(self).__name__} keeps no exported arena")

    def commit(self, key: PageKey, alloc, parent: Optional[str] = None, checksum: int = 0) -> None:
        """The page in alloc's blocks (filled) is key's from now on."""
        raise Unsupported(f"{type(self).__name__} keeps no exported arena")

    def abort(self, alloc) -> None:
        """alloc's blocks back, unused."""
        raise Unsupported(f"{type(self).__name__} keeps no exported arena")

    def reserve_many(self, namespace: str, keys: Sequence[str], sizes: Sequence[int], evict: bool = False) -> list:
        """reserve for a batch's pages in turn: the Allocs of the leading pages that fit.  This default never
        evicts (the caller reserves the next page alone, evicting, after committing these); override to take
        the store's lock once a batch, and to make room for a whole batch where the policy allows it
        (EvictionPolicy.evicts_new_pages_last)."""
        out = []
        for key, size in zip(keys, sizes):
            alloc = self.reserve((namespace, key), size, evict=False)
            if alloc is None:
                break
            out.append(alloc)
        return out

    def commit_many(self, namespace: str, keys: Sequence[str], allocs: Sequence, parents: Sequence[Optional[str]],
                    checksums: Sequence[int]) -> None:
        """commit for each page of a batch of one namespace.  Override to take the store's lock once a batch."""
        for key, alloc, parent, checksum in zip(keys, allocs, parents, checksums):
            self.commit((namespace, key), alloc, parent, checksum)

    def put_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], parents: Sequence[Optional[str]],
                 deadline: Optional[float]) -> List[Optional[StoreError]]:
        """Stores with ``batched``: every page at once; None or the refusal of each."""
        raise Unsupported(f"{type(self).__name__} moves pages one at a time")

    def get_many_into(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                      deadline: Optional[float]) -> List[bool]:
        """Stores with ``batched``: every page at once; found flags."""
        raise Unsupported(f"{type(self).__name__} moves pages one at a time")

    # ------------------------------------------------ page checksums (keeps_checksums)
    def put_with_sum(self, key: PageKey, buffers: Buffers, parent: Optional[str], checksum: int) -> None:
        """put, keeping checksum (0: unknown) with the page for its reads."""
        self.put(key, buffers, parent)

    def get_into_with_sum(self, key: PageKey, buffers: Buffers) -> Optional[int]:
        """get_into, answering the page's checksum (0: unknown), or None on a miss."""
        return 0 if self.get_into(key, buffers) else None

    def get_bytes_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        """get_bytes and the page's checksum (0: unknown)."""
        return self.get_bytes(key), 0

    def peek_with_sum(self, key: PageKey) -> Tuple[Optional[bytes], int]:
        """peek and the page's checksum (0: unknown)."""
        return self.peek(key), 0

    def put_many_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                           parents: Sequence[Optional[str]], deadline: Optional[float],
                           checksums: Sequence[int],
                           page_sums: Optional[Sequence[int]] = None) -> List[Optional[StoreError]]:
        """put_many, keeping each page's checksum (the writer's; 0: unknown).

        page_sums, when given, is each page's checksum as the caller computed it from exactly these
        buffers, which nobody else can change (the daemon hashes a page as it copies it into its
        staging): a store may check checksums against it and keep it instead of hashing the bytes again."""
        return self.put_many(keys, pages, parents, deadline)

    def put_many_filled(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                        parents: Sequence[Optional[str]], deadline: Optional[float],
                        checksums: Optional[Sequence[int]], fill: FillPages,
                        aligned: bool = False) -> List[Optional[StoreError]]:
        """put_many_with_sums of pages whose buffers are filled on request: fill(positions) brings those
        pages' bytes in and returns their page_sums.  checksums None: the writer sent none and asked the
        daemon to hash (hash_pages), so each page's sum from the fill is its checksum too.  A store that
        writes a batch in parts fills each part just before writing it, so the daemon's copy out of the
        engine's memory overlaps the device (NVMe); this default fills every page first.  A FillFailed
        refuses the pages not yet written.  aligned: every buffer starts and ends on a 4 KiB boundary (the
        daemon checked the whole batch at once; a store need not ask each buffer again)."""
        try:
            sums = fill(list(range(len(keys))))
        except FillFailed as exc:
            return [exc] * len(keys)
        return self.put_many_with_sums(keys, pages, parents, deadline, sums if checksums is None else checksums,
                                       sums)

    def get_many_into_with_sums(self, keys: Sequence[PageKey], pages: Sequence[Buffers],
                                deadline: Optional[float],
                                hold: Optional[HoldPage] = None) -> List[Optional[int]]:
        """get_many_into, answering each page's checksum (0: unknown), or None for a miss.

        hold, when given, says the buffers are memory the caller keeps out of use on
        request (the daemon's staging blocks): a store whose transfers cannot be
        cancelled may then move bytes straight into them, and for a page whose
        transfer it gave up while bytes may still arrive calls ``hold(position)``
        (the page is a miss) and, once they stopped, the function that returned.
        Without hold a store leaves nothing moving into the buffers once it returns.
        """
        return [0 if ok else None for ok in self.get_many_into(keys, pages, deadline)]

    def get_many_streamed(self, keys: Sequence[PageKey], pages: Sequence[Buffers], deadline: Optional[float],
                          on_final: OnFinal, hold: Optional[HoldPage] = None) -> None:
        """get_many_into_with_sums, telling on_final(positions, sums) of every page exactly once, as soon as it
        is final (its checksum, 0: unknown; None: a miss); nothing moves into the buffers once this returns,
        but into a page it hold()s, as get_many_into_with_sums' hold says.  This default tells of a batched
        store's whole batch at the end, of any other's pages one by one."""
        if self.batched:
            try:
                sums = self.get_many_into_with_sums(keys, pages, deadline, hold)
            except StoreError:
                sums = [None] * len(keys)
            on_final(list(range(len(keys))), sums)
            return
        for i, (key, buffers) in enumerate(zip(keys, pages)):
            checksum = None
            if deadline is None or time.time() <= deadline:
                try:
                    checksum = self.get_into_with_sum(key, buffers)
                except StoreError:
                    pass
            on_final([i], [checksum])

    def region_mapped(self, view: memoryview) -> None:
        """Memory the daemon reads pages from or into was mapped (the remote tier registers it with its engine)."""

    def sends_from(self, view: memoryview) -> bool:
        """True: put_many may be handed views of this mapping (an engine's host pool) and moves their bytes
        itself, without reading them in Python: the kernel or the NIC reads them (the remote tier's Transfer
        Engine), so a host pool its engine truncates fails the transfer instead of signalling the daemon, and
        the store keeps the views referenced while a transfer it gave up may still read them (the daemon
        calls region_unmapped before the mapping goes).  False (this default): the daemon copies the pages
        into staging first."""
        return False

    def region_unmapped(self, view: memoryview) -> None:
        """Memory given to region_mapped goes away."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the store's counters."""

    def namespace_figures(self, namespace: str) -> Optional[dict]:
        """One namespace's figures as stats() gives them in per_namespace (bytes, pages, hits, evictions,
        quota, ...), looked up without walking every namespace: what a tenant's stats request shows it,
        whatever the number of namespaces (stats() keeps the 32 largest).  None: it holds nothing, or the
        store cannot say without a walk (this default; the caller then uses the stats it took)."""
        return None

    def close(self) -> None:
        """Release resources; a durable store flushes here."""
