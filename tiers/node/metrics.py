"""Counters a daemon keeps about its own work (exported by stats and Prometheus)."""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict


class DaemonMetrics:
    """Request counts, errors by code, pages and bytes moved, latency sums."""

    def __init__(self, tier: str):
        self.tier = tier
        self._lock = threading.Lock()
        self.requests: Dict[str, int] = defaultdict(int)
        self.latency_sum: Dict[str, float] = defaultdict(float)
        self.errors: Dict[str, int] = defaultdict(int)
        self.pages_moved: Dict[str, int] = defaultdict(int)
        self.bytes_moved: Dict[str, int] = defaultdict(int)
        self.lookup_keys = 0
        self.lookup_prefix_hits = 0
        self.promotions = 0  # pages put here because a lower tier served them
        self.observers = []  # callables(op, seconds): the Prometheus exporter hooks in here

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self.requests[op] += 1
            self.latency_sum[op] += seconds
        for observer in self.observers:
            observer(op, seconds)

    def error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1

    def pages(self, op: str, count: int, nbytes: int) -> None:
        with self._lock:
            self.pages_moved[op] += count
            self.bytes_moved[op] += nbytes

    def lookup(self, keys: int, prefix: int) -> None:
        with self._lock:
            self.lookup_keys += keys
            self.lookup_prefix_hits += prefix

    def snapshot(self) -> dict:
        with self._lock:
            out = {
                "requests": dict(self.requests),
                "latency_s_sum": dict(self.latency_sum),  # per op: seconds from receipt to reply (a streamed get: to its reads' end), summed
                "errors": dict(self.errors),
                "pages_put": self.pages_moved["put"],
                "pages_got": self.pages_moved["get"],
                "bytes_put": self.bytes_moved["put"],
                "bytes_got": self.bytes_moved["get"],
                "lookup_keys": self.lookup_keys,
                "lookup_prefix_hits": self.lookup_prefix_hits,
                "promotions": self.promotions,
            }
        return out
