"""Rendezvous placement, remote/pool configuration, and a pool that must not fall back to TCP."""
import collections

import pytest

from tiers.ops.config import ConfigError, parse_config
from tiers.ops.node_runner import NodeRunner
from tiers.stores.remote.loopback import free_ports, pool_config
from tiers.stores.remote.placement import Rendezvous

KEYS = [f"page-{i:05d}" for i in range(20000)]
POOLS = [f"tcp://10.0.0.{i}:7100" for i in range(1, 5)]


def test_keys_spread_evenly_and_deterministically():
    placement = Rendezvous(POOLS[:3])
    counts = collections.Counter(placement.pick(k) for k in KEYS)
    assert set(counts) == set(POOLS[:3])
    assert max(counts.values()) < 1.05 * len(KEYS) / 3
    assert [Rendezvous(POOLS[:3]).pick(k) for k in KEYS[:100]] == [placement.pick(k) for k in KEYS[:100]]


def test_adding_a_pool_moves_only_its_share():
    before, after = Rendezvous(POOLS[:3]), Rendezvous(POOLS)
    moved = [(before.pick(k), after.pick(k)) for k in KEYS if before.pick(k) != after.pick(k)]
    assert {new for _old, new in moved} == {POOLS[3]}  # keys move only to the new pool
    assert abs(len(moved) - len(KEYS) / 4) < 0.05 * len(KEYS)
    # Removing it again puts exactly those keys back.
    assert all(before.pick(k) == Rendezvous(POOLS[:3]).pick(k) for k in KEYS[:500])


def test_order_of_the_pool_list_does_not_matter():
    assert [Rendezvous(POOLS).pick(k) for k in KEYS[:300]] == [Rendezvous(POOLS[::-1]).pick(k) for k in KEYS[:300]]


def test_weights_scale_shares():
    placement = Rendezvous(POOLS[:2], weights=[1.0, 3.0])
    counts = collections.Counter(placement.pick(k) for k in KEYS)
    assert 0.70 < counts[POOLS[1]] / len(KEYS) < 0.80


def test_remote_and_pool_options_are_checked(tmp_path):
    good = parse_config("""
[[tiers]]
name = "remote"
kind = "remote"
pools = ["tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100"]
protocol = "rdma"
device_name = "mlx5_0,mlx5_1"
require_rdma = true
""", "node.toml", runtime_dir=str(tmp_path), data_dir=str(tmp_path))
    options = good.tier("remote").options
    assert options["pools"] == ["tcp://10.0.0.1:7100", "tcp://10.0.0.2:7100"]
    assert options["metadata_server"] == "P2PHANDSHAKE" and options["require_rdma"] is True
    for bad, where in [('pools = ["10.0.0.1:7100"]', "pools[0]"), ('protocol = "ib"', "protocol"),
                       ('pool_weights = [1, -2]', "pool_weights[1]"), ('pools = "tcp://a:1"', "pools")]:
        with pytest.raises(ConfigError, match=where.replace("[", r"\[").replace("]", r"\]")):
            parse_config(f'[[tiers]]\nname = "remote"\nkind = "remote"\n{bad}\n', "node.toml",
                         runtime_dir=str(tmp_path), data_dir=str(tmp_path))


def test_a_pool_that_requires_rdma_fails_loudly_without_it(tmp_path):
    pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")
    (port,) = free_ports(1)
    config = pool_config([port], capacity="8MiB") + 'protocol = "rdma"\nrequire_rdma = true\n'
    runner = NodeRunner(config, str(tmp_path / "run"), str(tmp_path / "data"))
    with pytest.raises(RuntimeError, match="exited with 1"):
        runner.start(timeout=20)
    log = open(runner.log_path).read()
    assert "no usable RDMA device" in log and "require_rdma" in log
