"""A cluster rehearsal (issue 17): pool nodes and inference nodes in network namespaces of their own.

Short versions of the scenarios of ``scripts/cluster scenario``: the nodes
have their own addresses on a private bridge (no uplink, no default route),
the pool daemons listen on them, the engines run the real backend on real
SGLang host pools.  Skipped, saying why, where network namespaces cannot be
made (not root, or a container without CAP_NET_ADMIN).
"""
import math
import shutil

import pytest

pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from hicache_ext.lab.cluster import scenarios  # noqa: E402
from hicache_ext.lab.cluster.fabric import Fabric, Link, namespaces_permitted, netem_available, remove_stale  # noqa: E402
from hicache_ext.lab.cluster.rehearsal import Cluster, Layout  # noqa: E402

ENGINE_SIDE = True  # the engines import SGLang (in their own processes)
WHY_NOT = namespaces_permitted()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces not permitted here: {WHY_NOT}"),
              pytest.mark.slow]

PAGES, PAGE = 16, 256 << 10
SCHEDULING_SLACK_S = 0.25  # calls are timed around SGLang's page function; 2 busy vCPUs delay the return


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two pools behind CurveZMQ and two engines: every scenario of the module runs on it (a cluster's start,
    with its engines' imports of SGLang, is most of what a scenario costs here)."""
    from tiers.wire.security import generate
    remove_stale()
    root = tmp_path_factory.mktemp("cluster")
    generate(str(root / "keys"), ("server", "client"))
    layout = Layout(pools=2, engines=2, page_bytes=PAGE, pages=PAGES, pool_capacity="64MiB",
                    backend={"deadline_base_s": 1.0}, curve_dir=str(root / "keys"),
                    remote={"pool_timeout_ms": 200, "pool_retry_max_ms": 500, "transfer_timeout_ms": 500})
    with Cluster(str(root / "c"), layout) as c:
        yield c


def test_the_fabric_reaches_only_its_own_addresses():
    import subprocess
    import sys
    with Fabric(2) as fabric:
        server = subprocess.Popen([*fabric.prefix_of(1), sys.executable, "-c",
                                   "import socket; s = socket.socket(); s.bind(('0.0.0.0', 7399)); s.listen(); "
                                   "print('up', flush=True); c, _ = s.accept(); c.sendall(b'hello')"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            got = fabric.run(0, [sys.executable, "-c", f"import socket; c = socket.create_connection(("
                                                       f"'{fabric.addresses[1]}', 7399), 5); print(c.recv(5))"])
            assert "hello" in got  # node 0 reaches node 1 across the bridge
        finally:
            server.kill()
            server.wait()
        routes = fabric.run(0, ["ip", "route"])
        assert "default" not in routes and fabric.prefix in routes
        listed = fabric.run(0, ["ip", "-o", "link"])
        assert "eth0" in listed and "br0" not in listed  # the bridge lives in the switch namespace only
    assert not [ns for ns in fabric.nodes if ns in _namespaces()]  # all removed


def _namespaces():
    import subprocess
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_an_engine_on_another_node_reads_bit_exact_what_one_wrote(cluster):
    got = scenarios.share(cluster, salt=1, seed=5)
    assert got["written"] == PAGES and got["found"] == PAGES
    assert got["pages_read"] == PAGES and got["wrong_pages"] == 0
    assert got["bytes_checked"] == PAGES * PAGE


@pytest.mark.parametrize("how", ["kill", "partition"])
def test_a_pool_lost_mid_batch_costs_no_wrong_page_and_no_late_call(cluster, how):
    got = scenarios.pool_failure(cluster, how, rounds=2, recover_within=20.0)
    assert got["wrong_pages"] == 0 and got["bytes_checked"] > 0
    assert got["written_while_down"] == PAGES  # pool 0's keys went to the pool that answers...
    assert got["whole_batches_again_s"] < 5.0, got  # ...within a few calls of the failure
    assert got["worst_call_s"] <= got["deadline_s"] + SCHEDULING_SLACK_S, got
    assert math.isfinite(got["recovered_s"]) and got["recovered_s"] < 20.0, got
    # ...and every node uses it again (the next test measures on a whole cluster)
    assert math.isfinite(got["read_whole_again_s"]) and got["read_whole_again_s"] < 20.0, got


def test_a_rate_limited_link_moves_the_same_bytes_more_slowly(cluster):
    got = scenarios.netem(cluster, Link(rate="200mbit"), rounds=1)  # raises on a wrong or missing page
    assert got["shaped_write_gbps"] < 0.2 * 200e6 / 8 / 1e9 * 5  # at most a few times the 25 MB/s link
    assert got["shaped_write_gbps"] < got["plain_write_gbps"]


@pytest.mark.skipif(netem_available() is not None, reason=f"no netem in this kernel: {netem_available()}")
def test_a_slow_lossy_link_moves_the_same_bytes(cluster):
    got = scenarios.netem(cluster, Link(delay_ms=1.0, loss_pct=0.1), rounds=1)  # raises on a wrong page
    assert got["shaped_lookup_ms"] >= 1.0  # a lookup crosses a shaped link at least once


def test_pools_behind_curvezmq_serve_keyed_nodes_and_refuse_others(cluster):
    got = scenarios.curve(cluster)
    assert got["written"] == PAGES and got["pages_read"] == PAGES and got["wrong_pages"] == 0
    assert got["keyed_hello_answered"] is True
    assert got["keyless_hello_answered"] is False  # a node of the fabric without the keys is refused


@pytest.mark.skipif(shutil.which("mooncake_master") is None, reason="mooncake_master is not installed")
def test_the_mooncake_store_kind_shares_across_nodes_and_survives_a_lost_node(tmp_path):
    """kind = "mooncake_store": a mooncake_master on one node, each inference node a store client giving
    memory to the cluster.  Pages cross nodes bit-exact; a killed store node costs misses, not wrong pages
    or late calls, and the cluster serves whole batches again once the master drops its memory."""
    layout = Layout(pools=1, engines=2, page_bytes=PAGE, pages=PAGES, kind="mooncake_store",
                    backend={"deadline_base_s": 1.0}, store_client_ttl_s=3)
    with Cluster(str(tmp_path / "c"), layout) as c:
        shared = scenarios.share(c, salt=3, seed=3)
        lost = scenarios.store_node_failure(c, "kill", rounds=2, recover_within=40.0)
    print(f"\nmooncake store: shared {shared}; node 1 lost {lost}")
    assert shared["found"] == PAGES and shared["pages_read"] == PAGES and shared["wrong_pages"] == 0
    assert lost["wrong_pages"] == 0 and lost["worst_call_s"] <= lost["deadline_s"] + SCHEDULING_SLACK_S, lost
    assert math.isfinite(lost["whole_batches_again_s"]) and math.isfinite(lost["recovered_s"]), lost
