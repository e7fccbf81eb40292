"""What a tenant's stats request shows: the tier's figures as of a snapshot, and its own namespace's now.

The store's figures walk every namespace under the store's lock (linear, but
14 ms at 10,000 namespaces and 112 ms at 50,000), on the daemon's loop; a
tenant asking in a loop made the loop do that walk every time.  So tenants
share one snapshot at most MAX_AGE_S old, and each sees only its own
namespace, looked up at once (PageStore.namespace_figures: the snapshot keeps
the 32 largest namespaces, which may not include it).  The operator's requests
(its `_admin` session and its own engines, which read counters right after
their own calls) and the Prometheus exporter read the daemon's stats fresh.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

from tiers.stores.base import PageStore

MAX_AGE_S = 1.0


class TenantStats:
    def __init__(self, store: PageStore, fresh: Callable[[], dict]):
        self._store = store
        self._fresh = fresh  # the daemon's whole stats
        self._snapshot: Optional[Tuple[float, dict]] = None  # (when, stats)

    def view(self, namespace: str, fresh: bool = False) -> dict:
        """What namespace's tenant is shown; fresh: the daemon's figures now (the operator's own engines)."""
        if fresh:
            stats = self._fresh()
        else:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot[0] >= MAX_AGE_S:
                self._snapshot = (now, self._fresh())
            stats = dict(self._snapshot[1])
        listed = stats["per_namespace"]
        # Looked up now where the store can without a walk; else as the figures just taken list it.
        mine = self._store.namespace_figures(namespace) or listed.get(namespace)
        if mine is not None and "fair_share" not in mine:  # the tier's, as they list it (one for all)
            shares = [v["fair_share"] for v in listed.values() if "fair_share" in v]
            mine = {**mine, "fair_share": shares[0]} if shares else mine
        stats["per_namespace"] = {namespace: mine} if mine is not None else {}
        return stats
