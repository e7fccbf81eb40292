"""The Prometheus endpoint of a real daemon, scraped over HTTP while a workload runs."""
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.nodes import RawPeer, dram_tier, node_toml
from tests.support.ops import DaemonProcess, free_port


def scrape(port: int) -> dict:
    """{(sample name, frozenset(labels)): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset({"tier": "dram", **labels}.items()))]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    config = node_toml(dram_tier("1MiB", metrics_port=port), metrics_address="127.0.0.1")
    proc = DaemonProcess(str(tmp_path_factory.mktemp("metrics")), config)
    proc.port = port
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0


def test_counters_move_during_a_workload(daemon):
    before = scrape(daemon.port)
    assert value(before, "hicache_tier_info", kind="dram", lower_tier="") == 1
    assert value(before, "hicache_tier_capacity_bytes") == 1 << 20
    peer = RawPeer(daemon.endpoint)
    session = peer.hello("metrics-ns")
    page = b"m" * 65536
    for round_ in range(3):  # 48 pages of 64 KiB into 1 MiB: evictions
        keys = [f"r{round_}p{i}" for i in range(16)]
        reply, _ = peer.call("put", s=session, keys=keys, frames=[page] * 16)
        assert reply["ok"]
        reply, frames = peer.call("get", s=session, keys=keys[-4:] + ["absent"])
        assert len(frames) == 4
    reply, _ = peer.call("lookup", s=session, keys=["x/y"])  # an error reply
    assert reply["code"] == "bad_request"
    peer.close()
    after = scrape(daemon.port)
    delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)
    assert delta("hicache_tier_hits_total") == 12
    assert delta("hicache_tier_misses_total") == 3
    assert delta("hicache_tier_inserts_total") == 48
    assert delta("hicache_tier_evictions_total") >= 32
    assert delta("hicache_tier_written_bytes_total") == 48 * 65536
    assert delta("hicache_tier_read_bytes_total") == 12 * 65536
    assert delta("hicache_tier_transferred_bytes_total", op="put") == 48 * 65536
    assert delta("hicache_tier_transferred_pages_total", op="get") == 12
    assert value(after, "hicache_tier_used_bytes") == 16 * 65536
    assert value(after, "hicache_tier_pages") == 16
    assert value(after, "hicache_tier_request_errors_total", code="bad_request") >= 1
    # Latency histograms per operation, fed by DaemonMetrics.observers.
    assert value(after, "hicache_tier_request_duration_seconds_count", op="put") == 3
    assert value(after, "hicache_tier_request_duration_seconds_count", op="get") == 3
    assert value(after, "hicache_tier_request_duration_seconds_bucket", op="get", le="+Inf") == 3
    assert value(after, "hicache_tier_request_duration_seconds_sum", op="put") > 0
    assert ("process_resident_memory_bytes", frozenset()) in after
    # Per namespace, with the namespace as a label.
    assert value(after, "hicache_tier_namespace_pages", namespace="metrics-ns") == 16
    assert value(after, "hicache_tier_namespace_bytes", namespace="metrics-ns") == 16 * 65536
    assert value(after, "hicache_tier_namespace_evictions_total", namespace="metrics-ns") >= 32
    assert value(after, "hicache_tier_namespace_hits_total", namespace="metrics-ns") >= 12


def test_metrics_are_off_unless_configured(tmp_path):
    from tiers.ops.config import parse_config
    config = parse_config(node_toml(dram_tier()), "node.toml")
    assert config.metrics_port == 0 and config.tier("dram").metrics_port == 0
    base = parse_config(node_toml(dram_tier(name="a"), dram_tier(name="b", metrics_port=0), dram_tier(name="c"),
                                  metrics_port=9470), "node.toml")
    assert [t.metrics_port for t in base.tiers] == [9470, 0, 9472]


def test_a_metrics_port_in_use_fails_the_start_with_1(daemon, tmp_path):
    config = node_toml(dram_tier("1MiB", metrics_port=daemon.port))
    second = DaemonProcess(str(tmp_path), config)
    try:
        assert second.proc.wait(30) == 1
    finally:
        second.stop()
    assert "tier dram cannot start" in second.log() and "Address already in use" in second.log()
    assert not second.notify.messages  # never READY=1
