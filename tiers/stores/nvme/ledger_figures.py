"""What the NVMe tier's ledger reports: the store's stats, a namespace's figures, the native index's size.

Read under the ledger's lock (tiers/stores/nvme/ledger.py), as ledger_rebuild.py and snapshot.py work on
it; the store (tiers/stores/nvme/store.py) is the only caller.
"""
from __future__ import annotations

from typing import Optional

from tiers.stores.base import StoreStats
from tiers.stores.fairness import bounded_top
from tiers.stores.nvme.ledger import Ledger


def index_bytes(ledger: Ledger) -> int:
    """The native index's rows and slots (tiers/stores/page_index.py)."""
    with ledger.lock:
        return ledger.index.nbytes()


def namespace_figures(ledger: Ledger, ns_hash: int) -> Optional[dict]:
    with ledger.lock:
        return ledger.tenants.figures(ns_hash, ledger.index)


def stats(ledger: Ledger) -> StoreStats:
    """The store's counters, byte counts and index figures, one consistent reading."""
    with ledger.lock:
        snap = StoreStats(**{k: v for k, v in ledger.stats.__dict__.items() if k != "extra"})
        snap.pages = len(ledger.index)
        snap.used_bytes = ledger.used
        extra = dict(ledger.extra)
        extra["reserved_bytes"] = ledger.reserved
        extra["unscanned_bytes"] = ledger.unscanned  # a bound: what the restart scan has not counted yet
        extra["usage_ceiling"] = ledger.ceiling.value  # what a restart after a crash would assume is on disk
        extra["usage_ceiling_failures"] = ledger.ceiling.failed
        extra["index_building"] = float(ledger.build is not None)  # 1 while the restart scan runs
        extra["index_bytes"] = ledger.index.nbytes()  # the native index's rows and slots
        per_ns = ledger.tenants.per_namespace(ledger.index)
    snap.per_namespace = bounded_top(per_ns)
    raw, stored = extra.pop("raw_bytes_in"), extra.pop("stored_bytes_in")
    extra["compression_ratio"] = raw / stored if stored else 1.0  # of pages written since start
    snap.extra = extra
    return snap
