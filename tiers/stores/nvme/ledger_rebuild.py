"""The ledger's side of an index rebuilt behind a store that already serves (tiers/stores/nvme/rebuild.py).

Scanned chunks are indexed unless the serving store decided about them
meanwhile (the ledger's BuildLog, tiers/stores/nvme/build_log.py); at the end
they are placed oldest mtime first in the native index (LRU, FIFO), or each
namespace's Python policy, ordered outside the lock, is installed with what
the store did meanwhile replayed onto it; then capacity is enforced.  Every
function takes the ledger's lock itself.
"""
from __future__ import annotations

import time
from typing import Dict, List

import numpy as np

from tiers.policies import EvictionPolicy
from tiers.stores.nvme.build_log import BuildLog
from tiers.stores.nvme.index import digests_of
from tiers.stores.nvme.entry import Entry, Victim
from tiers.stores.nvme.ledger import Ledger
from tiers.stores.page_index import Row

PLACE_SLICE = 65536  # scanned chunks placed in order under one hold of the lock (~5 ms)


def start_build(ledger: Ledger) -> None:
    with ledger.lock:
        ledger.build = BuildLog()
        # Until the scan counts them, the chunks on disk may add up to the ceiling the last run left.
        ledger.unscanned = ledger.ceiling.value


def add_scanned(ledger: Ledger, records: np.ndarray) -> List[Victim]:
    """Index chunks the scan found (tiers/stores/nvme/index.py RECORD), unless the serving store decided
    about them meanwhile: a digest written since wins; one deleted, evicted or of a cleared namespace is
    stale ((digest, path) returned, for the caller to unlink), and so is a batch record of the last run
    whose page was written again since (_superseded).  They go to the cold end of their
    namespace's order, placed by mtime at the end of the scan (place_scanned)."""
    with ledger.lock:
        build, index, tenants = ledger.build, ledger.index, ledger.tenants
        indexed = _indexed(index, records)
        gone = np.zeros(len(records), dtype=bool)
        if build.gone or build.cleared:  # rare: something was deleted or cleared during the scan
            gone = ~indexed & np.array([build.stale(d, ns) for d, ns in
                                        zip(digests_of(records), records["ns"].tolist())], dtype=bool)
        stale = _superseded(ledger, build, records, indexed)
        counted = _left_by_last_run(build, records, indexed, gone) + sum(e.disk_size for _d, e in stale)
        stale += [_victim(ledger, records, i) for i in np.flatnonzero(gone).tolist()]
        records = records[~gone] if gone.any() else records
        numbers = {ns: tenants.tenant(ns, index).number for ns in np.unique(records["ns"]).tolist()}
        for number, nbytes in index.insert_scanned(records.tobytes(), numbers).items():
            tenants.numbered[number].bytes += nbytes
            ledger.used += nbytes
        ledger.unscanned = max(0, ledger.unscanned - counted)
        tenants.regrouped()
    return stale


def _indexed(index, records: np.ndarray) -> np.ndarray:
    """Which records' digests the index holds already (one native call)."""
    if not len(records):
        return np.zeros(0, dtype=bool)
    rows = np.ascontiguousarray(records).view(np.uint8).reshape(len(records), records.itemsize)
    packed = rows[:, :16].tobytes()  # each digest's lo and hi, as contains_packed takes them
    return np.frombuffer(index.contains_packed(packed), dtype=np.uint8).astype(bool)


def _left_by_last_run(build: BuildLog, records: np.ndarray, indexed: np.ndarray, gone: np.ndarray) -> int:
    """Bytes of the last run's chunks the scan counts now, by indexing them or (gone: deleted, evicted or
    cleared meanwhile) by unlinking them; the caller adds the superseded ones.  What comes off the ledger's
    ``unscanned``.  Not a chunk of this run's (indexed already, or renamed into place and not yet indexed:
    its mtime is this rebuild's): taking it off would let the disk pass its capacity."""
    old = (records["mtime"] < build.started_s) & ~indexed
    chosen = np.flatnonzero(old & ~gone)
    if len(chosen) > 1:  # a page twice (a crash between a rewrite and the old record's give-back): indexed once
        chosen = chosen[np.unique(records[["lo", "hi"]][chosen], return_index=True)[1]]
    return int(records["size"][chosen].sum()) + int(records["size"][old & gone].sum())


def _superseded(ledger: Ledger, build: BuildLog, records: np.ndarray, indexed: np.ndarray) -> List[Victim]:
    """Batch records of the last run whose page was written again since this rebuild began (the index names
    another record): given back now, where the scan finds them (otherwise their blocks would stay in the
    file, counted by no one, for good)."""
    out: List[Victim] = []
    for i in np.flatnonzero(indexed & (records["file"] != 0) & (records["mtime"] < build.started_s)).tolist():
        digest, entry = _victim(ledger, records, i)
        values = ledger.index.get(digest)
        row = Row(*values) if values is not None else None
        if row is not None and (row.file, row.block) != (entry.file, entry.block):
            out.append((digest, entry))
    return out


def _victim(ledger: Ledger, records: np.ndarray, i: int) -> Victim:
    """Scanned record i as (digest, Entry), for the caller to unlink or give back."""
    digest = (int(records["hi"][i]) << 64) | int(records["lo"][i])
    ns_hash, file = int(records["ns"][i]), int(records["file"][i])
    return digest, Entry(ledger.path_of(ns_hash, digest, file), ns_hash, int(records["size"][i]), file=file,
                         block=int(records["block"][i]))


def reserve_rows(ledger: Ledger, rows: int) -> None:
    """Room for rows chunks in the index without growing it (a scan's estimate)."""
    with ledger.lock:
        ledger.index.reserve(max(0, rows))


def place_scanned(ledger: Ledger) -> List[Victim]:
    """The scan ended (native orders): the scanned chunks no one touched since go behind everything
    else, oldest mtime first (ties in scan order); the build ends and capacity is enforced.  In
    batches of a quarter of the index, oldest first (their sorted keys take 2 bytes a chunk, not 8:
    the peak RAM of a rebuild is the index's), each sorted without the GIL or the lock and placed a
    slice at a time: nothing waits for more than one slice or one pass over the rows."""
    index = ledger.index
    index.start_placing()
    bounds = index.scanned_bounds(max(PLACE_SLICE, len(index) // 4))
    for lo, hi in zip([0] + bounds, bounds + [None]):
        order = index.scanned_order(lo, hi)
        for start in range(0, len(order) // 8, PLACE_SLICE):
            with ledger.lock:
                index.place_rows(order, start, start + PLACE_SLICE)
            time.sleep(0)  # the serving threads' turn
        del order
    with ledger.lock:
        ledger.build = None
        ledger.unscanned = 0
        return _enforce_capacity_locked(ledger)


def begin_reorder(ledger: Ledger) -> List[int]:
    """The scan ended (Python policies): from now on what the store does is journaled for finish_build
    to replay.  Returns the digests committed during the scan, in order (they go after every scanned one)."""
    with ledger.lock:
        return ledger.build.start_journal()


def finish_build(ledger: Ledger, policies: Dict[int, EvictionPolicy]) -> List[Victim]:
    """Install the eviction orders built outside the lock (one a namespace hash, from begin_reorder
    on), after replaying onto them what the store did meanwhile; end the build; evict down to
    capacity.  The lock is held for the journal's length, not the index's."""
    with ledger.lock:
        ledger.index.place_scanned()  # their stamps back to "never refreshed"
        build, ledger.build = ledger.build, None
        ledger.unscanned = 0
        for op, digest, ns_hash in build.journal or ():
            policy = policies.get(ns_hash)
            if policy is None:
                policy = policies[ns_hash] = ledger.tenants.new_policy()
            if op == "touch":
                policy.touch(digest)
                continue
            policy.remove(digest)
            if op == "fresh" and digest in ledger.index:
                policy.insert(digest)
        ledger.tenants.install_orders(policies)
        return _enforce_capacity_locked(ledger)


def _enforce_capacity_locked(ledger: Ledger) -> List[Victim]:
    victims = []
    while ledger.used > ledger.capacity:  # capacity lowered since the last run, or written meanwhile
        victim = ledger.pop_victim_locked(None)
        if victim is None:
            break
        victims.append(victim)
    return victims
