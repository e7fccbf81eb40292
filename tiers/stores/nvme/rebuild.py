"""The NVMe tier's index rebuilt behind a store that already serves.

A restart used to scan every chunk name before the first request (300,000
chunks: 11 s; a 2 TiB disk of 1 MiB pages: over a minute dark).  Now the
store starts serving at once (after at most ``wait`` seconds, enough for a
small directory to be indexed exactly as before) while a thread scans the
fan-out directories and adds what it finds.  Until the scan ends, a chunk it
has not reached yet reads as a miss: a cache may miss, it may not serve a
stale page.  Scanned chunks wait at the cold end of their namespace's order.  What the serving store does meanwhile wins over the scan
(tiers/stores/nvme/build_log.py ``BuildLog``): a page written since is not
replaced by its older file, a page deleted, evicted or cleared since is not
brought back (its file is removed when the scan meets it).  At the end the
scanned chunks nothing touched meanwhile are placed oldest mtime first (in
the native index for LRU and FIFO; a Python policy's order is rebuilt from
the list of them) and capacity is enforced.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Container, Dict, List, Optional

import numpy as np

from tiers.stores.nvme import batch, index, ledger_rebuild
from tiers.stores.nvme.index import ScanResult
from tiers.policies import EvictionPolicy
from tiers.stores.nvme.layout import LeafDirs
from tiers.stores.nvme.entry import Victim
from tiers.stores.nvme.ledger import Ledger

log = logging.getLogger("hicache.nvme")

START_WAIT_S = 0.2  # a directory indexed within this is served only once complete, as before
# A scan estimated at this many chunks or more cannot end within START_WAIT_S (warm, ~375,000 chunks a second
# here): the store serves as soon as the estimate says so instead of waiting the wait out (a restart over
# 1,000,000 chunks answered its first lookup 0.2 s later for nothing).
LARGE_SCAN_CHUNKS = 50_000
ADD_SLICE = 4096  # chunks indexed under one hold of the ledger lock (~0.5 ms native): a lookup waits that long at most


class IndexBuild:
    """Scan root into ledger on a thread of its own."""

    def __init__(self, root: str, ledger: Ledger, name: str, dirs: LeafDirs,
                 discard: Callable[[int, object], None], unlink_stale: Callable[[int, object], None],
                 writing: Container[int] = ()):
        self.root, self.name = root, name
        self._writing = writing  # ids of the batch files this run's puts are writing: the scan leaves them
        self._ledger = ledger
        self._dirs = dirs  # the store's set of leaf directories known to exist: filled as they are found
        self._discard = discard
        self._unlink_stale = unlink_stale
        self._stop = threading.Event()
        self.done = threading.Event()
        self._settled = threading.Event()  # done, or known too large to be worth waiting for
        self._thread = threading.Thread(target=self._run, name=f"{name}-index", daemon=True)

    def start(self, wait: Optional[float] = None) -> bool:
        """Begin; True when the index was complete within wait seconds (default START_WAIT_S), False at once
        when the scan is estimated at LARGE_SCAN_CHUNKS or more."""
        ledger_rebuild.start_build(self._ledger)
        self._thread.start()
        self._settled.wait(START_WAIT_S if wait is None else wait)
        return self.done.is_set()

    def _run(self) -> None:
        started = time.perf_counter()
        totals = ScanResult()
        order: List[np.ndarray] = []
        stale = 0
        files = 0
        # A native order (LRU, FIFO) places the scanned chunks by mtime in the index itself: nothing a chunk
        # is kept here.  A Python policy's order is built from the records afterwards (32 bytes a chunk).
        keep = not self._ledger.native_order
        done_parts, sized = 0, False
        try:
            for part in index.scan_parts(self.root, self._stop):
                self._dirs.add_numbers(part.leaves)
                records = part.array()
                done_parts += 1 if part.parts else 0  # the first part (the top level) holds no chunks
                if not sized and part.parts and done_parts >= min(4, part.parts):
                    # The digests spread evenly over the fan-out: a few parts tell the whole's size.  The
                    # index takes its full size now, while it holds little, instead of rehashing ever
                    # larger tables under the GIL as it grows (30 ms at a million, 0.3 s at ten).
                    sized = True
                    estimate = int((files + len(records)) * part.parts / done_parts)
                    if estimate >= LARGE_SCAN_CHUNKS:
                        self._settled.set()
                    ledger_rebuild.reserve_rows(self._ledger, int(estimate * 1.05))
                for start in range(0, len(records), ADD_SLICE):
                    for digest, entry in ledger_rebuild.add_scanned(self._ledger, records[start:start + ADD_SLICE]):
                        self._unlink_stale(digest, entry)
                        stale += 1
                    time.sleep(0)  # let the serving loop have the GIL and the ledger between slices
                files += len(records)
                if keep:
                    order.append(records)
                part.records, part.leaves = b"", []
                totals.merge(part)
            # Batch chunks (tiers/stores/nvme/batch.py): a file of many pages each, walked record by record.
            for scanned in batch.scan_files(self.root, index.RECORD, self._writing):
                if self._stop.is_set():
                    return
                records = scanned.records
                totals.temps_removed += scanned.temps
                totals.torn_removed += scanned.torn
                for start in range(0, len(records), ADD_SLICE):
                    for digest, entry in ledger_rebuild.add_scanned(self._ledger, records[start:start + ADD_SLICE]):
                        self._unlink_stale(digest, entry)
                        stale += 1
                files += len(records)
                if keep and len(records):
                    order.append(records)
            if self._stop.is_set():
                return
            victims: List[Victim] = self._finish(order)
            index.trim()  # the scan's and the placement's freed buffers back to the system
            for victim in victims:
                self._discard(*victim)
            self._ledger.settle_ceiling()  # after the victims' files are gone: they were on disk until now
            seconds = time.perf_counter() - started
            self._ledger.extra.update(rebuild_seconds=seconds, rebuild_files=files,
                                      temp_removed=totals.temps_removed, torn_removed=totals.torn_removed,
                                      foreign_files=totals.foreign_files, stale_removed=stale)
            log.info("%s: indexed %d chunks (%d bytes) in %.2f s; removed %d temp, %d torn and %d stale files",
                     self.name, files, self._ledger.used, seconds, totals.temps_removed,
                     totals.torn_removed, stale)
        except Exception:  # a scan that fails leaves a partial index: misses, never wrong pages
            log.exception("%s: the index rebuild failed; chunks not indexed read as misses", self.name)
            # Not settled: chunks the scan did not reach are still on disk, under the ceiling as it stands.
            for victim in self._finish(order):
                self._discard(*victim)
        finally:
            self.done.set()
            self._settled.set()

    def _finish(self, order: List[np.ndarray]) -> List[Victim]:
        if self._ledger.native_order:
            return ledger_rebuild.place_scanned(self._ledger)
        records = np.concatenate(order) if order else np.empty(0, dtype=index.RECORD)
        return ledger_rebuild.finish_build(self._ledger, self._eviction_order(index.oldest_first(records)))

    def _eviction_order(self, records: np.ndarray) -> Dict[int, EvictionPolicy]:
        """Each namespace's policy rebuilt oldest first, outside the ledger lock (1,000,000 chunks take
        seconds; under the lock they stalled every write and stats call): the scanned chunks still
        indexed by mtime, then the pages committed during the scan in order.  The ledger replays
        what happens from begin_reorder on."""
        fresh = ledger_rebuild.begin_reorder(self._ledger)
        skip = set(fresh)
        policies: Dict[int, EvictionPolicy] = {}
        ledger = self._ledger
        for n, (digest, ns_hash) in enumerate(zip(index.digests_of(records), records["ns"].tolist())):
            if digest in ledger and digest not in skip:  # one native lookup, no lock: changes from now on are journaled
                self._policy(policies, ns_hash).insert(digest)
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
            policy = policies[ns_hash] = self._ledger.tenants.new_policy()
        return policy

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
