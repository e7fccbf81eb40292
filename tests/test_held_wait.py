"""Short calls that wait for their reply holding the GIL (tiers/wire/held_wait.py): exact messages, nothing
consumed when nothing came, a frozen daemon holds the GIL no longer than the spin, and a daemon's lookups and
leased reads through a real node still answer exactly with and without it."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, node_toml, start_node, thaw
from tiers.wire import held_wait
from tiers.wire.client import Deadlines, TierClient

pytestmark = pytest.mark.skipif(held_wait.shared() is None, reason="tiers._heldwait is not built here")


@pytest.fixture()
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    dealer.close(0)
    router.close(0)
    ctx.term()


def test_send_and_receive_exact_parts(pair):
    router, dealer = pair
    held = held_wait.shared()
    deadline = time.monotonic() + 5
    while not held.send(dealer, b"request") and time.monotonic() < deadline:
        time.sleep(0.01)  # the connection comes up
    identity, body = router.recv_multipart()
    assert body == b"request"
    assert held.receive(dealer, 0.0) is None  # nothing yet: None, and nothing consumed
    router.send_multipart([identity, b"header", b"", os.urandom(70000)])
    parts = None
    while parts is None and time.monotonic() < deadline:
        parts = held.receive(dealer, 0.01)
    assert parts is not None and parts[0] == b"header" and parts[1] == b"" and len(parts[2]) == 70000
    router.send_multipart([identity] + [b"x"] * (held_wait.MAX_PARTS + 1))  # malformed: dropped whole
    time.sleep(0.2)
    assert held.receive(dealer, 0.5) is None
    router.send_multipart([identity, b"next"])
    parts = None
    while parts is None and time.monotonic() < deadline:
        parts = held.receive(dealer, 0.01)
    assert parts == [b"next"]


def test_frozen_daemon_holds_the_gil_no_longer_than_the_spin(tmp_path):
    """A lookup to a SIGSTOPped daemon gives up at its deadline, and another Python thread keeps running
    meanwhile: the wait holds the GIL only for the reply spin, then waits without it."""
    runner = start_node(tmp_path, node_toml(dram_tier()))
    client = TierClient("dram", runner.config.tier("dram").endpoint, "ns", "held-test",
                        deadlines=Deadlines(lookup=0.4, reply_spin=0.002))
    pid = runner.pid("dram")
    stop = threading.Event()
    gaps = []

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.0002)
    try:
        assert client.lookup(["ab" * 32]) == b"\x00"
        thread = threading.Thread(target=ticker)
        thread.start()
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert client.lookup(["ab" * 32]) is None
            took = time.monotonic() - started
        finally:
            thaw(pid)
            stop.set()
            thread.join()
        assert 0.3 < took < 2.0
        # The ticker never stopped for anything like the 0.4 s deadline (the spin is 2 ms; CPython's
        # switch interval is 5 ms; the bound is loose so a loaded machine does not fail it).
        assert max(gaps) < 0.1, f"another thread waited {max(gaps) * 1e3:.0f} ms for the GIL"
    finally:
        client.close()
        runner.stop()


@pytest.mark.parametrize("spin_us", [0, 1000])
def test_lookups_and_leased_reads_exact_with_and_without_spin(tmp_path, spin_us):
    runner = start_node(tmp_path, node_toml(dram_tier("32MiB")))
    engine = Engine(runner, pages=64, model=f"held-{spin_us}", reply_spin_us=spin_us)
    try:
        keys = make_keys(32, salt=3, page_size=16)
        stored, written = engine.write(keys, 0, seed=5)
        assert stored == 32
        assert engine.driver.exists(keys) == 32
        assert engine.driver.exists(make_keys(4, salt=4, page_size=16)) == 0
        done, sums = engine.read(keys, 0)
        assert done == 32 and sums == written
    finally:
        engine.close()
        runner.stop()


def test_spin_record_stops_after_empty_spins_and_probes_back():
    """Two spins in a row that end before the reply stop the spin for that operation; one call in
    SPIN_PROBE_EVERY spins again, and a reply within it restores the spin; other operations are untouched."""
    record = held_wait.SpinRecord()
    assert record.worth_spinning("get") and not record.stopped("get")
    record.spun("get", False)
    assert record.worth_spinning("get")  # one empty spin is not enough (a page cache miss, a busy core)
    record.spun("get", False)
    assert record.stopped("get") and not record.stopped("lookup")
    asked = [record.worth_spinning("get") for _ in range(3 * held_wait.SPIN_PROBE_EVERY)]
    assert sum(asked) == 3 and asked[held_wait.SPIN_PROBE_EVERY - 1]  # one probe in SPIN_PROBE_EVERY calls
    record.spun("get", True)  # the probe's reply came within the spin: the daemon is quick again
    assert not record.stopped("get") and all(record.worth_spinning("get") for _ in range(5))


def test_a_tier_whose_leased_reads_wait_on_the_disk_is_not_spun_for(tmp_path, monkeypatch):
    """Leased reads from a real NVMe daemon (O_DIRECT: each waits on the device) that do not come within the
    spin stop being spun for after two, so the engine's other threads keep the GIL; the bytes read stay
    exact.  A client whose spin outlasts those reads keeps spinning.  Reads not streamed (an engine without
    tiers._progress): a streamed get is answered before its reads (tests/test_streamed_reads.py)."""
    import mmap
    import xxhash
    from tests.support.nodes import nvme_tier
    from tiers.shm import progress
    from tiers.shm.buffers import address_of
    from tiers.wire import protocol as P
    monkeypatch.setattr(progress, "built", lambda: False)
    page, n = 64 << 10, 32
    runner = start_node(tmp_path, node_toml(nvme_tier(capacity="64MiB")))
    size = 2 * n * page
    fd = os.memfd_create("pool")
    os.ftruncate(fd, size)
    view = mmap.mmap(fd, size)
    wanted = [os.urandom(page) for _ in range(n)]
    for i, data in enumerate(wanted):
        view[i * page:(i + 1) * page] = data
    endpoint = runner.config.tier("nvme").endpoint
    short = TierClient("nvme", endpoint, "spin", attach=True, deadlines=Deadlines(reply_spin=0.0001))
    long = TierClient("nvme", endpoint, "spin", attach=True, deadlines=Deadlines(reply_spin=2.0))
    try:
        for client in (short, long):
            client.attach_region(fd, size)
            assert client.lookup(["x"]) == b"\x00"  # hello + region registration
        keys = [f"k{i}" for i in range(n)]
        desc, counts = P.encode_descriptors([[(i * page, page)] for i in range(n)])
        assert short.put_region(keys, desc, counts, n * page, hash_pages=True) == [True] * n
        base = address_of(memoryview(view))
        dst = [[(base + (n + i) * page, page)] for i in range(n)]
        for client in (short, long):
            for _ in range(3):
                view[n * page:] = bytes(n * page)
                sums = [0] * n
                assert client.get_leased(keys, dst, sums) == [True] * n
                assert sums == [xxhash.xxh3_64_intdigest(w) for w in wanted]
                assert all(view[(n + i) * page:(n + i + 1) * page] == wanted[i] for i in range(n))
        assert short.spin_stopped("get")
        assert not long.spin_stopped("get")
        # The next leased read of each is sent for a wait without / with the GIL held.
        assert short._channel.held_wait("get", {"lease": 1.0}) is None
        assert long._channel.held_wait("get", {"lease": 1.0}) is not None
    finally:
        short.close()
        long.close()
        runner.stop()


def test_a_daemons_small_replies_leave_whole_and_a_gone_peer_is_counted(pair):
    """A daemon's loop sends its small replies through the held send (tiers/node/replies.py): the peer gets the
    exact bytes; a reply to a peer that is gone is counted unroutable, not raised, as pyzmq's send was."""
    from tiers.node.metrics import DaemonMetrics
    from tiers.node.peers import PeerReplies
    from tiers.node.replies import Replies
    from tiers.wire import protocol as P
    router, dealer = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    metrics = DaemonMetrics("held")
    replies = Replies(metrics, PeerReplies(1 << 20), held_wait.shared())
    replies.router = router
    dealer.send(b"hello")  # the router learns the dealer's routing id
    assert router.poll(5000)
    ident, request = router.recv_multipart()
    assert request == b"hello"
    header = P.reply_ok(7, stored=b"\x01\x00")
    replies.send(ident, [header])
    assert dealer.poll(5000) and dealer.recv_multipart() == [header]
    replies.send(b"\x00gone", [header])
    assert metrics.errors.get("reply_unroutable") == 1 and "reply_dropped" not in metrics.errors
