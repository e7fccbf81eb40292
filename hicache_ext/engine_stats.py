"""The per-call transfer records SGLang's ``get_stats()`` drains, kept bounded.

SGLang calls ``get_stats()`` only with ``--enable-cache-report``/storage
metrics on; without it nobody drains, so records are kept in rings of the
last ``RING`` calls each (what a scrape sees after a long pause is the
recent past, which is what its histograms are for), and totals are counted
as plain integers that never grow.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import List

RING = 4096  # records per kind kept between two get_stats() calls


class TransferStats:
    def __init__(self, ring: int = RING):
        self._lock = threading.Lock()
        self._prefetch_pgs: deque = deque(maxlen=ring)
        self._prefetch_bw: deque = deque(maxlen=ring)
        self._backup_pgs: deque = deque(maxlen=ring)
        self._backup_bw: deque = deque(maxlen=ring)
        self.prefetch_pages_total = 0
        self.backup_pages_total = 0

    def record(self, backup: bool, flags: List[bool], page_bytes: int, started: float) -> None:
        """One call's pages moved and its GB/s (as SGLang's other backends report)."""
        done = sum(flags)
        gbps = done * page_bytes / max(time.perf_counter() - started, 1e-9) / 1e9
        with self._lock:
            if backup:
                self._backup_pgs.append(done)
                self._backup_bw.append(gbps)
                self.backup_pages_total += done
            else:
                self._prefetch_pgs.append(done)
                self._prefetch_bw.append(gbps)
                self.prefetch_pages_total += done

    def held(self) -> int:
        """Records waiting for get_stats() (bounded by the rings)."""
        with self._lock:
            return len(self._prefetch_pgs) + len(self._backup_pgs)

    def drain(self):
        """SGLang's StorageMetrics of the calls since the last drain."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        with self._lock:
            metrics = StorageMetrics(prefetch_pgs=list(self._prefetch_pgs), backup_pgs=list(self._backup_pgs),
                                     prefetch_bandwidth=list(self._prefetch_bw),
                                     backup_bandwidth=list(self._backup_bw))
            for ring in (self._prefetch_pgs, self._prefetch_bw, self._backup_pgs, self._backup_bw):
                ring.clear()
        return metrics
