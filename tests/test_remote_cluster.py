"""Three pool daemons and two inference nodes on loopback, all real processes.

Pages travel through the Mooncake Transfer Engine over TCP; they are checked
byte for byte.  A killed or frozen pool costs only its own keys, within the
deadline, and serves again once it is back.
"""
import mmap
import os
import signal
import time

import numpy as np
import pytest

# Pools and the Mooncake Store move pages with the Transfer Engine (the remote-cpu extra).
pytest.importorskip("mooncake.engine", reason="needs the Mooncake Transfer Engine (pip install -e .[remote-cpu])")

from tiers.wire import protocol as P
from tiers.shm.buffers import address_of
from tiers.wire.client import Deadlines, TierClient
from tiers.ops.node_runner import NodeRunner
from tiers.stores.remote.placement import Rendezvous
from tiers.stores.remote.loopback import free_ports, pool_config, pool_endpoints, remote_node_config
from tests.support.nodes import eventually

PAGE = 256 << 10
HOST_POOL = 32 << 20  # 128 pages: writes from slot 0, reads into slot 64 on
CALL_BOUND = 1.5  # seconds: no call may take longer, whatever the pools do


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


class Node:
    """An inference node: its remote tier daemon and an engine-side client with a memfd host pool."""

    def __init__(self, tmp, name: str, ports):
        self.runner = NodeRunner(remote_node_config(ports), str(tmp / name / "run"), str(tmp / name / "data"))
        try:
            self.runner.start()
            self._connect()
        except BaseException:
            self.runner.stop()  # no daemon outlives a failed start
            raise

    def _connect(self):
        self.client = TierClient("remote", self.runner.config.tier("remote").endpoint, "model-a",
                                 deadlines=Deadlines(base=1.0, lookup=0.5, backoff_max=0.5), attach=True)
        self.fd = os.memfd_create("host-pool")
        os.ftruncate(self.fd, HOST_POOL)
        self.host = mmap.mmap(self.fd, HOST_POOL)
        # A loaded machine may miss the first connect or registration (the client then backs off, or
        # falls back to frames): ask until the tier answers and has the host pool.
        assert eventually(self._registered)

    def _registered(self) -> bool:
        if self.client.region_id is None:
            self.client.attach_region(self.fd, HOST_POOL)  # registers again when the session is open
        return (self.client.lookup(["warmup"]) == b"\x00" and self.client.region_id is not None
                and self.client.can_lease())

    def put(self, keys, seeds, slot0: int = 0):
        """Write pages through the shared host pool (one-sided from the mapping)."""
        pairs = []
        for i, seed in enumerate(seeds):
            off = (slot0 + i) * PAGE
            self.host[off:off + PAGE] = page(seed)
            pairs.append([(off, PAGE)])
        desc, counts = P.encode_descriptors(pairs)
        return self.client.put_region(keys, desc, counts, PAGE * len(keys))

    def get(self, keys, slot0: int = 64):
        """Read pages into the host pool; returns (found, pages)."""
        pairs = [[((slot0 + i) * PAGE, PAGE)] for i in range(len(keys))]
        for off, n in (p[0] for p in pairs):
            self.host[off:off + n] = b"\0" * n
        base = address_of(memoryview(self.host))
        found = self.client.get_leased(keys, [[(base + off, n) for off, n in p] for p in pairs])
        return found, [bytes(self.host[off:off + n]) for off, n in (p[0] for p in pairs)]

    def close(self):
        self.client.close()
        self.host.close()
        os.close(self.fd)
        assert self.runner.stop() == {"remote": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote")
    ports = free_ports(3)
    pools = NodeRunner(pool_config(ports), str(tmp / "pools" / "run"), str(tmp / "pools" / "data"))
    nodes = []
    try:
        pools.start()
        for name in ("node-a", "node-b"):
            nodes.append(Node(tmp, name, ports))
        yield pools, nodes, Rendezvous(pool_endpoints(ports)), pool_endpoints(ports)
    finally:
        for node in nodes:
            node.close()
        pools.stop()


def spread_keys(prefix: str, placement, endpoints, each: int):
    """Keys that put `each` pages on every pool (the ports, so the placement, change from run to run)."""
    chosen = {e: [] for e in endpoints}
    i = 0
    while any(len(v) < each for v in chosen.values()):
        key = f"{prefix}-{i}"
        pool = chosen[placement.pick(key)]
        if len(pool) < each:
            pool.append(key)
        i += 1
    return [k for i in range(each) for k in (chosen[e][i] for e in endpoints)]


def timed(fn, *args):
    start = time.monotonic()
    out = fn(*args)
    elapsed = time.monotonic() - start
    assert elapsed < CALL_BOUND, f"{fn.__name__} took {elapsed:.2f}s"
    return out


def test_pages_cross_nodes_byte_for_byte(cluster):
    pools, (a, b), placement, endpoints = cluster
    keys = spread_keys("rt", placement, endpoints, 4)  # every pool holds four
    assert a.put(keys, range(12)) == [True] * 12
    assert b.client.lookup(keys + ["rt-absent"]) == b"\x01" * 12 + b"\x00"
    found, got = b.get(keys)
    assert found == [True] * 12
    assert all(g == page(i) for i, g in enumerate(got))
    # The frames path (no shared memory) goes through the tier's staging slots.
    stored = b.client.put_frames(["fr-0", "fr-1"], [[page(100)], [page(101)[:1000], page(101)[1000:]]], 2 * PAGE)
    assert stored == [True, True]
    found, frames = a.client.get_frames(["fr-0", "fr-1", "fr-none"], 3 * PAGE)
    assert found == [True, True, False]
    assert [bytes(f.buffer) for f in frames] == [page(100), page(101)]
    stats = a.client.stats()  # the tier sums what its pools hold
    assert stats["pools"] == 3 and stats["pools_down"] == 0
    assert stats["capacity_bytes"] == 3 * (64 << 20) and stats["pages"] >= 14


def test_overwrite_and_delete(cluster):
    _pools, (a, b), _placement, _endpoints = cluster
    assert a.put(["ow"], [1]) == [True]
    assert b.put(["ow"], [2]) == [True]
    found, got = a.get(["ow"])
    assert found == [True] and got[0] == page(2)
    assert a.client.delete(["ow"]) == 1
    assert b.client.lookup(["ow"]) == b"\x00"


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_lost_pool_costs_only_its_keys_and_rejoins(cluster, fault):
    """Its pages miss (never wrong), new pages go to the pools that answer, and it is used again once back."""
    pools, (a, b), placement, endpoints = cluster
    keys = [f"{fault}-{i}" for i in range(18)]
    assert a.put(keys, range(200, 218)) == [True] * 18
    victim = endpoints.index(placement.pick(keys[0]))
    name = f"pool{victim}"
    lost = [placement.pick(k) == endpoints[victim] for k in keys]
    pid = pools.pid(name)
    if fault == "kill":
        pools.kill(name)
    else:
        os.kill(pid, signal.SIGSTOP)  # a partition: the pool's sockets stay open but nothing answers
    try:
        for node in (a, b):
            held = timed(node.client.lookup, keys)
            assert held is not None, "the remote tier itself must keep answering"
            assert [h == 1 for h in held] == [not x for x in lost]
            found, got = timed(node.get, keys)
            assert found == [not x for x in lost]
            assert all(g == page(200 + i) for i, (g, ok) in enumerate(zip(got, found)) if ok)
            # The pool is counted down now: its keys go to each key's next pool, so every put lands.
            stored = timed(node.put, [f"{k}-new" for k in keys], range(300, 318))
            assert stored == [True] * 18
            # Read back: a found page is exact (once the back-off ends a call probes the lost pool again,
            # and a frozen one makes that call's pages on it miss).
            found, got = node.get([f"{k}-new" for k in keys])
            assert any(found) and all(g == page(300 + i) for i, (g, ok) in enumerate(zip(got, found)) if ok)
            assert timed(node.client.stats)["pools_down"] == 1
    finally:
        if fault == "freeze":
            os.kill(pid, signal.SIGCONT)
    if fault == "kill":
        pools.start(name)
    # Back (restarted: empty; thawed: with its pages): each node uses it again after its back-off
    # (pool_retry_max_ms, 1 s here); once every back-off has lapsed, the next call of each node probes it.
    time.sleep(1.3)
    # Written again with the bytes they had: a key names its content (SGLang's page hashes); while a pool
    # is down its keys go to their next pool, so a thawed pool's copy must be the same page (REMOTE.md).
    back = [k for k, x in zip(keys, lost) if x]
    seeds = [200 + i for i, x in enumerate(lost) if x]
    # Until a node's back-off lapses it writes the lost pool's keys to their next pool, where a node
    # that already uses the returned pool does not look: written again until both agree (a cache miss
    # meanwhile, never a wrong page).
    assert eventually(lambda: all(a.put(back, seeds)) and all(b.get(back)[0]))
    found, got = b.get(back)
    assert found == [True] * len(back)
    assert got == [page(s) for s in seeds]
    # The calls above may all have gone to the lost pool's stand-ins while a node still counted it down;
    # let every back-off lapse (pool_retry_max_ms, 1 s) so the next test starts with every pool in use.
    time.sleep(1.3)


@pytest.mark.parametrize("fields, code", [
    (dict(op="alloc", keys=["a"], sizes=b"\x01"), "bad_request"),                   # sizes of the wrong length
    (dict(op="alloc", keys=["a"], sizes=P.encode_sizes([-5])), "bad_request"),
    (dict(op="alloc", keys=["a"], sizes=P.encode_sizes([1 << 41])), "too_large"),
    (dict(op="alloc", keys=["a"], sizes=P.encode_sizes([10]), ttl="soon"), "bad_request"),
    (dict(op="commit", keys=["a"], lease="x"), "bad_request"),
    (dict(op="locate", keys=["a"], done="all"), "bad_request"),
    (dict(op="locate", keys=["../x"]), "bad_request"),
    (dict(op="release", lease=None), "bad_request"),
])
def test_pools_answer_malformed_requests_with_errors(cluster, fields, code):
    from tests.support.nodes import RawPeer
    _pools, _nodes, _placement, endpoints = cluster
    peer = RawPeer(endpoints[0])
    try:
        session = peer.hello()
        op = fields.pop("op")
        reply, _ = peer.call(op, s=session, **fields)
        assert reply["ok"] is False and reply["code"] == code, reply
        reply, _ = peer.call("commit", s=session, keys=["a"], lease=12345)  # an unknown lease: nothing committed
        assert reply["ok"] and reply["committed"] == b"\x00"
    finally:
        peer.close()


def test_pools_refuse_oversized_pages_one_by_one(cluster):
    from tests.support.nodes import RawPeer
    _pools, _nodes, _placement, endpoints = cluster
    peer = RawPeer(endpoints[0])
    try:
        session = peer.hello()
        reply, _ = peer.call("alloc", s=session, keys=["small", "huge"], sizes=P.encode_sizes([10, 1 << 30]))
        assert reply["ok"] and reply["granted"] == b"\x01\x00" and reply["refusal"][0] == "too_large"
        peer.call("release", s=session, lease=reply["lease"])
    finally:
        peer.close()


def test_pool_operations_sent_to_a_node_tier_are_unknown(cluster):
    from tests.support.nodes import RawPeer
    _pools, (a, _b), _placement, _endpoints = cluster
    peer = RawPeer(a.runner.config.tier("remote").endpoint)
    try:
        reply, _ = peer.call("alloc", s=peer.hello(), keys=["a"], sizes=P.encode_sizes([1]))
        assert reply["ok"] is False and reply["code"] == "unknown_op"
    finally:
        peer.close()


def test_adding_a_pool_moves_only_its_share(cluster, tmp_path):
    pools, (a, _b), placement, endpoints = cluster
    (port,) = free_ports(1)
    extra = NodeRunner(pool_config([port]).replace('"pool0"', '"pool3"'), str(tmp_path / "p3" / "run"),
                       str(tmp_path / "p3" / "data"))
    bigger = [int(e.rsplit(":", 1)[1]) for e in endpoints] + [port]
    c = None
    try:
        extra.start()
        c = Node(tmp_path, "node-c", bigger)
        keys = [f"grow-{i}" for i in range(40)]  # a quarter move: none moving is a 1e-5 chance
        assert a.put(keys, range(500, 540)) == [True] * 40
        grown = Rendezvous(pool_endpoints(bigger))
        stays = [placement.pick(k) == grown.pick(k) for k in keys]
        assert not all(stays) and all(grown.pick(k) == pool_endpoints(bigger)[3] for k, s in zip(keys, stays) if not s)
        assert [h == 1 for h in c.client.lookup(keys)] == stays  # moved keys miss once...
        moved = [k for k, s in zip(keys, stays) if not s]
        assert c.put(moved, [500 + keys.index(k) for k in moved]) == [True] * len(moved)  # ...and are written again
        found, got = c.get(keys)
        assert found == [True] * 40 and got == [page(500 + i) for i in range(40)]
    finally:
        if c is not None:
            c.close()
        extra.stop()


def test_a_client_that_leaves_mid_registration_does_not_end_the_tier(cluster):
    import socket
    _pools, (a, _b), _placement, _endpoints = cluster
    path = a.runner.config.tier("remote").fd_socket(a.runner.runtime_dir)
    for _ in range(5):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        P.send_register(conn, a.fd, {"v": P.PROTOCOL_VERSION, "s": 1, "size": HOST_POOL})
        conn.close()  # gone before the reply: the daemon's send fails
    assert eventually(lambda: a.client.lookup(["still-there"]) == b"\x00")
    assert a.runner.procs["remote"].poll() is None
