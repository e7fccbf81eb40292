"""Security: private runtime directory and sockets, CurveZMQ on tcp://, key and size validation, namespace isolation."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import zmq

from tests.support.nodes import RawPeer, dram_config, node_toml, nvme_tier, start_node
from tiers.wire import protocol as P
from tiers.wire import security
from tiers.wire.client import Deadlines, TierClient
from tiers.ops.node_runner import NodeRunner, stop_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = Deadlines(base=1.0, lookup=0.5, connect_wait=0.2, backoff_min=0.05, backoff_max=0.2)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def serve(config_path: str, tier: str, log_path: str) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "tiers.cli", "serve", "--config", config_path, "--tier", tier,
                                 "--log-level", "info"], stdout=log, stderr=log, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()


def wait_log(path: str, text: str, timeout: float = 15.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with open(path, encoding="utf-8", errors="replace") as fh:
            content = fh.read()
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path}:\n{content}")


# ------------------------------------------------------- local sockets

def test_runtime_directory_and_sockets_are_owner_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)  # as systemd's RuntimeDirectoryMode=0755 leaves it
    runner = NodeRunner(dram_config(capacity="8MiB"), str(run), str(tmp_path / "data"))
    runner.start()
    try:
        assert mode(str(run)) == 0o700
        for name in ("dram.sock", "dram.fd.sock"):
            path = str(run / name)
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            assert mode(path) == 0o600, (name, oct(mode(path)))
    finally:
        runner.stop()


# ------------------------------------------------------------- CurveZMQ

def tcp_config(port: int, node_extra: str = "", tier_extra: str = "") -> str:
    return (f"[node]\n{node_extra}\n[[tiers]]\nname = \"net\"\nkind = \"dram\"\ncapacity = \"8MiB\"\n"
            f"block_size = \"4KiB\"\nendpoint = \"tcp://127.0.0.1:{port}\"\n{tier_extra}\n")


def test_tcp_without_keys_refuses_to_start(tmp_path):
    port = free_port()
    path = tmp_path / "node.toml"
    path.write_text(tcp_config(port))
    log = str(tmp_path / "log")
    proc = serve(str(path), "net", log)
    assert proc.wait(30) == 1
    text = open(log).read()
    assert "cannot start" in text and "curve_server_key" in text and "allow_insecure_tcp" in text


def test_tcp_with_explicit_insecure_opt_out_serves_and_warns(tmp_path):
    port = free_port()
    path = tmp_path / "node.toml"
    path.write_text(tcp_config(port, tier_extra="allow_insecure_tcp = true"))
    log = str(tmp_path / "log")
    proc = serve(str(path), "net", log)
    try:
        wait_log(log, "serving on")
        assert "WITHOUT authentication" in open(log).read()
        peer = RawPeer(f"tcp://127.0.0.1:{port}")
        try:
            assert peer.hello("open")
        finally:
            peer.close()
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def curve_node(tmp_path_factory):
    """A DRAM tier on tcp:// with CurveZMQ keys made by `hicache-tiers keys generate`."""
    tmp = tmp_path_factory.mktemp("curve")
    keys = tmp / "keys"
    out = subprocess.run([sys.executable, "-m", "tiers.cli", "keys", "generate", str(keys)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert mode(str(keys)) == 0o700 and mode(str(keys / "server.key_secret")) == 0o600
    port = free_port()
    path = tmp / "node.toml"
    path.write_text(tcp_config(port, node_extra='curve_server_key = "keys/server.key_secret"\n'
                                                'curve_client_key = "keys/client.key_secret"'))
    from tiers.ops.config import load_config
    curve = load_config(str(path)).tier("net").curve  # the keys this node's clients are handed
    log = str(tmp / "log")
    proc = serve(str(path), "net", log)
    wait_log(log, "serving on")
    yield dict(endpoint=f"tcp://127.0.0.1:{port}", keys=keys, log=log, proc=proc, tmp=tmp, curve=curve)
    stop_process(proc)


def test_curve_client_with_the_configured_keys_is_served(curve_node):
    assert "CurveZMQ on" in open(curve_node["log"]).read()
    client = TierClient("net", curve_node["endpoint"], "tenant", deadlines=FAST, curve=curve_node["curve"])
    try:
        assert client.put_frames(["k1"], [[b"s" * 4096]], 4096) == [True]
        found, frames = client.get_frames(["k1"], 4096)
        assert found == [True] and frames[0].bytes == b"s" * 4096
    finally:
        client.close()


def test_the_cli_without_a_client_key_says_why_a_curve_tier_does_not_answer(curve_node):
    """A node configured as a CurveZMQ server only (a pool's node): its operator's CLI connects in the clear
    and is refused before the daemon hears it. It must say so, not just call the tier down; with the
    node's client key it is answered."""
    port = int(curve_node["endpoint"].rsplit(":", 1)[1])
    server_only = curve_node["tmp"] / "server-only.toml"
    server_only.write_text(tcp_config(port, node_extra='curve_server_key = "keys/server.key_secret"'))

    def status(config):
        return subprocess.run([sys.executable, "-m", "tiers.cli", "status", "--config", str(config), "--timeout", "1"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    refused = status(server_only)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "down: net (tcp:// with CurveZMQ" in refused.stderr and "curve_client_key" in refused.stderr
    stats = subprocess.run([sys.executable, "-m", "tiers.cli", "stats", "--json", "--config", str(server_only),
                            "--timeout", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert stats.returncode == 1 and "no node.curve_client_key" in stats.stderr, stats.stderr
    answered = status(curve_node["tmp"] / "node.toml")
    assert answered.returncode == 0 and " up " in answered.stdout, answered.stdout + answered.stderr


def test_two_configurations_in_one_process_keep_their_own_keys(curve_node, tmp_path):
    """Loading a second configuration for the same endpoint (without keys) changes nothing for the first."""
    from tiers.ops.config import parse_config
    port = curve_node["endpoint"].rsplit(":", 1)[1]
    plain = parse_config(tcp_config(int(port), node_extra="allow_insecure_tcp = true"), "<plain>").tier("net").curve
    assert security.client_keys(plain, curve_node["endpoint"]) is None
    assert security.client_keys(curve_node["curve"], curve_node["endpoint"]) is not None
    keyed = TierClient("net", curve_node["endpoint"], "tenant", deadlines=FAST, curve=curve_node["curve"])
    bare = TierClient("net", curve_node["endpoint"], "tenant", deadlines=FAST, curve=plain)
    try:
        assert keyed.lookup(["k"]) is not None  # admitted with the first configuration's keys
        assert bare.lookup(["k"]) is None  # refused: no keys, whatever was loaded before
    finally:
        keyed.close()
        bare.close()


def raw_dealer(endpoint: str, curve=None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(endpoint)
    return sock


def unanswered(sock: zmq.Socket) -> bool:
    """True when a hello gets no reply within a second (the handshake was refused)."""
    try:
        sock.send_multipart([P.request("hello", 1, ns="intruder", client="x")], flags=zmq.NOBLOCK)
    except zmq.Again:
        return True
    return not sock.poll(1000)


def test_the_servers_own_key_admits_no_client(curve_node):
    """keys generate writes server.key next to client.key: that certificate names the server, not a client."""
    endpoint = curve_node["endpoint"]
    server_public, server_secret = security.load_key_file(str(curve_node["keys"] / "server.key_secret"),
                                                          need_secret=True)
    impostor = raw_dealer(endpoint, (server_public, server_secret, server_public))
    try:
        assert unanswered(impostor)
    finally:
        impostor.close()


def test_unauthenticated_clients_are_refused_and_logged(curve_node):
    endpoint = curve_node["endpoint"]
    server_public, _ = security.load_key_file(str(curve_node["keys"] / "server.key"), need_secret=False)
    plain = raw_dealer(endpoint)
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = raw_dealer(endpoint, (stranger_public, stranger_secret, server_public))
    try:
        assert unanswered(plain)
        assert unanswered(stranger)
        text = wait_log(curve_node["log"], "not authorized")
        assert "refused a connection" in text
        wait_log(curve_node["log"], "CurveZMQ handshake failed")
    finally:
        plain.close()
        stranger.close()
    assert curve_node["proc"].poll() is None  # refusals do not disturb the daemon


def test_bad_key_files_refuse_to_start(tmp_path):
    keys = tmp_path / "keys"
    security.generate(str(keys))
    os.chmod(keys / "server.key_secret", 0o644)
    port = free_port()
    path = tmp_path / "node.toml"
    path.write_text(tcp_config(port, node_extra='curve_server_key = "keys/server.key_secret"'))
    log = str(tmp_path / "log")
    assert serve(str(path), "net", log).wait(30) == 1
    assert "readable by others" in open(log).read()
    path.write_text(tcp_config(port, node_extra='curve_server_key = "keys/server.key"'))  # public only
    assert serve(str(path), "net", log).wait(30) == 1
    assert "holds no secret key" in open(log).read()
    path.write_text(tcp_config(port, node_extra='curve_server_key = "keys/missing"'))
    assert serve(str(path), "net", log).wait(30) == 1
    assert "No such file" in open(log).read()


def test_keys_generate_refuses_to_overwrite_and_bad_names(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tiers.cli", "keys", "generate", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    assert cli(str(tmp_path / "k")).returncode == 0
    again = cli(str(tmp_path / "k"))
    assert again.returncode == 1 and "exists" in again.stderr
    assert cli(str(tmp_path / "k"), "--name", "../evil").returncode == 2
    assert cli(str(tmp_path / "k"), "--force").returncode == 0


# ----------------------------------------------- keys, sizes, namespaces

@pytest.fixture(scope="module")
def nvme_node(tmp_path_factory):
    """Two independent nodes (a DRAM tier, an NVMe tier): each serves its own namespaces."""
    tmp = tmp_path_factory.mktemp("secnvme")
    dram = start_node(tmp / "d", dram_config(capacity="8MiB", max_page_bytes="1MiB"))
    nvme = start_node(tmp / "n", node_toml(nvme_tier("16MiB", max_page_bytes="1MiB")))
    yield Tiers(dram, nvme), tmp
    dram.stop()
    nvme.stop()


class Tiers:
    """Looks up a tier's runner by name."""

    def __init__(self, *runners):
        self.runners = runners
        self.config = self

    def tier(self, name):
        for runner in self.runners:
            for tier in runner.config.tiers:
                if tier.name == name:
                    return tier
        raise KeyError(name)


@pytest.mark.parametrize("key", ["../../etc/passwd", "a/b", "/abs", "x\x00y", "k\\..\\w", "é", " ", "",
                                 "k" * (P.MAX_KEY_CHARS + 1)])
def test_keys_with_separators_or_traversal_never_reach_the_file_system(nvme_node, key):
    runner, tmp = nvme_node
    before = sorted(os.listdir(tmp))
    peer = RawPeer(runner.config.tier("nvme").endpoint)
    try:
        session = peer.hello("ns")
        for op, frames in (("put", [b"p" * 512]), ("get", []), ("lookup", []), ("delete", [])):
            reply, _ = peer.call(op, s=session, keys=[key], frames=frames)
            assert reply["ok"] is False and reply["code"] == "bad_request", (op, key, reply)
        too_long = "n" * (P.MAX_NAMESPACE_CHARS + 1)
        for ns in (key if len(key) <= P.MAX_KEY_CHARS else too_long, "_ping/../x"):
            reply, _ = peer.call("hello", ns=ns)
            assert reply["ok"] is False and reply["code"] == "bad_request"
    finally:
        peer.close()
    assert sorted(os.listdir(tmp)) == before
    assert not os.path.exists("/etc/passwd.tmp")


def test_dot_keys_are_refused_and_nothing_reaches_the_disk(nvme_node):
    """'.', '..' and other all-dot names are refused as keys and namespaces; other dotted keys are fine."""
    runner, tmp = nvme_node
    peer = RawPeer(runner.config.tier("nvme").endpoint)
    try:
        reply, _ = peer.call("hello", ns="..")
        assert reply["code"] == "bad_request"
        session = peer.hello("dots")
        for keys in (["..", "."], ["ok", "..."]):
            reply, _ = peer.call("put", s=session, keys=keys, frames=[b"1" * 512, b"2" * 512])
            assert reply["code"] == "bad_request" and "invalid key" in reply["msg"]
        reply, _ = peer.call("put", s=session, keys=["a.b", ".x"], frames=[b"1" * 512, b"2" * 512])
        assert reply["stored"] == b"\x01\x01"
        reply, frames = peer.call("get", s=session, keys=["a.b", ".x"])
        assert frames == [b"1" * 512, b"2" * 512]
    finally:
        peer.close()
    root = runner.tier("nvme").options["path"]
    names = [n for _d, dirs, files in os.walk(root) for n in dirs + files]
    assert "." not in names and ".." not in names and all(os.sep not in n for n in names)
    assert os.path.realpath(root).startswith(os.path.realpath(str(tmp)))


def test_sizes_are_bounded(nvme_node):
    runner, _ = nvme_node
    peer = RawPeer(runner.config.tier("dram").endpoint)
    try:
        session = peer.hello("sizes")
        reply, _ = peer.call("put", s=session, keys=["big"], frames=[b"b" * ((1 << 20) + 1)])
        assert reply["code"] == "too_large"
        reply, _ = peer.call("put", s=session, keys=["split"], frames_per_page=[2], frames=[b"a" * (600 << 10)] * 2)
        assert reply["code"] == "too_large"  # the bound is on the page, not each frame
        reply, _ = peer.call("lookup", s=session, keys=["k"] * (P.MAX_BATCH + 1))
        assert reply["code"] == "too_large"
        reply, _ = peer.send(P.pack({"v": 2, "op": "lookup", "id": 1, "pad": b"x" * (P.MAX_HEADER_BYTES + 1)}))
        assert reply["code"] == "too_large"
        # A message over the socket's bound (page bound + header bound) is dropped by ZeroMQ with the connection.
        peer.sock.send_multipart([P.request("put", 2, s=session, keys=["huge"]), b"h" * (6 << 20)])
        assert not peer.sock.poll(1000)
    finally:
        peer.close()
    peer = RawPeer(runner.config.tier("dram").endpoint)
    try:
        session = peer.hello("sizes")
        reply, _ = peer.call("lookup", s=session, keys=["big", "split", "huge"])
        assert reply["held"] == b"\x00\x00\x00"
    finally:
        peer.close()


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_one_namespace_never_reads_evicts_or_clears_anothers_pages(nvme_node, tier):
    runner, _ = nvme_node
    peer = RawPeer(runner.config.tier(tier).endpoint)
    try:
        a, b = peer.hello("iso-a"), peer.hello("iso-b")
        reply, _ = peer.call("put", s=a, keys=["p0", "p1"], frames=[b"A" * 4096, b"B" * 4096])
        assert reply["stored"] == b"\x01\x01"
        reply, _ = peer.call("lookup", s=b, keys=["p0", "p1"])
        assert reply["held"] == b"\x00\x00" and reply["prefix"] == 0
        reply, frames = peer.call("get", s=b, keys=["p0", "p1"])
        assert reply["found"] == b"\x00\x00" and frames == []
        assert peer.call("delete", s=b, keys=["p0"])[0]["deleted"] == 0
        for fields in (dict(ns="iso-a"), dict(all=True)):
            assert peer.call("clear", s=b, **fields)[0]["code"] == "bad_request"
            assert peer.call("evict", s=b, bytes=1 << 30, **fields)[0]["code"] == "bad_request"
        if tier == "dram":
            reply, _ = peer.call("evict", s=b, bytes=1 << 30)  # its own namespace only
            assert reply["ok"] and reply["evicted_pages"] == 0
        reply, _ = peer.call("clear", s=b)
        assert reply["ok"] and reply["cleared"] == 0
        # Overwriting the same key in b's namespace leaves a's page alone.
        peer.call("put", s=b, keys=["p0"], frames=[b"Z" * 4096])
        reply, frames = peer.call("get", s=a, keys=["p0", "p1"])
        assert reply["found"] == b"\x01\x01" and frames == [b"A" * 4096, b"B" * 4096]
        # A forged session id is unknown, never another tenant's.
        reply, _ = peer.call("get", s=(a ^ 1) or 2, keys=["p0"])
        assert reply["code"] == "no_session"
    finally:
        peer.close()


def test_a_region_registered_by_one_session_is_unusable_by_another(nvme_node):
    import mmap
    runner, _ = nvme_node
    fd = os.memfd_create("pool")
    os.ftruncate(fd, 1 << 16)
    owner = TierClient("dram", runner.config.tier("dram").endpoint, "reg-a", deadlines=FAST)
    peer = RawPeer(runner.config.tier("dram").endpoint)
    try:
        owner.attach_region(fd, 1 << 16)
        assert owner.lookup(["x"]) == b"\x00" and owner.region_id is not None
        mapping = mmap.mmap(fd, 1 << 16)
        mapping[:4096] = b"R" * 4096
        desc, counts = P.encode_descriptors([[(0, 4096)]])
        assert owner.put_region(["secret"], desc, counts, 4096) == [True]
        other = peer.hello("reg-b")
        reply, _ = peer.call("get", s=other, keys=["secret"], region=owner.region_id, desc=desc,
                             regions_per_page=counts)
        assert reply["code"] == "bad_request"  # no daemon writes into any host pool at all
        reply, _ = peer.call("put", s=other, keys=["steal"], region=owner.region_id, desc=desc,
                             regions_per_page=counts)
        assert reply["code"] == "no_session"
        mapping.close()
    finally:
        owner.close()
        peer.close()
        os.close(fd)


def test_pools_on_tcp_admit_only_remote_tiers_with_the_keys(tmp_path):
    """The tcp:// endpoints that matter in practice: a pool with CurveZMQ, a remote tier with and without keys."""
    pytest.importorskip("mooncake.engine", reason="pools need the Mooncake Transfer Engine")
    from tiers.stores.remote.loopback import free_ports, remote_node_config
    keys = tmp_path / "keys"
    security.generate(str(keys))
    port = free_ports(1)[0]
    node_keys = (f'[node]\ncurve_server_key = "{keys}/server.key_secret"\n'
                 f'curve_client_key = "{keys}/client.key_secret"\n')
    pool_text = node_toml({"name": "pool", "kind": "pool", "capacity": "16MiB", "block_size": "64KiB",
                           "max_page_bytes": "1MiB", "endpoint": f"tcp://127.0.0.1:{port}"},
                          curve_server_key=f"{keys}/server.key_secret", curve_client_key=f"{keys}/client.key_secret")
    pool = NodeRunner(pool_text, str(tmp_path / "pool" / "run"), str(tmp_path / "pool" / "data"))
    with open(pool.log_path, "ab") as log:  # started by hand: NodeRunner's ping speaks without CurveZMQ
        pool.procs["pool"] = subprocess.Popen(pool.command("pool"), stdout=log, stderr=subprocess.STDOUT)
    nodes = []
    try:
        probe = TierClient("pool", f"tcp://127.0.0.1:{port}", "probe", deadlines=FAST,
                           curve=pool.config.tier("pool").curve)
        try:
            deadline = time.monotonic() + 60
            while probe.lookup(["x"]) is None and time.monotonic() < deadline:
                assert pool.procs["pool"].poll() is None, open(pool.log_path).read()[-2000:]
                time.sleep(0.2)
            assert probe.lookup(["x"]) == b"\x00"
        finally:
            probe.close()
        with_keys = NodeRunner(node_keys + remote_node_config([port]), str(tmp_path / "a" / "run"),
                               str(tmp_path / "a" / "data"))
        without = NodeRunner(remote_node_config([port]), str(tmp_path / "b" / "run"), str(tmp_path / "b" / "data"))
        for runner in (with_keys, without):
            runner.start(timeout=60)
            nodes.append(runner)
        page = b"p" * 65536
        ok = TierClient("remote", with_keys.config.tier("remote").endpoint, "tenant", deadlines=FAST,
                        curve=with_keys.config.tier("remote").curve)
        bad = TierClient("remote", without.config.tier("remote").endpoint, "tenant", deadlines=FAST,
                         curve=without.config.tier("remote").curve)
        try:
            deadline = time.monotonic() + 20
            while ok.put_frames(["k"], [[page]], len(page)) != [True] and time.monotonic() < deadline:
                time.sleep(0.2)
            found, frames = ok.get_frames(["k"], len(page))
            assert found == [True] and frames[0].bytes == page
            assert bad.put_frames(["k2"], [[page]], len(page)) == [False]
            found, _ = bad.get_frames(["k"], len(page))
            assert found == [False]
        finally:
            ok.close()
            bad.close()
        wait_log(pool.log_path, "CurveZMQ handshake failed")
    finally:
        for runner in nodes:
            runner.stop()
        pool.stop()
