"""Several daemons asked at once from one thread (tiers/wire/fanout.py): replies are taken as they come, a frozen
daemon costs its own deadline and never the others' replies, a socket still connecting holds back no other
request, late replies are skipped by id, and one socket carries one call of a fan-out."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hicache_ext.lab.sglang_harness import make_keys
from tests.support.backend_env import Engine
from tests.support.nodes import dram_tier, eventually, node_toml, nvme_tier, start_node, thaw
from tiers.wire.client import Deadlines, TierClient
from tiers.wire.fanout import FanOut
from tiers.wire.lookup import lookup_all

PAGE = b"\x5a" * 4096


@pytest.fixture()
def node(tmp_path):
    runner = start_node(tmp_path, node_toml(dram_tier(), nvme_tier()))
    clients = []

    def client(tier: str, **deadlines) -> TierClient:
        made = TierClient(tier, runner.config.tier(tier).endpoint, "fanout", "test", Deadlines(**deadlines))
        clients.append(made)
        return made
    yield runner, client
    for made in clients:
        made.close()
    for tier in ("dram", "nvme"):
        thaw(runner.pid(tier))
    runner.stop()


def _lookups(fan: FanOut, clients, keys, began: float) -> dict:
    """Start a lookup of keys on each client; what each answered and when (seconds after began)."""
    answers = {}
    for client in clients:
        fan.add(client.start_lookup(keys, None, lambda flags, name=client.name: answers.__setitem__(
            name, (flags, time.monotonic() - began))))
    return answers


def test_a_frozen_daemon_costs_its_own_deadline_not_the_others_replies(node):
    runner, client = node
    dram, nvme = client("dram", lookup=0.5), client("nvme", lookup=0.5)
    keys = make_keys(4, salt=3, page_size=16)
    assert nvme.put_frames(keys, [[PAGE]] * 4, 4 * len(PAGE)) == [True] * 4
    assert dram.lookup(keys) == b"\x00" * 4  # both sessions open before the freeze
    os.kill(runner.pid("dram"), signal.SIGSTOP)
    began = time.monotonic()
    fan = FanOut()
    answers = _lookups(fan, [dram, nvme], keys, began)
    fan.wait(done=lambda: "nvme" in answers)
    assert answers["nvme"][0] == b"\x01" * 4 and answers["nvme"][1] < 0.3, answers
    assert "dram" not in answers and len(fan) == 1  # still out: the frozen daemon's call
    fan.wait()
    waited = time.monotonic() - began
    assert answers["dram"][0] is None and 0.45 <= answers["dram"][1] < 1.5, answers
    assert waited < 1.5 and dram.is_down() and not nvme.is_down()
    thaw(runner.pid("dram"))
    assert eventually(lambda: not dram.is_down(), within=10)
    assert dram.lookup(keys) == b"\x00" * 4


def test_a_socket_still_connecting_holds_back_no_other_request(node):
    """A thread's first call to a frozen daemon cannot even connect; the other daemon is asked at once and
    answers, and the frozen one is given up after the connection's wait (the tier is then down)."""
    runner, client = node
    dram, nvme = client("dram", connect_wait=0.5), client("nvme")
    keys = make_keys(4, salt=5, page_size=16)
    assert dram.lookup(keys) == b"\x00" * 4 and nvme.lookup(keys) == b"\x00" * 4  # sessions open
    os.kill(runner.pid("dram"), signal.SIGSTOP)
    seen = {}

    def fresh_thread() -> None:  # its sockets are new: the frozen daemon's never connects
        began = time.monotonic()
        fan = FanOut()
        answers = _lookups(fan, [dram, nvme], keys, began)
        fan.wait()
        seen.update(answers)
        seen["waited"] = time.monotonic() - began
    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert seen["nvme"][0] == b"\x00" * 4 and seen["nvme"][1] < 0.3, seen
    assert seen["dram"][0] is None and 0.2 <= seen["dram"][1] < 1.5, seen
    assert dram.is_down()


def test_a_late_reply_is_skipped_by_its_id(node):
    """A call left out by a fan-out that stopped waiting answers later on the same socket; the next call
    there takes its own reply, not that one (the two replies differ)."""
    _runner, client = node
    nvme = client("nvme")
    held = make_keys(4, salt=7, page_size=16)
    absent = make_keys(4, salt=8, page_size=16)
    assert nvme.put_frames(held, [[PAGE]] * 4, 4 * len(PAGE)) == [True] * 4
    first = FanOut()
    left = {}
    first.add(nvme.start_lookup(held, None, lambda flags: left.setdefault("flags", flags)))
    first.wait(stop_at=time.monotonic())  # stops at once: the reply is still out, and comes before the next
    assert nvme.lookup(absent) == b"\x00" * 4
    assert nvme.lookup(held) == b"\x01" * 4
    assert "flags" not in left  # the abandoned call was never settled with another call's reply


def test_one_call_a_socket(node):
    _runner, client = node
    nvme = client("nvme")
    keys = make_keys(2, salt=9, page_size=16)
    fan = FanOut()
    fan.add(nvme.start_lookup(keys, None, lambda flags: None))
    with pytest.raises(ValueError, match="one call a socket"):
        fan.add(nvme.start_lookup(keys, None, lambda flags: None))
    fan.wait()


def test_a_lower_tier_frozen_before_its_first_lookup_delays_no_covered_lookup(tmp_path):
    """The backend opens every tier's session when it starts: a lower tier frozen before any lookup asked it
    costs a lookup the top tier covers nothing, even asked at once from a thread of fresh sockets (its hello
    said inside the lookup took the hello's deadline, 0.5 s)."""
    runner = start_node(tmp_path, node_toml(dram_tier(32 * 32768), nvme_tier(), write_policy="write_back"))
    engine = Engine(runner, pages=64, write_policy="write_back", model="frozen-first")
    nvme = runner.pid("nvme")
    try:
        keys = make_keys(8, salt=11, page_size=16)
        assert engine.write(keys, 0, seed=11)[0] == 8  # write-back: DRAM only
        clients = engine.backend._router.clients
        assert all(client.region_id is not None for client in clients)  # sessions open, host pool registered
        os.kill(nvme, signal.SIGSTOP)
        seen = {}

        def fresh_thread() -> None:
            began = time.monotonic()
            seen["held"] = lookup_all(clients, keys, head_start=0)
            seen["took"] = time.monotonic() - began
        worker = threading.Thread(target=fresh_thread)
        worker.start()
        worker.join(10)
        assert seen["held"][0] == b"\x01" * 8 and seen["took"] < 0.1, seen
    finally:
        thaw(nvme)
        engine.close()
        runner.stop()


def test_a_put_on_a_fresh_socket_waits_longer_for_its_connection_than_a_lookup(node):
    """A thread's first call to a daemon that is slow to take the connection (frozen for 1 s): a lookup gives
    up after connect_wait, as above; a put (SGLang's backup thread) waits up to half its timeout and stores its
    pages once the daemon takes the connection (it was refused as "not connected" before, and SGLang does
    not back a batch up again)."""
    runner, client = node
    dram = client("dram", connect_wait=0.3, base=5.0)
    keys = make_keys(4, salt=7, page_size=16)
    assert dram.lookup(keys) == b"\x00" * 4  # the session is open before the freeze
    os.kill(runner.pid("dram"), signal.SIGSTOP)
    threading.Timer(1.0, thaw, args=(runner.pid("dram"),)).start()
    seen = {}

    def fresh_thread() -> None:  # its socket is new: the daemon takes the connection once thawed
        began = time.monotonic()
        seen["stored"] = dram.put_frames(keys, [[PAGE]] * 4, 4 * len(PAGE))
        seen["waited"] = time.monotonic() - began
    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert seen["stored"] == [True] * 4 and 0.8 <= seen["waited"] < 2.5, seen
    assert not dram.is_down()
    assert dram.lookup(keys) == b"\x01" * 4
