"""The pool arena's leases: reservations, pins, eviction around them, expiry."""
import ctypes

import pytest

from tiers.stores.remote.pool import PoolStore

BLOCK = 4096
S = 11  # a session id


def write(store: PoolStore, extents, data: bytes) -> None:
    """Play the remote engine: copy data to the granted addresses."""
    pos = 0
    for addr, n in extents:
        ctypes.memmove(addr, data[pos:pos + n], n)
        pos += n


def read(extents) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in extents)


def put(store, key, data, parent=None):
    lease, grants, refusal = store.allocate(S, [("ns", key)], [len(data)], [parent], ttl=5.0)
    assert refusal is None and grants[0] is not None
    write(store, grants[0], data)
    assert store.commit(S, lease, [("ns", key)]) == [True]


@pytest.fixture
def store():
    s = PoolStore(8 * BLOCK, "lru", block_size=BLOCK, max_page_bytes=4 * BLOCK, max_lease=10.0)
    yield s
    s.close()


def test_reserved_pages_are_invisible_until_commit(store):
    lease, grants, _ = store.allocate(S, [("ns", "a"), ("ns", "b")], [BLOCK + 10, 100], [None, None], ttl=5.0)
    assert all(g is not None for g in grants)
    assert store.contains([("ns", "a"), ("ns", "b")]) == [False, False]
    write(store, grants[0], b"x" * (BLOCK + 10))
    assert store.commit(S, lease, [("ns", "a")]) == [True]
    assert store.contains([("ns", "a"), ("ns", "b")]) == [True, False]
    assert store.get_bytes(("ns", "a")) == b"x" * (BLOCK + 10)
    stats = store.stats()
    assert stats.extra["reserved_bytes"] == 0 and stats.extra["free_blocks"] == 8 - 2  # b's block came back


def test_commit_needs_the_owning_session_and_a_live_lease(store):
    lease, _grants, _ = store.allocate(S, [("ns", "a")], [100], [None], ttl=5.0)
    assert store.commit(S + 1, lease, [("ns", "a")]) == [False]
    assert store.commit(S, lease + 1, [("ns", "a")]) == [False]
    assert store.commit(S, lease, [("ns", "a")]) == [True]
    assert store.commit(S, lease, [("ns", "a")]) == [False]  # a lease commits once


def test_refusals_are_per_page(store):
    _lease, grants, refusal = store.allocate(S, [("ns", "big"), ("ns", "ok")], [5 * BLOCK, 10], [None, None], 5.0)
    assert grants[0] is None and grants[1] is not None
    assert refusal[0] == "too_large"


def test_eviction_skips_pinned_pages_and_reuse_waits_for_the_last_pin(store):
    for i in range(4):
        put(store, f"p{i}", bytes([i + 1]) * (2 * BLOCK))  # the arena is full
    lease, found = store.locate(S, [("ns", "p0")], ttl=5.0)  # p0, the LRU victim, is being read
    size, extents, _checksum = found[0]
    assert size == 2 * BLOCK
    put(store, "new", b"n" * (2 * BLOCK))  # evicts p1 (p0 is pinned)
    assert store.contains([("ns", "p0"), ("ns", "p1")]) == [True, False]
    assert store.delete([("ns", "p0")]) == 1  # deleted while pinned: its blocks wait for the reader
    put(store, "newer", b"m" * (2 * BLOCK))  # evicts p2, does not reuse p0's blocks
    assert read(extents) == b"\1" * (2 * BLOCK)
    free_before = store.stats().extra["free_blocks"]
    assert store.release(S, lease) == 1
    assert store.stats().extra["free_blocks"] == free_before + 2


def test_full_of_pins_is_refused_not_overwritten(store):
    for i in range(4):
        put(store, f"p{i}", b"z" * (2 * BLOCK))
    store.locate(S, [("ns", f"p{i}") for i in range(4)], ttl=5.0)
    _lease, grants, refusal = store.allocate(S, [("ns", "x")], [BLOCK], [None], ttl=5.0)
    assert grants == [None] and refusal[0] == "full"
    assert all(store.contains([("ns", f"p{i}") for i in range(4)]))


def test_leases_expire_by_themselves(store):
    import time
    lease, grants, _ = store.allocate(S, [("ns", "w")], [4 * BLOCK], [None], ttl=0.01)
    _rlease, _found = store.locate(S, [], ttl=0.01)
    assert store.stats().extra["free_blocks"] == 4
    time.sleep(0.02)
    assert store.expire_leases() >= 1
    assert store.stats().extra["free_blocks"] == 8
    assert store.commit(S, lease, [("ns", "w")]) == [False]  # too late: nothing torn becomes visible


def test_overwrite_replaces_at_commit(store):
    put(store, "k", b"1" * 100)
    lease, grants, _ = store.allocate(S, [("ns", "k")], [200], [None], ttl=5.0)
    assert store.get_bytes(("ns", "k")) == b"1" * 100  # the old page serves until the commit
    write(store, grants[0], b"2" * 200)
    store.commit(S, lease, [("ns", "k")])
    assert store.get_bytes(("ns", "k")) == b"2" * 200
    assert store.stats().pages == 1


def test_a_node_treats_malformed_pool_replies_as_misses():
    from tiers.wire import messages as M
    from tiers.wire import protocol as P
    from tiers.wire.client import Reply
    from tiers.stores.remote.pool_client import PoolClient
    client = PoolClient("tcp://127.0.0.1:9", "ns", timeout=0.1, retry_max=0.1)  # never called: replies are fed in
    desc, counts = P.encode_descriptors([[(4096, 100)], [(8192, 50), (16384, 50)]])
    good = {"v": P.PROTOCOL_VERSION, "id": 1, "ok": True, "lease": 7, "seg": "127.0.0.1:15001",
            "found": b"\x01\x00\x01", "sizes": P.encode_sizes([100, 100]), "desc": desc, "regions_per_page": counts}

    def grant(fields: dict):
        """The reply as the client decodes it (tiers/wire/messages.py), then its grant."""
        return client._grant(client._ok(Reply(M.decode_reply("locate", P.pack(fields)), []), "locate"), 3, None)
    got = grant(good)
    assert got.extents == [[(4096, 100)], None, [(8192, 50), (16384, 50)]] and got.sizes == [100, 0, 100]
    for bad in ({"sizes": P.encode_sizes([100, -1])}, {"sizes": P.encode_sizes([100, 99])},  # lengths disagree
                {"sizes": b"\x00"}, {"found": b"\x01"}, {"lease": "7"}, {"desc": desc[:-8]}, {"seg": None}):
        assert grant({**good, **bad}) is None, bad
    client.close()


def test_a_page_keeps_its_writers_checksum_until_it_is_replaced(store):
    """alloc's sums are kept with each committed page and returned by locate (0: none was sent)."""
    lease, grants, _ = store.allocate(S, [("ns", "a"), ("ns", "b"), ("ns", "c")], [100, 100, 100],
                                      [None] * 3, ttl=5.0, sums=[2**64 - 1, 0, 7])
    assert store.commit(S, lease, [("ns", "a"), ("ns", "b")]) == [True, True]  # c is never committed
    lease, found = store.locate(S, [("ns", "a"), ("ns", "b"), ("ns", "c")], ttl=5.0)
    assert [f[2] if f else None for f in found] == [2**64 - 1, 0, None]
    store.release(S, lease)
    put(store, "a", b"x" * 100)  # replaced by a writer that sent no sum
    _lease, found = store.locate(S, [("ns", "a")], ttl=5.0)
    assert found[0][2] == 0
