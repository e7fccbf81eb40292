"""The mooncake_store tier against a real mooncake_master and two nodes on loopback."""
import mmap
import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

# Pools and the Mooncake Store move pages with the Transfer Engine (the remote-cpu extra).
pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from tiers.wire import protocol as P
from tiers.shm.buffers import address_of
from tiers.wire.client import Deadlines, TierClient
from tests.support.nodes import eventually, node_toml
from tiers.ops.node_runner import NodeRunner, stop_process
from tiers.stores.remote.loopback import free_ports

MASTER = shutil.which("mooncake_master")
pytestmark = pytest.mark.skipif(MASTER is None, reason="mooncake_master is not installed")
PAGE = 256 << 10


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def node_config(master_port: int, segment: str) -> str:
    return node_toml({"name": "mc", "kind": "mooncake_store", "master_server_address": f"127.0.0.1:{master_port}",
                      "global_segment_size": segment, "local_buffer_size": "16MiB", "max_page_bytes": "1MiB"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mooncake")
    rpc, metrics = free_ports(2)
    log = open(tmp / "master.log", "wb")
    master = subprocess.Popen([MASTER, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
                               f"--metrics_port={metrics}", "--enable_metric_reporting=false"],
                              stdout=log, stderr=log, env={**os.environ, "MC_FORCE_TCP": "1"})
    assert eventually(lambda: _listening(rpc) or master.poll() is not None, within=30), "the master never listened"
    nodes = []
    try:
        for name, segment in (("a", "32MiB"), ("b", "0")):
            runner = NodeRunner(node_config(rpc, segment), str(tmp / name / "run"), str(tmp / name / "data"))
            nodes.append(runner)
            runner.start()
        yield nodes
    finally:
        for runner in nodes:
            runner.stop()
        stop_process(master)
        log.close()


def client_with_host_pool(runner):
    client = TierClient("mc", runner.config.tier("mc").endpoint, "model-a", deadlines=Deadlines(base=5.0),
                        attach=True)
    fd = os.memfd_create("host-pool")
    os.ftruncate(fd, 8 << 20)
    host = mmap.mmap(fd, 8 << 20)
    end = time.monotonic() + 10  # a loaded machine may miss the first connect or registration: ask again
    while time.monotonic() < end:
        if client.region_id is None:
            client.attach_region(fd, 8 << 20)
        if client.lookup(["warmup"]) is not None and client.region_id is not None and client.can_lease():
            break
        time.sleep(0.1)
    assert client.region_id is not None
    return client, host, fd


def test_pages_move_between_nodes_through_the_cluster(cluster):
    a, b = cluster
    ca, host_a, fd_a = client_with_host_pool(a)
    cb, host_b, fd_b = client_with_host_pool(b)
    try:
        keys = [f"mc-{i}" for i in range(4)]
        for i in range(4):
            host_a[i * PAGE:(i + 1) * PAGE] = page(i)
        # Page i is split in two regions (K and V), the second half first in memory: two buffers.
        half = PAGE // 2
        pairs = [[(i * PAGE + half, half), (i * PAGE, half)] if i % 2 else [(i * PAGE, PAGE)] for i in range(4)]
        desc, counts = P.encode_descriptors(pairs)
        assert ca.put_region(keys, desc, counts, 4 * PAGE) == [True] * 4
        assert cb.lookup(keys + ["mc-none"]) == b"\x01" * 4 + b"\x00"
        base = address_of(memoryview(host_b))
        assert cb.get_leased(keys, [[(base + (8 + i) * PAGE, PAGE)] for i in range(4)]) == [True] * 4
        for i in range(4):
            got = bytes(host_b[(8 + i) * PAGE:(9 + i) * PAGE])
            expect = page(i) if i % 2 == 0 else page(i)[half:] + page(i)[:half]
            assert got == expect
        # Frames (no shared memory), and delete.
        assert cb.put_frames(["mc-fr"], [[page(9)]], PAGE) == [True]
        found, frames = ca.get_frames(["mc-fr", "mc-none"], 2 * PAGE)
        assert found == [True, False] and bytes(frames[0].buffer) == page(9)
        assert ca.delete(["mc-fr"]) == 1
        assert cb.lookup(["mc-fr"]) == b"\x00"
        stats = ca.stats()
        assert stats["master_healthy"] == 1 and stats["inserts"] == 4
    finally:
        for client, host, fd in ((ca, host_a, fd_a), (cb, host_b, fd_b)):
            client.close()
            host.close()
            os.close(fd)


def _listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port (the master, once it serves)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
