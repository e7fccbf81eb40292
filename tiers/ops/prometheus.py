"""Prometheus exporter of one tier daemon: an HTTP endpoint, off unless a port is configured.

Counters are not kept twice: a custom collector reads the daemon's stats (the
store's counters, DaemonMetrics and daemon state, the same dict the ``stats``
operation returns) at scrape time.  Only request latencies are recorded here,
as histograms fed by the ``DaemonMetrics.observers`` hook.  The metric list is
in docs/OPERATIONS.md.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterator, Optional

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("hicache.metrics")

PREFIX = "hicache_tier_"
# From a 50 us lookup to a multi-second batch of large pages.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# stats key -> (metric name without prefix, help); gauges are levels, counters only grow.
GAUGES = {
    "capacity_bytes": ("capacity_bytes", "Bytes the tier may hold."),
    "used_bytes": ("used_bytes", "Bytes of pages held."),
    "pages": ("pages", "Pages held."),
    "dirty_pages": ("dirty_pages", "Pages acknowledged here and not yet written to the tier below (write-back, selective)."),
    "write_back_unsafe_pages": ("write_back_unsafe_pages", "Acknowledged write-back pages not yet acknowledged by "
                                                           "the tier below (what a crash would lose; at most "
                                                           "max_dirty_pages)."),
    "sessions": ("sessions", "Open client sessions (engine ranks and tools)."),
    "regions": ("regions", "Host-pool shared-memory regions mapped."),
}
COUNTERS = {
    "hits": ("hits", "Page reads served from this tier."),
    "misses": ("misses", "Page reads of pages this tier did not hold."),
    "inserts": ("inserts", "Pages stored."),
    "evictions": ("evictions", "Pages evicted by the eviction policy (capacity and operator evict alike)."),
    "bytes_read": ("read_bytes", "Page bytes read from the store."),
    "bytes_written": ("written_bytes", "Page bytes written into the store."),
    "lookup_keys": ("lookup_keys", "Keys asked about in prefix lookups."),
    "lookup_prefix_hits": ("lookup_prefix_hit_keys", "Keys in the leading runs held (prefix hits) of lookups."),
    "promotions": ("promotions", "Pages put here because a lower tier served them."),
    "demotions": ("demotions", "Pages written down to the tier below."),
    "demotions_by_region": ("demotions_by_region", "Demoted pages the tier below copied out of this tier's arena "
                                                   "(shared memory, aligned for O_DIRECT) instead of receiving frames."),
    "demotion_failures": ("demotion_failures", "Pages the tier below refused or could not take."),
    "demotion_dropped": ("demotion_dropped", "Selective pages evicted while the demotion queue was full (lost to the tiers below)."),
    "write_back_written_down": ("write_back_written_down", "Write-back pages a put wrote below before it was answered "
                                                           "(the dirty bound was reached)."),
    "write_back_refused": ("write_back_refused", "Write-back pages stored but not acknowledged: the dirty bound was "
                                                 "reached and the tier below could not take the oldest."),
    "source_gone": ("source_gone", "Writes refused because the engine's host pool shrank under the copy."),
    "staging_full": ("staging_full", "Pages not moved because the staging arena was full."),
    "leases_expired": ("leases_expired", "Read leases that ended by time instead of a release."),
}
SKIP = {"requests", "errors", "pages_put", "pages_got", "bytes_put", "bytes_got", "lower_tier", "tier"}
# Per-namespace figures (the largest 32 namespaces only: label cardinality stays bounded).
NAMESPACE_GAUGES = {"bytes": ("namespace_bytes", "Bytes of pages held, per namespace."),
                    "pages": ("namespace_pages", "Pages held, per namespace."),
                    "fair_share": ("namespace_fair_share_bytes", "Capacity over namespaces holding pages."),
                    "quota": ("namespace_quota_bytes", "The namespace's configured quota (0: none).")}
NAMESPACE_COUNTERS = {"hits": ("namespace_hits", "Page reads served, per namespace."),
                      "evictions": ("namespace_evictions", "Pages evicted, per namespace.")}


class TierCollector:
    """Reads the daemon's stats at scrape time and yields metric families."""

    def __init__(self, daemon, kind: str):
        self.daemon = daemon
        self.kind = kind

    def describe(self) -> list:
        return []  # collect() only at scrape time, never at registration

    def collect(self) -> Iterator[Metric]:
        stats = self.daemon.stats()
        tier = self.daemon.name
        info = GaugeMetricFamily(PREFIX + "info", "Constant 1: the tier's kind and the tier it demotes to.",
                                 labels=["tier", "kind", "lower_tier"])
        info.add_metric([tier, self.kind, str(stats.get("lower_tier", ""))], 1)
        yield info
        for key, (name, text) in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, text, labels=["tier"])
            family.add_metric([tier], float(stats.get(key, 0)))
            yield family
        for key, (name, text) in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, text, labels=["tier"])
            family.add_metric([tier], float(stats.get(key, 0)))
            yield family
        moved = [("put", "pages_put", "bytes_put"), ("get", "pages_got", "bytes_got")]
        pages = CounterMetricFamily(PREFIX + "transferred_pages", "Pages moved by put and get requests.",
                                    labels=["tier", "op"])
        nbytes = CounterMetricFamily(PREFIX + "transferred_bytes", "Page bytes moved by put and get requests.",
                                     labels=["tier", "op"])
        for op, pages_key, bytes_key in moved:
            pages.add_metric([tier, op], float(stats.get(pages_key, 0)))
            nbytes.add_metric([tier, op], float(stats.get(bytes_key, 0)))
        yield pages
        yield nbytes
        errors = CounterMetricFamily(PREFIX + "request_errors", "Error replies by protocol error code.",
                                     labels=["tier", "code"])
        for code, count in sorted(stats.get("errors", {}).items()):
            errors.add_metric([tier, code], float(count))
        yield errors
        per_ns = stats.get("per_namespace", {})
        for table, family_type in ((NAMESPACE_GAUGES, GaugeMetricFamily), (NAMESPACE_COUNTERS, CounterMetricFamily)):
            for key, (name, text) in table.items():
                family = family_type(PREFIX + name, text, labels=["tier", "namespace"])
                for namespace, figures in sorted(per_ns.items()):
                    family.add_metric([tier, namespace], float(figures.get(key, 0)))
                yield family
        detail = GaugeMetricFamily(PREFIX + "store_detail", "Tier-specific figures the store reports.",
                                   labels=["tier", "name"])
        for key, value in sorted(stats.items()):
            if (key not in GAUGES and key not in COUNTERS and key not in SKIP
                    and isinstance(value, (int, float)) and not isinstance(value, bool)):
                detail.add_metric([tier, key], float(value))
        yield detail


class LatencyObserver:
    """A DaemonMetrics observer: request latency histograms per operation."""

    def __init__(self, tier: str, registry: CollectorRegistry):
        self.tier = tier
        self.histogram = Histogram(PREFIX + "request_duration_seconds", "Time from receiving a request to its reply.",
                                   ["tier", "op"], registry=registry, buckets=LATENCY_BUCKETS)
        self._children: Dict[str, object] = {}

    def __call__(self, op: str, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self.histogram.labels(self.tier, op)
        child.observe(seconds)


class Exporter:
    """The HTTP endpoint of one daemon; close() stops it and unhooks the observer."""

    def __init__(self, daemon, kind: str, port: int, address: str = "127.0.0.1"):
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TierCollector(daemon, kind))
        ProcessCollector(registry=self.registry)
        self.observer = LatencyObserver(daemon.name, self.registry)
        daemon.metrics.observers.append(self.observer)
        self.server, self._thread = start_http_server(port, addr=address, registry=self.registry)
        self.address, self.port = self.server.server_address[:2]

    def close(self) -> None:
        if self.observer in self.daemon.metrics.observers:
            self.daemon.metrics.observers.remove(self.observer)
        self.server.shutdown()
        self.server.server_close()


def start_exporter(daemon, kind: str, port: int, address: str = "127.0.0.1") -> Optional[Exporter]:
    """An exporter on address:port, or None when port is 0 (metrics off)."""
    if not port:
        return None
    exporter = Exporter(daemon, kind, port, address)
    log.info("tier %s: Prometheus metrics on http://%s:%d/metrics", daemon.name, address, exporter.port)
    return exporter
