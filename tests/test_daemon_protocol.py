"""Malformed, wrong-version and hostile messages get error replies; the daemon keeps serving."""
import time

import msgpack
import pytest

from tiers.wire import protocol as P
from tests.support.nodes import RawPeer, dram_config, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    runner = start_node(tmp_path_factory.mktemp("proto"), dram_config(capacity="8MiB", max_page_bytes="1MiB"))
    yield runner
    assert runner.stop() == {"dram": 0}


@pytest.fixture
def peer(node):
    p = RawPeer(node.config.tier("dram").endpoint)
    yield p
    p.close()


def still_serving(peer):
    session = peer.hello()
    reply, frames = peer.call("put", s=session, keys=["alive"], frames=[b"x" * 100])
    assert reply["ok"] and reply["stored"] == b"\x01"
    reply, frames = peer.call("get", s=session, keys=["alive"])
    assert reply["found"] == b"\x01" and frames == [b"x" * 100]


@pytest.mark.parametrize("raw, code", [
    (b"\xc1", "bad_request"),                      # never-used msgpack byte
    (b"", "bad_request"),
    (msgpack.packb([1, 2, 3]), "bad_request"),     # not a map
    (msgpack.packb({"v": 2, "op": "lookup", "id": "x"}), "bad_request"),
    (msgpack.packb({"v": 99, "op": "lookup", "id": 3}), "bad_version"),
    (msgpack.packb({"op": "lookup", "id": 3}), "bad_version"),
    (msgpack.packb({"v": 2, "op": "explode", "id": 3}), "unknown_op"),
    (msgpack.packb({"v": 2, "op": "lookup", "id": 3, "s": 12345, "keys": ["a"]}), "no_session"),
    (msgpack.packb({"v": 2, "op": "lookup", "id": 3, "dl": 1.0}), "deadline"),
    (msgpack.packb({"v": 2, "op": "hello", "id": 3, "ns": "../etc"}), "bad_request"),
    (msgpack.packb({"v": 2, "op": "hello", "id": 3}), "bad_request"),
])
def test_malformed_headers_get_error_replies(peer, raw, code):
    reply, _ = peer.send(raw)
    assert reply["ok"] is False
    assert reply["code"] == code, reply
    assert reply["msg"]
    still_serving(peer)


def test_bad_fields_after_hello(peer):
    session = peer.hello()
    cases = [
        (dict(keys="notalist"), "bad_request"),
        (dict(keys=["a/b"]), "bad_request"),
        (dict(keys=["x" * 300]), "bad_request"),
        (dict(keys=[1, 2]), "bad_request"),
        (dict(keys=["k"] * (P.MAX_BATCH + 1)), "too_large"),
    ]
    for fields, code in cases:
        reply, _ = peer.call("lookup", s=session, **fields)
        assert (reply["ok"], reply["code"]) == (False, code), (fields, reply)
    # frames that do not match the keys
    reply, _ = peer.call("put", s=session, keys=["a", "b"], frames=[b"1"])
    assert reply["code"] == "bad_request"
    # a put from a region that was never registered
    reply, _ = peer.call("put", s=session, keys=["a"], region=42, desc=b"\0" * 16, regions_per_page=b"\1\0\0\0")
    assert reply["code"] == "no_session"
    # a daemon never writes into a host pool: a get naming a region is refused
    reply, _ = peer.call("get", s=session, keys=["a"], region=42, desc=b"\0" * 16, regions_per_page=b"\1\0\0\0")
    assert reply["code"] == "bad_request" and "lease" in reply["msg"]
    # leases: not a number, infinite, in the past, too far, sizes missing
    for lease, code in [("x", "bad_request"), (float("inf"), "bad_request"), (float("nan"), "bad_request"),
                        (time.monotonic() - 1, "deadline"), (time.monotonic() + 10_000, "bad_request")]:
        reply, _ = peer.call("get", s=session, keys=["a"], lease=lease, sizes=b"\0" * 8)
        assert (reply["ok"], reply["code"]) == (False, code), (lease, reply)
    reply, _ = peer.call("get", s=session, keys=["a"], lease=time.monotonic() + 5)
    assert reply["code"] == "bad_request"
    # releasing a lease nobody holds is harmless
    reply, _ = peer.call("release", s=session, lease=12345)
    assert reply["ok"] is True and reply["released"] is False
    still_serving(peer)


def test_page_checksums_are_validated_kept_and_returned(peer):
    """sums: one little-endian uint64 a key on a put, one a found page in a get reply; absent is 0 (unknown)."""
    session = peer.hello("sums")
    for sums, why in [(b"\0" * 8, "one sum for two keys"), (b"\0" * 17, "not whole uint64s"),
                      ([1, 2], "a list, not bytes"), ("0" * 16, "a string"), (7, "a number")]:
        reply, _ = peer.call("put", s=session, keys=["a", "b"], sums=sums, frames=[b"A" * 64, b"B" * 64])
        assert (reply["ok"], reply["code"]) == (False, "bad_request"), why
        assert "sums" in reply["msg"], why
    reply, _ = peer.call("lookup", s=session, keys=["a", "b"])
    assert reply["held"] == b"\0\0"  # a refused put stores nothing
    reply, _ = peer.call("put", s=session, keys=["a", "b"], sums=P.encode_sums([2**64 - 1, 5]),
                         frames=[b"A" * 64, b"B" * 64])
    assert reply["stored"] == b"\1\1"
    reply, _ = peer.call("put", s=session, keys=["old"], frames=[b"C" * 64])  # an older writer: no sums
    assert reply["stored"] == b"\1"
    reply, frames = peer.call("get", s=session, keys=["a", "missing", "old", "b"])
    assert reply["found"] == b"\1\0\1\1" and len(frames) == 3
    assert P.decode_sums(reply["sums"], 3) == [2**64 - 1, 0, 5]
    still_serving(peer)


def test_a_put_asking_the_daemon_to_hash_keeps_each_pages_xxh3_and_sums_sent_win(peer):
    """hash_pages: the daemon takes each page's sum in its own copy; a put that carries sums keeps those."""
    import xxhash
    session = peer.hello("hashed")
    pages = [b"A" * 100 + b"a", bytes(range(256)) * 3]
    reply, _ = peer.call("put", s=session, keys=["h1", "h2"], hash_pages=True, frames=pages)
    assert reply["stored"] == b"\1\1"
    reply, _ = peer.call("put", s=session, keys=["given"], hash_pages=True, sums=P.encode_sums([7]),
                         frames=[b"G" * 64])
    assert reply["stored"] == b"\1"
    reply, frames = peer.call("get", s=session, keys=["h1", "h2", "given"])
    assert [bytes(f) for f in frames[:2]] == pages
    assert P.decode_sums(reply["sums"], 3) == [xxhash.xxh3_64_intdigest(p) for p in pages] + [7]
    still_serving(peer)


def test_oversized_page_is_refused_and_nothing_is_stored(peer):
    session = peer.hello()
    reply, _ = peer.call("put", s=session, keys=["big"], frames=[b"z" * (2 << 20)])
    assert reply["ok"] is False and reply["code"] == "too_large"
    reply, _ = peer.call("lookup", s=session, keys=["big"])
    assert reply["held"] == b"\x00"
    still_serving(peer)


def test_namespaces_are_isolated(peer):
    a, b = peer.hello("tenant-a"), peer.hello("tenant-b")
    reply, _ = peer.call("put", s=a, keys=["shared-key"], frames=[b"A" * 64])
    assert reply["stored"] == b"\x01"
    reply, frames = peer.call("get", s=b, keys=["shared-key"])
    assert reply["found"] == b"\x00" and frames == []
    reply, _ = peer.call("delete", s=b, keys=["shared-key"])
    assert reply["deleted"] == 0
    reply, _ = peer.call("clear", s=b, all=True)
    assert reply["ok"] is False  # only an _admin session may clear every namespace
    reply, frames = peer.call("get", s=a, keys=["shared-key"])
    assert frames == [b"A" * 64]


def test_replies_echo_request_ids(peer):
    session = peer.hello()
    for req_id in (1, 99, 2**40):
        reply, _ = peer.call("lookup", req_id=req_id, s=session, keys=["q"])
        assert reply["id"] == req_id


def test_evict_and_clear_by_namespace(peer):
    a, b, admin = peer.hello("evict-a"), peer.hello("evict-b"), peer.hello("_admin")
    for session, tag in ((a, b"a"), (b, b"b")):
        reply, _ = peer.call("put", s=session, keys=["e1", "e2", "e3"], frames=[tag * 4096] * 3)
        assert reply["stored"] == b"\x01\x01\x01"
    reply, _ = peer.call("evict", s=b, bytes=4096, ns="evict-a")
    assert reply["ok"] is False  # a tenant cannot evict another's pages
    reply, _ = peer.call("evict", s=admin, bytes=8192, ns="evict-a")
    assert (reply["evicted_pages"], reply["evicted_bytes"]) == (2, 8192)
    held_a, _ = peer.call("lookup", s=a, keys=["e1", "e2", "e3"])
    held_b, _ = peer.call("lookup", s=b, keys=["e1", "e2", "e3"])
    assert held_a["held"] == b"\x00\x00\x01" and held_b["held"] == b"\x01\x01\x01"
    reply, _ = peer.call("clear", s=admin, ns="evict-b")
    assert reply["cleared"] == 3
    reply, _ = peer.call("evict", s=a, bytes=1 << 30)
    assert reply["evicted_pages"] == 1


def test_lookups_by_packed_digests_answer_as_lookups_by_key(peer):
    """A tier whose store is keyed by key_digest says so in hello and answers a lookup of packed digests
    exactly as the same keys, per namespace; malformed digests get error replies."""
    reply, _ = peer.call("hello", ns="digests-a")
    assert reply["ok"] and reply["digests"] is True
    a, b = reply["session"], peer.hello("digests-b")
    keys = [f"dg-{i}" for i in range(6)]
    reply, _ = peer.call("put", s=a, keys=keys[:4], frames=[b"d" * 64] * 4)
    assert reply["stored"] == b"\x01" * 4
    probe = keys[:2] + ["dg-absent"] + keys[2:]
    by_key, _ = peer.call("lookup", s=a, keys=probe)
    by_digest, _ = peer.call("lookup", s=a, digests=P.pack_key_digests("digests-a", probe))
    assert by_key["held"] == by_digest["held"] == b"\x01\x01\x00\x01\x01\x00\x00"
    assert by_digest["prefix"] == 2
    # the digest of namespace b's name for the same keys: b holds nothing
    reply, _ = peer.call("lookup", s=b, digests=P.pack_key_digests("digests-b", probe))
    assert reply["held"] == bytes(len(probe))
    reply, _ = peer.call("lookup", s=a, digests=b"")
    assert reply["ok"] and reply["held"] == b"" and reply["prefix"] == 0
    for digests, code in [(b"\0" * 15, "bad_request"), ("text", "bad_request"), ([b"\0" * 16], "bad_request"),
                          (b"\0" * 16 * (P.MAX_BATCH + 1), "too_large")]:
        reply, _ = peer.call("lookup", s=a, digests=digests)
        assert (reply["ok"], reply["code"]) == (False, code), (digests[:4], reply)
    # a deleted page is no longer held by digest either
    peer.call("delete", s=a, keys=[keys[0]])
    reply, _ = peer.call("lookup", s=a, digests=P.pack_key_digests("digests-a", keys[:2]))
    assert reply["held"] == b"\x00\x01"
    still_serving(peer)
