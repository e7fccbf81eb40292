"""Faults of the medium under a live NVMe daemon, and peers that accept and never answer.

Full disk (a tmpfs of a few MiB), read-only remount, a data directory that is
missing or removed, chunk files deleted behind the daemon's back, a ZeroMQ
peer that accepts and stays silent, a TCP socket that accepts and never
speaks, and a remote tier whose pools are both of those: each gives a clear
log line and a miss or a refusal within the call's deadline; the daemon never
crashes.  Mounting needs root; without it those tests skip and say why.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import zmq

from tests.support.nodes import PATIENT, RawPeer, node_toml, nvme_tier
from tiers.wire.client import Deadlines, TierClient
from tiers.ops.node_runner import NodeRunner

DEADLINE = Deadlines(base=1.0, lookup=0.5, connect_wait=0.1, backoff_min=0.05, backoff_max=0.2)
SLACK = 0.5  # scheduling noise allowed past a deadline on a loaded 2-core machine
PAGE = 64 << 10


def nvme_config(path: str, capacity: str = "64MiB") -> str:
    return node_toml(nvme_tier(capacity, max_page_bytes="1MiB", fsync=True, path=path))


@pytest.fixture
def mount(tmp_path):
    """mount(size) -> a fresh tmpfs of that size under tmp_path; unmounted afterwards."""
    mounted = []

    def make(size: str = "4m") -> str:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root): {out.stderr.strip()}")
        mounted.append(str(point))
        return str(point)

    yield make
    for point in mounted:
        subprocess.run(["mount", "-o", "remount,rw", point], capture_output=True)
        subprocess.run(["umount", "-l", point], capture_output=True)


def remount(point: str, how: str) -> None:
    out = subprocess.run(["mount", "-o", f"remount,{how}", point], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot remount {point} {how}: {out.stderr.strip()}")


def timed(fn, *args, limit: float):
    started = time.monotonic()
    result = fn(*args)
    took = time.monotonic() - started
    assert took <= limit + SLACK, f"{fn.__name__} took {took:.2f}s, deadline {limit}s"
    return result


def log_text(runner: NodeRunner) -> str:
    with open(runner.log_path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def wait_for_log(runner: NodeRunner, text: str, timeout: float = 5.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        content = log_text(runner)
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in the daemon log:\n{log_text(runner)[-3000:]}")


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


class Node:
    def __init__(self, tmp_path, config: str):
        self.runner = NodeRunner(config, str(tmp_path / "run"), str(tmp_path / "data"))
        self.runner.start()
        self.client = TierClient("nvme", self.runner.config.tier("nvme").endpoint, "media", deadlines=DEADLINE)
        self.patient = TierClient("nvme", self.runner.config.tier("nvme").endpoint, "media", deadlines=PATIENT)
        self.peer = RawPeer(self.runner.config.tier("nvme").endpoint)
        self.session = self.peer.hello("media")

    def put(self, i: int) -> dict:
        """One page through a raw peer (to see the refusal code), within the deadline."""
        started = time.monotonic()
        reply, _ = self.peer.call("put", s=self.session, keys=[f"p{i}"], frames=[page(i)], dl=time.time() + 2.0)
        assert time.monotonic() - started <= 2.0 + SLACK
        return reply

    def get(self, keys):
        """keys' pages within the engine's deadline (a miss once it passed)."""
        found, frames = timed(self.client.get_frames, keys, PAGE * len(keys), limit=DEADLINE.for_bytes(PAGE * len(keys)))
        return found, [f.bytes for f in frames]

    def read(self, keys):
        """keys' pages under a patient deadline: what the store holds, whatever the machine's load."""
        found, frames = self.patient.get_frames(keys, PAGE * len(keys))
        return found, [f.bytes for f in frames]

    def alive(self) -> bool:
        return self.runner.procs["nvme"].poll() is None

    def close(self):
        self.client.close()
        self.patient.close()
        self.peer.close()
        self.runner.stop()


def fill_disk(path: str) -> None:
    """Write a ballast file until the file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_full_disk_evicts_then_refuses_cleanly_and_recovers(tmp_path, mount):
    point = mount("3m")
    node = Node(tmp_path, nvme_config(os.path.join(point, "nvme")))  # capacity 64 MiB on a 3 MiB disk
    try:
        ballast = os.path.join(point, "ballast")
        with open(ballast, "wb") as fh:  # another tenant of the disk: the store cannot evict it
            fh.write(b"\0" * (2 << 20))
        replies = [node.put(i) for i in range(24)]  # 1.5 MiB of pages on ~1 MiB of free space
        assert all(r.get("stored") == b"\x01" for r in replies), "the store makes room by evicting its own pages"
        wait_for_log(node.runner, "full below the configured capacity; evicting")
        held, _ = node.peer.call("lookup", s=node.session, keys=[f"p{i}" for i in range(24)])
        kept = [f"p{i}" for i, h in enumerate(held["held"]) if h]
        assert kept
        found, frames = node.get(kept)
        assert all(f == page(int(k[1:])) for k, f in zip([k for k, ok in zip(kept, found) if ok], frames))
        node.peer.call("clear", s=node.session)
        fill_disk(ballast)  # the store holds nothing it could evict: no room at all
        refused = [node.put(100 + i) for i in range(3)]
        assert all(r.get("stored") != b"\x01" for r in refused)
        codes = {r.get("code") or (r.get("refusal") or [None])[0] for r in refused}
        assert codes == {"full"}, refused
        os.unlink(ballast)
        assert node.put(200).get("stored") == b"\x01"  # room again: served again
        assert node.alive()
    finally:
        node.close()


def keys_under(namespace: str, first_level: int, n: int):
    """n keys whose chunks live under DIR/<first_level>/ (the NVMe fan-out)."""
    from tiers.stores.nvme.layout import key_digest
    out, i = [], 0
    while len(out) < n:
        key = f"ro{i}"
        if key_digest(namespace, key) & 0xFF == first_level:
            out.append(key)
        i += 1
    return out


def test_read_only_file_system_refuses_writes_and_serves_reads(tmp_path, mount, caplog):
    # The daemon holds DIR/LOCK open for writing, which keeps a whole-tier mount from going
    # read-only; a fan-out directory mounted on its own can, as a failing disk would.
    root = tmp_path / "nvme"
    root.mkdir()
    sub = root / "2a"
    sub.mkdir()
    point = mount("8m")
    out = subprocess.run(["mount", "--bind", point, str(sub)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot bind-mount: {out.stderr.strip()}")
    try:
        node = Node(tmp_path, nvme_config(str(root)))
        keys = keys_under("media", 0x2A, 6)
        try:
            for i, key in enumerate(keys[:4]):
                reply, _ = node.peer.call("put", s=node.session, keys=[key], frames=[page(i)])
                assert reply["stored"] == b"\x01"
            remount(str(sub), "ro,bind")
            reply, _ = node.peer.call("put", s=node.session, keys=[keys[4]], frames=[page(4)])
            assert reply.get("stored") != b"\x01"
            assert (reply.get("code") or reply.get("refusal", [None])[0]) == "io_error", reply
            found, frames = node.read(keys[:4])
            assert found == [True] * 4 and frames == [page(i) for i in range(4)]
            with caplog.at_level(logging.WARNING, logger="hicache.client"):
                assert node.client.put_frames([keys[5]], [[page(5)]], PAGE) == [False]
            # The refusal's reason reaches the engine's log (the daemon itself logs no store refusal).
            assert "Read-only file system" in caplog.text and "io_error" in caplog.text
            remount(str(sub), "rw,bind")
            reply, _ = node.peer.call("put", s=node.session, keys=[keys[4]], frames=[page(4)])
            assert reply["stored"] == b"\x01"
            assert node.alive()
        finally:
            node.close()
    finally:
        subprocess.run(["umount", "-l", str(sub)], capture_output=True)


def test_unusable_data_directory_refuses_to_start_with_one_line(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data directory should be")
    runner = NodeRunner(nvme_config(str(blocker / "nvme")), str(tmp_path / "run"), str(tmp_path / "data"))
    with pytest.raises(RuntimeError, match="exited with 1"):
        runner.start(timeout=30)
    text = log_text(runner)
    assert "tier nvme cannot start" in text and "Traceback" not in text


def four_pages(tmp_path):
    """(a node whose NVMe tier holds pages p0-p3, the tier's directory)."""
    path = str(tmp_path / "nvme")
    node = Node(tmp_path, nvme_config(path))
    for i in range(4):
        assert node.put(i)["stored"] == b"\x01"
    return node, path


def test_data_directory_removed_behind_the_daemon(tmp_path):
    node, path = four_pages(tmp_path)
    try:
        shutil.rmtree(path)
        found, _ = node.get(["p0", "p1"])
        assert found == [False, False]  # a miss, never an exception
        reply = node.put(5)  # either the store recreates the directory or it refuses with a reason
        assert reply.get("stored") == b"\x01" or reply.get("code") or reply.get("refusal"), reply
        if reply.get("stored") == b"\x01":
            assert node.read(["p5"])[1] == [page(5)]
        held, _ = node.peer.call("lookup", s=node.session, keys=["p0", "p1", "p2", "p3"])
        assert held["held"] == b"\x00\x00\x01\x01"  # the pages read are forgotten; p2, p3 go at their read
        assert node.alive()
    finally:
        node.close()


def test_chunk_files_deleted_behind_the_daemon_are_misses_and_logged(tmp_path):
    node, path = four_pages(tmp_path)
    try:
        files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(path) for f in fs
                       if f not in ("LOCK", "usage.ceiling"))  # the chunks, not the store's own files
        assert len(files) == 4
        for f in files[:2]:
            os.unlink(f)
        found, frames = node.read([f"p{i}" for i in range(4)])
        assert sum(found) == 2
        assert all(f == page(int(k[1:])) for k, f in zip([f"p{i}" for i, ok in enumerate(found) if ok], frames))
        held, _ = node.peer.call("lookup", s=node.session, keys=[f"p{i}" for i in range(4)])
        assert sum(held["held"]) == 2  # the index forgot the vanished pages
        wait_for_log(node.runner, "vanished")
        assert node.alive()
    finally:
        node.close()


# ------------------------------------------------------------- silent peers

class SilentRouter:
    """A ZeroMQ peer that completes the handshake, takes every request and never answers."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def close(self):
        self.sock.close(linger=0)


class SilentAcceptor:
    """A TCP socket that accepts connections and never sends a byte (not even a ZMTP greeting)."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        self.listener.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
                self.conns.append(conn)
            except (socket.timeout, OSError):
                continue

    def close(self):
        self._stop = True
        self.thread.join(2)
        for conn in self.conns:
            conn.close()
        self.listener.close()


@pytest.mark.parametrize("kind", [SilentRouter, SilentAcceptor])
def test_a_peer_that_accepts_and_never_answers_costs_one_deadline(kind, caplog):
    peer = kind()
    client = TierClient("silent", peer.endpoint, "ns", deadlines=DEADLINE)
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.client"):
            assert timed(client.lookup, ["a", "b"], limit=DEADLINE.lookup) is None
            assert timed(client.put_frames, ["a"], [[b"x" * PAGE]], PAGE, limit=DEADLINE.for_bytes(PAGE)) == [False]
            assert timed(client.get_frames, ["a"], PAGE, limit=DEADLINE.for_bytes(PAGE))[0] == [False]
        assert "unavailable" in caplog.text and "serving misses" in caplog.text
    finally:
        client.close()
        peer.close()


def test_a_remote_tier_whose_pools_never_answer_serves_misses(tmp_path):
    pytest.importorskip("mooncake.engine", reason="the remote tier needs the Mooncake Transfer Engine")
    router, acceptor = SilentRouter(), SilentAcceptor()
    config = node_toml({"name": "remote", "kind": "remote", "pools": [router.endpoint, acceptor.endpoint],
                        "max_page_bytes": "1MiB", "te_hostname": "127.0.0.1", "pool_timeout_ms": 200,
                        "pool_retry_max_ms": 500})
    runner = NodeRunner(config, str(tmp_path / "run"), str(tmp_path / "data"))
    runner.start(timeout=60)
    client = TierClient("remote", runner.config.tier("remote").endpoint, "ns", deadlines=DEADLINE)
    try:
        keys = [f"k{i}" for i in range(8)]
        for _ in range(3):
            held = timed(client.lookup, keys, limit=DEADLINE.lookup)
            assert held in (None, b"\x00" * 8)
            stored = timed(client.put_frames, keys, [[page(i)] for i in range(8)], 8 * PAGE,
                           limit=DEADLINE.for_bytes(8 * PAGE))
            assert stored == [False] * 8
            found, _ = timed(client.get_frames, keys, 8 * PAGE, limit=DEADLINE.for_bytes(8 * PAGE))
            assert found == [False] * 8
        assert runner.procs["remote"].poll() is None
        text = log_text(runner)
        assert router.endpoint in text or acceptor.endpoint in text, text[-2000:]
    finally:
        client.close()
        runner.stop()
        router.close()
        acceptor.close()
