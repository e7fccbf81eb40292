"""Fuzzing the protocol decoder and every daemon handler with hypothesis.

In process: the decoder and validators raise only ProtocolError, whatever the
bytes.  Against a live daemon: at least 10,000 malformed, truncated,
oversized and wrong-typed messages, sent in bulk; every one gets exactly one
reply (an error or a harmless success), the daemon stays up, keeps serving,
and its resident memory stays bounded.  The fd-passing socket gets garbage too.

Hypothesis draws a corpus of structured messages (its generation costs about
a millisecond a message, too slow for 10,000 on 2 shared cores); a seeded
mutator (truncations, byte flips, fields swapped for wrong types, stray
frames) expands the corpus to the full count in well under a second.
"""
from __future__ import annotations

import os
import socket
import time

import msgpack
import pytest
import zmq
import random

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.support.nodes import RawPeer, dram_tier, node_toml, rss_bytes, start_node
from tiers.wire import messages as M
from tiers.wire import protocol as P

MESSAGES_PER_EXAMPLE = 10
EXAMPLES = 30  # x MESSAGES_PER_EXAMPLE = the hypothesis corpus
MESSAGES = 10_000  # sent to the daemon per run (corpus + seeded mutations)
RSS_SLACK_BYTES = 24 << 20  # allowed growth of the daemon's VmRSS over the fuzz run (after warm-up)

FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------- strategies

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=6)),
                      max_leaves=6)
KEY_ALPHABET = "ABCabc0123456789_.:=+-"
good_keys = st.lists(st.text(KEY_ALPHABET, min_size=1, max_size=24), min_size=1, max_size=8)
bad_keys = st.one_of(values, st.lists(st.one_of(st.text(max_size=300), st.integers(-2**63, 2**63 - 1), st.binary(max_size=8)),
                                      max_size=8))
FIELDS = ("keys", "ns", "client", "region", "desc", "regions_per_page", "frames_per_page", "parents", "all",
          "bytes", "mode", "min_reads", "promote", "lease", "sizes", "ttl", "done", "sums")


def descriptor_bytes():
    return st.one_of(st.binary(max_size=80),
                     st.lists(st.integers(-2**63, 2**63 - 1), max_size=10).map(
                         lambda xs: b"".join(x.to_bytes(8, "little", signed=True) for x in xs)))


@st.composite
def header(draw, session):
    """A request header with every field possibly missing, valid or of the wrong type."""
    h = {}
    if draw(st.integers(0, 9)):
        h["v"] = draw(st.sampled_from([P.PROTOCOL_VERSION] * 8 + [0, 2, "1", None]))
    if draw(st.integers(0, 9)):
        h["op"] = draw(st.sampled_from(list(P.OPS) * 3 + ["", "hello\x00", "handle_put", "__init__", "stop"]))
    if draw(st.integers(0, 9)):
        h["id"] = draw(st.one_of(st.integers(0, 2**62), values))
    if draw(st.booleans()):
        h["s"] = draw(st.one_of(st.just(session), st.just(session), st.integers(-2**63, 2**63 - 1), values))
    if not draw(st.integers(0, 4)):
        h["dl"] = draw(st.one_of(st.floats(), st.just(time.time() + 60), values))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        if name == "keys":
            h[name] = draw(st.one_of(good_keys, good_keys, bad_keys))
        elif name in ("desc", "regions_per_page", "sizes", "sums"):
            h[name] = draw(st.one_of(descriptor_bytes(), values))
        elif name == "ns":
            h[name] = draw(st.one_of(st.text("abcxyz", min_size=1, max_size=8), st.just("_admin"), values))
        elif name == "bytes":
            h[name] = draw(st.one_of(st.integers(-10, 1 << 40), values))
        else:
            h[name] = draw(values)
    return h


@st.composite
def message(draw, session):
    """One multipart message: valid-ish, garbled, truncated or with stray frames."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return [draw(st.binary(max_size=200))]
    packed = msgpack.packb(draw(header(session)), use_bin_type=True)
    if kind == 1:
        packed = packed[:draw(st.integers(0, max(0, len(packed) - 1)))]  # truncated
    elif kind == 2 and packed:
        i = draw(st.integers(0, len(packed) - 1))
        packed = packed[:i] + bytes([draw(st.integers(0, 255))]) + packed[i + 1:]  # one byte flipped
    frames = draw(st.lists(st.binary(max_size=4096), max_size=4)) if draw(st.integers(0, 3)) == 0 else []
    return [packed, *frames]


WRONG = [None, True, -1, 2**63 - 1, 1.5, float("nan"), "", "x" * 300, b"\x00" * 17, [], [1, "a"], {}, {"k": []},
         ["a/b"], ["ok"] * 3, ["k"] * (P.MAX_BATCH + 1)]


class Mutator:
    """Seeded mutations of a corpus of messages (fast; hypothesis drew the corpus)."""

    def __init__(self, corpus, session: int, seed: int = 2026, ops=P.OPS):
        self.corpus = corpus
        self.session = session
        self.rng = random.Random(seed)
        self.ops = list(ops)

    def one(self):
        rng = self.rng
        frames = list(rng.choice(self.corpus))
        choice = rng.randrange(6)
        try:
            h = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception:
            h = None
        if choice <= 2 and isinstance(h, dict):  # swap fields for wrong types, keep the rest valid
            h = dict(h)
            h.setdefault("v", P.PROTOCOL_VERSION)
            h["op"] = rng.choice(self.ops) if rng.random() < 0.8 else h.get("op")
            h["s"] = self.session if rng.random() < 0.7 else rng.choice(WRONG)
            for name in rng.sample(FIELDS, rng.randrange(1, 4)):
                h[name] = rng.choice(WRONG)
            try:
                frames[0] = msgpack.packb(h, use_bin_type=True)
            except (OverflowError, TypeError, ValueError):
                pass
        elif choice == 3 and frames[0]:  # truncate
            frames[0] = frames[0][:rng.randrange(len(frames[0]))]
        elif choice == 4 and frames[0]:  # flip bytes
            raw = bytearray(frames[0])
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            frames[0] = bytes(raw)
        else:  # stray or missing page frames
            frames = frames[:1] + [rng.randbytes(rng.randrange(0, 2048)) for _ in range(rng.randrange(0, 3))]
        return frames

    def many(self, n: int):
        return [self.one() for _ in range(n)]


# ------------------------------------------------------- in-process decoder

@settings(max_examples=100, **FUZZ_SETTINGS)
@given(st.one_of(st.binary(max_size=300), values.map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_decoder_raises_only_protocol_errors(raw):
    try:
        msg = M.decode_request(raw)
        if getattr(msg, "keys", None) is not None:
            P.check_keys(msg.keys)
    except P.ProtocolError as exc:
        assert exc.code in P.ERROR_CODES


# Keys near the rules' edges: the alphabet and its neighbours, separators, dots, lengths about the limit.
edge_keys = st.one_of(
    st.text(alphabet="ab09_.:=+-/\n \x00é", min_size=0, max_size=6),
    st.integers(P.MAX_KEY_CHARS - 1, P.MAX_KEY_CHARS + 1).map(lambda n: "k" * n),
    st.sampled_from([".", "..", "...", "a.", ".a", ""]),
    st.binary(max_size=4), st.integers(), st.none())


@settings(max_examples=300, **FUZZ_SETTINGS)
@given(st.lists(edge_keys, max_size=6))
@example(["a\nb"])  # a separator inside a key once passed the batch check
@example(["ab", "a\nb", "cd"])
@example(["k" * P.MAX_KEY_CHARS, "k" * P.MAX_KEY_CHARS])
@example(["k" * (P.MAX_KEY_CHARS + 1)] * 2)
@example(["abc", "ab", "abcd"])
def test_the_batch_key_check_agrees_with_the_per_key_check(keys):
    """check_keys's C-level batch passes accept exactly the batches check_key accepts key by key."""
    def one_by_one() -> bool:
        try:
            for key in keys:
                P.check_key(key)
        except P.ProtocolError:
            return False
        return True
    assert P._keys_valid(keys) == one_by_one()


@settings(max_examples=100, **FUZZ_SETTINGS)
@given(values, values, st.integers(0, 16), st.integers(0, 1 << 20))
def test_descriptor_and_size_decoders_raise_only_protocol_errors(desc, counts, n, size):
    for a, b in ((desc, counts), (bytes(str(desc), "utf-8"), bytes(str(counts), "utf-8")[: 4 * n])):
        try:
            P.decode_descriptors(a, b, n, size)
        except P.ProtocolError:
            pass
        try:
            P.decode_sizes(a, n, size)
        except P.ProtocolError:
            pass
        try:
            assert len(P.decode_sums(a, n)) == n
        except P.ProtocolError:
            pass
        extents = P.decode_pool_extents(a, b, [size] * n)  # never raises: None, or each page's runs whole
        assert extents is None or (len(extents) == n and all(sum(length for _a, length in page) == size
                                                              for page in extents)), extents


# -------------------------------------------------------- live daemon



@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    runner = start_node(tmp_path_factory.mktemp("fuzz"), node_toml(dram_tier("8MiB", max_page_bytes="64KiB")))
    yield runner
    assert runner.stop() == {"dram": 0}  # a clean, graceful stop after all of it


class Bulk:
    """Sends messages without waiting, then collects one reply for each."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sent = self.replies = self.errors = 0
        self.codes: dict = {}

    # A daemon keeps at most its high-water mark of unread replies a peer (tiers/node/daemon.py HWM): a
    # pipelining client sends in windows below it, as TierClient (one call in flight a thread) does.
    WINDOW = 32

    def run(self, messages, timeout: float = 10.0) -> None:
        for start in range(0, len(messages), self.WINDOW):
            self._window(messages[start:start + self.WINDOW], timeout)

    def _window(self, messages, timeout: float) -> None:
        for frames in messages:
            self.sock.send_multipart(frames)
        self.sent += len(messages)
        got = 0
        end = time.monotonic() + timeout
        while got < len(messages):
            if not self.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
                raise AssertionError(f"{len(messages) - got} of {len(messages)} messages got no reply")
            reply = P.unpack(self.sock.recv_multipart()[0])
            assert reply.get("v") == P.PROTOCOL_VERSION and isinstance(reply.get("ok"), bool), reply
            if not reply["ok"]:
                assert reply["code"] in P.ERROR_CODES and isinstance(reply["msg"], str), reply
                self.errors += 1
                self.codes[reply["code"]] = self.codes.get(reply["code"], 0) + 1
            got += 1
        self.replies += got

    def close(self) -> None:
        self.sock.close(linger=0)


def still_serving(runner) -> None:
    peer = RawPeer(runner.config.tier("dram").endpoint)
    try:
        session = peer.hello("after-fuzz")
        reply, _ = peer.call("put", s=session, keys=["alive"], frames=[b"y" * 1000])
        assert reply["stored"] == b"\x01"
        reply, frames = peer.call("get", s=session, keys=["alive"])
        assert frames == [b"y" * 1000]
    finally:
        peer.close()


def test_ten_thousand_hostile_messages(daemon):
    endpoint = daemon.config.tier("dram").endpoint
    pid = daemon.pid("dram")
    peer = RawPeer(endpoint)
    session = peer.hello("fuzz")
    peer.close()
    bulk = Bulk(endpoint)
    batches = []

    @settings(max_examples=EXAMPLES, **FUZZ_SETTINGS)
    @given(st.lists(message(session), min_size=MESSAGES_PER_EXAMPLE, max_size=MESSAGES_PER_EXAMPLE))
    def collect(messages):
        batches.append(messages)

    started = time.monotonic()
    collect()
    corpus = [m for batch in batches for m in batch]
    messages = corpus + Mutator(corpus, session).many(MESSAGES - len(corpus))
    generated = time.monotonic() - started
    # Deterministic extremes hypothesis would rarely draw: over every bound the daemon checks.
    extremes = [
        [P.request("lookup", 1, s=session, keys=["k"] * (P.MAX_BATCH + 1))],
        [P.request("lookup", 2, s=session, keys=["k" * (P.MAX_KEY_CHARS + 1)])],
        [P.pack({"v": 2, "op": "lookup", "id": 3, "pad": b"p" * (P.MAX_HEADER_BYTES + 1)})],
        [P.request("put", 4, s=session, keys=["big"]), b"b" * ((64 << 10) + 1)],
        [P.request("put", 5, s=session, keys=["a", "b"], frames_per_page=[1, 1]), b"x"],
        [P.request("get", 6, s=session, keys=["a"], region=1, desc=b"\0" * 16, regions_per_page=b"\1\0\0\0")],
        [P.request("evict", 7, s=session, bytes=-1)],
        [P.request("clear", 8, s=session, all=True)],
        [P.request("hello", 9, ns="n" * (P.MAX_NAMESPACE_CHARS + 1))],
        [msgpack.packb({"v": 2, "op": "lookup", "id": 10, **{f"f{i}": i for i in range(65)}})],  # map too long
        [b"\xdd\xff\xff\xff\xff"],  # array header claiming 4 G items
        [b"\xc6\x7f\xff\xff\xff"],  # bin header claiming 2 GiB
    ]
    bulk.run([m for m in extremes for _ in range(5)])
    # Warm-up (allocator pools, session table, caches), then the measured run.
    bulk.run(messages[:1000])
    rss_before = rss_bytes(pid)
    started = time.monotonic()
    for i in range(0, len(messages), 1000):
        bulk.run(messages[i:i + 1000])
    seconds = time.monotonic() - started
    rss_after = rss_bytes(pid)
    bulk.close()
    print(f"\nfuzz: {bulk.sent} messages ({bulk.errors} error replies) in {seconds:.1f} s "
          f"(+{generated:.1f} s generating); daemon VmRSS {rss_before >> 20} -> {rss_after >> 20} MiB; errors by code {bulk.codes}")
    assert bulk.sent >= MESSAGES and bulk.replies == bulk.sent
    assert "internal" not in bulk.codes, "a handler raised on hostile input; see the daemon log"
    assert rss_after - rss_before < RSS_SLACK_BYTES, (rss_before, rss_after)
    assert daemon.procs["dram"].poll() is None
    still_serving(daemon)


def test_fd_socket_garbage_is_refused_and_dropped(daemon):
    """The register handler: truncated, oversized, fd-less and wrong-version messages."""
    path = os.path.join(daemon.runtime_dir, "dram.fd.sock")
    garbage = [b"", b"\x00", b"\x05\x00\x00\x00abc", b"\xff\xff\xff\xff" + b"x" * 100, b"\x03\x00\x00\x00\x93\x01\x02",
               (3).to_bytes(4, "little") + msgpack.packb({"v": 2}), os.urandom(70000)]
    fd = os.memfd_create("fuzz")
    os.ftruncate(fd, 4096)
    for i in range(210):
        data = garbage[i % len(garbage)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(5)
        conn.connect(path)
        try:
            if i % 3 == 0:
                header = {"v": P.PROTOCOL_VERSION + (i % 2), "s": i, "size": [-1, 1 << 40, 0, "x"][i % 4]}
                P.send_register(conn, fd, header)
            elif data:
                try:
                    conn.sendall(data)
                except (BrokenPipeError, ConnectionResetError):
                    # The daemon read a length prefix it refuses and hung up before the rest arrived: dropped,
                    # as it should be (the daemon still serving is checked below).
                    continue
            else:
                conn.shutdown(socket.SHUT_WR)
            try:
                reply = conn.recv(65536)
            except (ConnectionResetError, socket.timeout):
                reply = b""
            if len(reply) > 4:
                assert msgpack.unpackb(reply[4:])["ok"] is False
        finally:
            conn.close()
    os.close(fd)
    assert daemon.procs["dram"].poll() is None
    still_serving(daemon)


def test_pool_daemon_handlers_survive_hostile_messages(tmp_path):
    """alloc, commit, locate, release (and the tier handlers) of a remote memory pool daemon."""
    pytest.importorskip("mooncake.engine", reason="a pool daemon needs the Mooncake Transfer Engine")
    from tiers.ops.node_runner import NodeRunner
    from tiers.stores.remote.loopback import free_ports, pool_config

    port = free_ports(1)[0]
    runner = NodeRunner(pool_config([port], capacity="16MiB", block_size="64KiB", max_page_bytes="1MiB"),
                        str(tmp_path / "run"), str(tmp_path / "data"))
    runner.start(timeout=60)
    try:
        endpoint = runner.config.tier("pool0").endpoint
        peer = RawPeer(endpoint)
        session = peer.hello("fuzz")
        reply, _ = peer.call("alloc", s=session, keys=["a", "b"], sizes=P.encode_sizes([4096, 4096]))
        assert reply["ok"], reply
        for sums in (b"\0" * 8, [1], "x"):  # one sum for two keys, a list, a string: refused by name
            bad, _ = peer.call("alloc", s=session, keys=["c", "d"], sizes=P.encode_sizes([4096, 4096]), sums=sums)
            assert bad["code"] == "bad_request" and "sums" in bad["msg"], bad
        corpus = [[P.request("alloc", 1, s=session, keys=["k1"], sizes=P.encode_sizes([4096]),
                             sums=P.encode_sums([9]))],
                  [P.request("commit", 2, s=session, lease=reply["lease"], keys=["a"])],
                  [P.request("locate", 3, s=session, keys=["a", "b"], done=[1, 2])],
                  [P.request("release", 4, s=session, lease=reply["lease"])]]
        peer.close()
        messages = Mutator(corpus, session, seed=7, ops=("alloc", "commit", "locate", "release", "hello", "lookup")
                           ).many(2000)
        bulk = Bulk(endpoint)
        pid = runner.pid("pool0")
        bulk.run(messages[:500])
        rss_before = rss_bytes(pid)
        for i in range(500, len(messages), 500):
            bulk.run(messages[i:i + 500])
        rss_after = rss_bytes(pid)
        bulk.close()
        print(f"\npool fuzz: {bulk.sent} messages, errors by code {bulk.codes}; VmRSS {rss_before >> 20} -> "
              f"{rss_after >> 20} MiB")
        assert bulk.replies == bulk.sent and runner.procs["pool0"].poll() is None
        assert "internal" not in bulk.codes, "a pool handler raised on hostile input; see the daemon log"
        assert rss_after - rss_before < RSS_SLACK_BYTES
        peer = RawPeer(endpoint)
        try:
            assert peer.hello("after")
        finally:
            peer.close()
    finally:
        runner.stop()
