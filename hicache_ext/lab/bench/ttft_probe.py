"""What the server and the node's daemons say around one timed request of the TTFT part.

Three sources, kept apart so every figure says where it comes from:
- the bench: the request's wall time (HTTP /generate with max_new_tokens=1);
- SGLang: ``cached_tokens_details`` and the request's timings in ``meta_info``
  (``--enable-metrics``: queue_time, storage_prefetch_wait, the forward pass),
  and the storage counters and histograms of ``GET /metrics``
  (``sglang:prefetch_pgs``, ``sglang:prefetch_bandwidth``, from the backend's
  ``get_stats()``);
- the daemons: each tier's stats (``latency_s_sum`` and ``requests`` per op,
  ``pages_got``, ``pages_put``), read through an ``_admin`` session.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tiers.ops.config import TierConfig
from tiers.wire.client import Deadlines, TierClient

# SGLang's storage figures read around a request (name -> the sample's sum over its label sets).
SGLANG_FIGURES = ("sglang:prefetch_pgs_sum", "sglang:prefetch_pgs_count", "sglang:prefetch_bandwidth_sum",
                  "sglang:prefetch_bandwidth_count", "sglang:prefetched_tokens_total")


class ProbeError(RuntimeError):
    """A daemon did not answer its stats, or the node did not settle in time."""


def sglang_figures(text: str) -> Dict[str, float]:
    """SGLANG_FIGURES from a Prometheus text page (0 for a figure not there yet)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = dict.fromkeys(SGLANG_FIGURES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += float(sample.value)
    return out


class TierProbe:
    """One admin session per tier of the node: stats, settling, clearing."""

    def __init__(self, tiers: List[TierConfig], timeout: float = 10.0):
        self.tiers = list(tiers)
        self.timeout = timeout
        self._clients: Dict[str, TierClient] = {}

    def _client(self, tier: TierConfig) -> TierClient:
        client = self._clients.get(tier.name)
        if client is None:
            from tiers.node.sessions import ADMIN_NAMESPACE
            deadlines = Deadlines(base=self.timeout, lookup=self.timeout, connect_wait=self.timeout / 2)
            client = self._clients[tier.name] = TierClient(tier.name, tier.endpoint, ADMIN_NAMESPACE,
                                                           client_name="hicache-bench-ttft", deadlines=deadlines,
                                                           curve=tier.curve)
        return client

    def _ask(self, tier: TierConfig, ask):
        """ask(client) until it answers (a fresh session after a miss), at most self.timeout seconds."""
        deadline = time.monotonic() + self.timeout
        while True:
            answer = ask(self._client(tier))
            if answer is not None:
                return answer
            self._clients.pop(tier.name).close()  # a client marked down answers nothing until its probe
            if time.monotonic() > deadline:
                raise ProbeError(f"tier {tier.name} at {tier.endpoint} did not answer within {self.timeout:g} s")
            time.sleep(0.1)

    def stats(self) -> Dict[str, dict]:
        return {t.name: self._ask(t, lambda c: c.stats()) for t in self.tiers}

    def clear(self, names: Optional[List[str]] = None) -> None:
        """Remove every page of every namespace from the named tiers (all by default)."""
        for tier in self.tiers:
            if names is None or tier.name in names:
                self._ask(tier, lambda c: c.clear(everything=True))

    def settle(self, before: Dict[str, dict], new_pages: int, quiet: float = 0.3, timeout: float = 120.0) -> None:
        """Wait until every tier has stored new_pages more pages than in before and then nothing for quiet s."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while True:
            now = self.stats()
            puts = {name: s.get("pages_put", 0) for name, s in now.items()}
            if puts != last:
                last, since = puts, time.monotonic()
            enough = all(puts[name] - before[name].get("pages_put", 0) >= new_pages for name in puts)
            if enough and time.monotonic() - since >= quiet:
                return
            if time.monotonic() > deadline:
                got = {name: puts[name] - before[name].get("pages_put", 0) for name in puts}
                raise ProbeError(f"the tiers stored {got} of {new_pages} new pages within {timeout:g} s")
            time.sleep(0.05)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


@dataclass
class Sample:
    """One timed request: its wall time, SGLang's answer and timings, and what each source says it cost."""

    seconds: float
    cached: Dict[str, int]
    timings: Dict[str, float]  # SGLang's meta_info (queue_time, storage_prefetch_wait, forward)
    served: Dict[str, int] = field(default_factory=dict)  # pages each tier's daemon handed out (pages_got)
    daemon: Dict[str, float] = field(default_factory=dict)  # lookup_s, get_s: daemons' latency sums, seconds
    sglang: Dict[str, float] = field(default_factory=dict)  # prefetch_pages, transfer_s from /metrics


def sample_of(generation, before_tiers: Dict[str, dict], after_tiers: Dict[str, dict],
              before_metrics: Dict[str, float], after_metrics: Dict[str, float], page_bytes: int) -> Sample:
    """The Sample of one request from the stats and /metrics read just before and just after it."""
    served, lookup_s, get_s = {}, 0.0, 0.0
    for name, after in after_tiers.items():
        before = before_tiers[name]
        served[name] = int(after.get("pages_got", 0) - before.get("pages_got", 0))
        lat_a, lat_b = after.get("latency_s_sum", {}), before.get("latency_s_sum", {})
        lookup_s = max(lookup_s, lat_a.get("lookup", 0.0) - lat_b.get("lookup", 0.0))  # the tiers answer at once
        get_s += lat_a.get("get", 0.0) - lat_b.get("get", 0.0)
    delta = {name: after_metrics[name] - before_metrics[name] for name in SGLANG_FIGURES}
    sglang = {"prefetch_pages": delta["sglang:prefetch_pgs_sum"]}
    ops = delta["sglang:prefetch_bandwidth_count"]
    if ops > 0 and delta["sglang:prefetch_bandwidth_sum"] > 0:
        # each op's GB/s is its pages' bytes over its I/O wall time; with the mean over the ops
        mean_gbps = delta["sglang:prefetch_bandwidth_sum"] / ops
        sglang["transfer_s"] = delta["sglang:prefetch_pgs_sum"] * page_bytes / (mean_gbps * 1e9)
    return Sample(seconds=generation.seconds, cached=dict(generation.cached), timings=dict(generation.timings),
                  served=served, daemon={"lookup_s": lookup_s, "get_s": get_s}, sglang=sglang)
