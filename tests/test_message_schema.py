"""The typed schema is the contract: what the clients send and what the daemons answer fits it exactly.

Real daemons (a DRAM tier, a remote memory pool) and the real clients run
every operation; every request header the clients encode and every reply
they receive is decoded again with strict copies of the schema's Structs
(unknown fields refused), so a field sent but not declared, or declared
under another type, fails here rather than being silently ignored.
"""
from __future__ import annotations

import mmap
import os
import types
from typing import Union

import msgspec
import pytest

from tests.support.nodes import dram_config, start_node
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.wire.client import Deadlines, TierClient
from tiers.shm.page_runs import PageRuns

import numpy as np


def _strict(cls, **config):
    return types.new_class(cls.__name__, (cls,), {"forbid_unknown_fields": True, **config})


STRICT_REQUESTS = msgspec.msgpack.Decoder(Union[tuple(
    _strict(cls, tag=op) for op, cls in M.REQUESTS.items())])
STRICT_REPLIES = {op: msgspec.msgpack.Decoder(_strict(cls)) for op, cls in M.REPLIES.items()}


@pytest.fixture
def recorded(monkeypatch):
    """Every request header encoded and every reply decoded in this process: (requests, replies)."""
    requests, replies = [], []
    encode, decode = P.request, M.decode_reply

    def record_request(op, req_id, *args, **fields):
        raw = encode(op, req_id, *args, **fields)
        requests.append(raw)
        return raw

    def record_reply(op, raw):
        replies.append((op, bytes(raw)))
        return decode(op, raw)
    monkeypatch.setattr(P, "request", record_request)
    monkeypatch.setattr(M, "decode_reply", record_reply)
    return requests, replies


def _check(requests, replies, ops):
    seen = set()
    for raw in requests:
        seen.add(type(STRICT_REQUESTS.decode(raw)).__name__)  # raises on a field the schema lacks
    for op, raw in replies:
        reply = STRICT_REPLIES[op].decode(raw)
        assert reply.ok, (op, reply)
    assert {op for op, _ in replies} >= ops, "every operation ran"
    return seen


def test_a_tier_daemon_and_its_client_speak_exactly_the_schema(tmp_path, recorded):
    runner = start_node(tmp_path, dram_config(capacity="16MiB"))
    endpoint = runner.config.tier("dram").endpoint
    fd = os.memfd_create("schema-pool")
    os.ftruncate(fd, 1 << 20)
    host = mmap.mmap(fd, 1 << 20)
    host[:] = bytes(range(256)) * 4096
    client = TierClient("dram", endpoint, "schema", "test", Deadlines(base=2.0), attach=True)
    admin = TierClient("dram", endpoint, "_admin", "test")
    try:
        client.attach_region(fd, 1 << 20)
        assert client.connect() and client.region_id is not None  # hello, then the host pool's attach
        keys = [f"p{i}" for i in range(4)]
        desc, counts = P.encode_descriptors([[(i * 65536, 32768), (i * 65536 + 32768, 32768)] for i in range(4)])
        assert client.put_region(keys, desc, counts, 4 * 65536, sums=P.encode_sums([0] * 4)) == [True] * 4
        assert client.put_frames(["f0"], [[b"x" * 4096, b"y" * 4096]], 8192, ["p3"]) == [True]
        assert client.lookup(keys + ["nope"]) == b"\x01\x01\x01\x01\x00"
        out = np.zeros(4 * 65536, dtype=np.uint8)
        dst = PageRuns.uniform(np.arange(4, dtype=np.uint64).reshape(4, 1) * np.uint64(65536)
                               + np.uint64(out.ctypes.data), np.full((4, 1), 65536, dtype=np.uint64))
        assert client.get_leased(keys, dst) == [True] * 4
        assert out.tobytes() == host[:4 * 65536]
        found, frames = client.get_frames(["f0"], 8192)
        assert found == [True] and frames[0].bytes == b"x" * 4096 + b"y" * 4096
        assert client.delete(["f0"]) == 1
        assert client.call("release", 1.0, lease=12345).header.ok  # an unknown lease: released nothing
        assert client.stats()["pages"] >= 4
        assert admin.call("evict", 1.0, bytes=65536).header.ok
        assert client.clear() is not None
    finally:
        client.close()
        admin.close()
        host.close()
        os.close(fd)
        assert runner.stop() == {"dram": 0}
    requests, replies = recorded
    seen = _check(requests, replies, {"hello", "put", "lookup", "get", "delete", "release", "stats", "evict", "clear"})
    assert {"Put", "Lookup", "Get"} <= seen


def test_a_pool_daemon_and_its_client_speak_exactly_the_schema(tmp_path, recorded):
    pytest.importorskip("mooncake.engine", reason="a pool daemon needs the Mooncake Transfer Engine")
    from tiers.ops.node_runner import NodeRunner
    from tiers.stores.remote.loopback import free_ports, pool_config
    from tiers.stores.remote.pool_client import PoolClient

    port = free_ports(1)[0]
    runner = NodeRunner(pool_config([port], capacity="16MiB", block_size="64KiB", max_page_bytes="1MiB"),
                        str(tmp_path / "run"), str(tmp_path / "data"))
    runner.start(timeout=60)
    client = PoolClient(runner.config.tier("pool0").endpoint, "schema", timeout=2.0, retry_max=1.0)
    try:
        grant = client.alloc(["a", "b"], [4096, 8192], ["root", None], ttl=5.0, sums=[7, 0])
        assert grant is not None and all(grant.extents)
        assert client.commit(grant.lease, ["a", "b"]) == [True, True]
        found = client.locate(["a", "b", "c"], ttl=5.0)
        assert found is not None and found.sizes == [4096, 8192, 0] and found.sums == [7, 0, 0]
        client.release(found.lease)
    finally:
        client.close()
        assert runner.stop() == {"pool0": 0}
    requests, replies = recorded
    _check(requests, replies, {"hello", "alloc", "commit", "locate", "release"})


def test_requests_that_do_not_fit_are_refused_by_name():
    def refusal(header: dict) -> P.ProtocolError:
        with pytest.raises(P.ProtocolError) as err:
            M.decode_request(P.pack(header))
        return err.value
    base = {"v": P.PROTOCOL_VERSION, "id": 9, "s": 1}
    exc = refusal({**base, "op": "lookup", "keys": ["a", 3]})
    assert exc.code == "bad_request" and "$.keys[1]" in exc.msg and exc.req_id == 9
    exc = refusal({**base, "op": "put"})
    assert exc.code == "bad_request" and "keys" in exc.msg
    exc = refusal({**base, "op": "evict", "bytes": "lots"})
    assert exc.code == "bad_request" and "$.bytes" in exc.msg
    assert refusal({**base, "op": "lookup", "v": 1, "keys": 5}).code == "bad_version"  # version before types
    assert refusal({**base, "op": "frobnicate"}).code == "unknown_op"
    assert refusal({**base, "op": {"a": 1}}).code == "unknown_op"
    assert refusal({**base, "op": "lookup", "dl": float("inf")}).code == "bad_request"
    assert refusal({**base, "op": "lookup", "dl": 1.0}).code == "deadline"
    assert refusal({**base, "op": "get", "keys": ["k"] * (M.MAX_LIST + 1)}).code == "bad_request"
    with pytest.raises(P.ProtocolError):
        M.decode_request(b"\xc1")  # never valid msgpack
    with pytest.raises(P.ProtocolError):
        M.decode_request(P.pack({**base, "op": "hello", "ns": b"\xff"}))  # bytes where a str belongs
    msg = M.decode_request(P.pack({**base, "op": "evict", "bytes": 5, "future_field": [1, 2]}))
    assert isinstance(msg, M.Evict) and msg.nbytes == 5  # unknown fields are ignored (newer engines)


def test_a_reply_that_does_not_fit_fails_its_call_at_once():
    reply = M.decode_reply("lookup", P.pack({"v": P.PROTOCOL_VERSION, "id": 4, "ok": True, "held": "not bytes"}))
    assert reply.id == 4 and not reply.ok and reply.code == "internal" and "$.held" in reply.msg
    with pytest.raises(P.ProtocolError):
        M.decode_reply("lookup", b"\x93\x01\x02\x03")  # an array: no id to match a call by
