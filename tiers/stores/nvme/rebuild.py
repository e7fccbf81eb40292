"""The NVMe tier's index rebuilt behind a store that already serves.

A restart used to scan every chunk name before the first request (300,000
chunks: 11 s; a 2 TiB disk of 1 MiB pages: over a minute dark).  Now the
store starts serving at once (after at most ``wait`` seconds, enough for a
small directory to be indexed exactly as before) while a thread scans the
fan-out directories and adds what it finds.  Until the scan ends, a chunk it
has not reached yet reads as a miss: a cache may miss, it may not serve a
stale page.  What the serving store does meanwhile wins over the scan
(tiers/stores/nvme/ledger.py ``_Build``): a page written since is not
replaced by its older file, a page deleted, evicted or cleared since is not
brought back (its file is removed when the scan meets it).  At the end each
namespace's eviction order is rebuilt oldest first and capacity enforced.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set

import numpy as np

from tiers.stores.nvme import index
from tiers.stores.nvme.index import ScanResult
from tiers.policies import EvictionPolicy
from tiers.stores.nvme.ledger import Ledger, Victim

log = logging.getLogger("hicache.nvme")

START_WAIT_S = 0.2  # a directory indexed within this is served only once complete, as before
ADD_SLICE = 256  # chunks indexed under one hold of the ledger lock: a lookup waits for at most this many


def _oldest_first(order: List[tuple]) -> List[tuple]:
    """Scanned chunks (mtime, digest, ...) oldest first, ties broken by the digest's low 64 bits, so the
    rebuilt order is deterministic.  Sorted in numpy: list.sort of 1,000,000 tuples holds the GIL for
    ~0.9 s, and the serving threads' lookups timed out behind it."""
    if not order:
        return order
    mtimes = np.fromiter((c[0] for c in order), dtype=np.float64, count=len(order))
    low = np.fromiter((c[1] & 0xFFFFFFFFFFFFFFFF for c in order), dtype=np.uint64, count=len(order))
    return [order[i] for i in np.lexsort((low, mtimes)).tolist()]


class IndexBuild:
    """Scan root into ledger on a thread of its own."""

    def __init__(self, root: str, ledger: Ledger, name: str, dirs: Set[str],
                 discard: Callable[[int, object], None], unlink_stale: Callable[[int, str], None]):
        self.root, self.name = root, name
        self._ledger = ledger
        self._dirs = dirs  # the store's set of leaf directories known to exist: filled as they are found
        self._discard = discard
        self._unlink_stale = unlink_stale
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-index", daemon=True)

    def start(self, wait: Optional[float] = None) -> bool:
        """Begin; True when the index was complete within wait seconds (default START_WAIT_S)."""
        self._ledger.start_build()
        self._thread.start()
        return self.done.wait(START_WAIT_S if wait is None else wait)

    def _run(self) -> None:
        started = time.perf_counter()
        totals = ScanResult()
        order: List[tuple] = []
        stale = 0
        try:
            for part in index.scan_parts(self.root, self._stop):
                self._dirs |= part.dirs
                for start in range(0, len(part.chunks), ADD_SLICE):
                    for digest, path in self._ledger.add_scanned(part.chunks[start:start + ADD_SLICE]):
                        self._unlink_stale(digest, path)
                        stale += 1
                    time.sleep(0)  # let the serving loop have the GIL and the ledger between slices
                order.extend(part.chunks)
                part.chunks = []
                totals.merge(part)
            if self._stop.is_set():
                return
            order = _oldest_first(order)
            victims: List[Victim] = self._ledger.finish_build(self._eviction_order(order))
            for victim in victims:
                self._discard(*victim)
            seconds = time.perf_counter() - started
            self._ledger.extra.update(rebuild_seconds=seconds, rebuild_files=len(order),
                                      temp_removed=totals.temps_removed, torn_removed=totals.torn_removed,
                                      foreign_files=totals.foreign_files, stale_removed=stale)
            log.info("%s: indexed %d chunks (%d bytes) in %.2f s; removed %d temp, %d torn and %d stale files",
                     self.name, len(order), self._ledger.used, seconds, totals.temps_removed,
                     totals.torn_removed, stale)
        except Exception:  # a scan that fails leaves a partial index: misses, never wrong pages
            log.exception("%s: the index rebuild failed; chunks not indexed read as misses", self.name)
            self._ledger.finish_build(self._eviction_order(order))
        finally:
            self.done.set()

    def _eviction_order(self, order: List[tuple]) -> Dict[int, EvictionPolicy]:
        """Each namespace's policy rebuilt oldest first, outside the ledger lock (1,000,000 chunks take
        seconds; under the lock they stalled every write and stats call): the scanned chunks still
        indexed by mtime, then the pages committed during the scan in order.  The ledger replays
        what happens from begin_reorder on."""
        fresh = self._ledger.begin_reorder()
        skip = set(fresh)
        policies: Dict[int, EvictionPolicy] = {}
        ledger = self._ledger
        for n, (_mtime, digest, _ns, _size, _path) in enumerate(order):
            entry = ledger.get(digest)  # one dict lookup, no lock: what changes from now on is journaled
            if entry is not None and digest not in skip:
                self._policy(policies, entry.ns_hash).insert(digest)
            if n % 65536 == 65535:
                time.sleep(0)  # let the serving threads have the GIL
        for digest in dict.fromkeys(fresh):
            entry = ledger.get(digest)
            if entry is not None:
                self._policy(policies, entry.ns_hash).insert(digest)
        return policies

    def _policy(self, policies: Dict[int, EvictionPolicy], ns_hash: int) -> EvictionPolicy:
        policy = policies.get(ns_hash)
        if policy is None:
            policy = policies[ns_hash] = self._ledger.new_policy()
        return policy

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
