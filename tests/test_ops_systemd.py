"""systemd integration: notify messages on a fake NOTIFY_SOCKET, SIGHUP reload, graceful SIGTERM, the units."""
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import time

import pytest
import msgpack
import zmq

from tiers.wire import protocol as P
from tiers.cli import main
from tiers.ops.node_runner import ping
from tiers.node.regions import MAX_CONNECTIONS
from tests.support.nodes import node_toml, nvme_tier
from tests.support.ops import REPO, DaemonProcess, dram_node

UNITS = os.path.join(REPO, "scripts", "systemd")


def test_ready_after_bind_watchdog_pings_and_stopping(tmp_path):
    daemon = DaemonProcess(str(tmp_path), dram_node(), watchdog_usec=300_000)
    try:
        ready = daemon.wait_ready()  # asserts the ZeroMQ socket answers once READY=1 is in
        assert "STATUS=serving dram tier dram on ipc://" in ready
        assert not any("WATCHDOG=1" in m for m in daemon.notify.messages[:-1]), "watchdog before READY"
        for _ in range(3):  # every WATCHDOG_USEC/2
            daemon.notify.wait_for("WATCHDOG=1", timeout=5.0)
        daemon.signal(signal.SIGTERM)
        daemon.notify.wait_for("STOPPING=1", timeout=10.0)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    assert not os.path.exists(daemon.endpoint[len("ipc://"):])


def test_sighup_reloads_log_level_and_names_what_needs_a_restart(tmp_path):
    config = dram_node()
    daemon = DaemonProcess(str(tmp_path), config)
    try:
        daemon.wait_ready()
        daemon.write_config(dram_node(("dram", "64MiB"), log_level="warning"))
        daemon.signal(signal.SIGHUP)
        reloading = daemon.notify.wait_for("RELOADING=1", timeout=10.0)
        assert re.search(r"^MONOTONIC_USEC=\d+$", reloading, re.M)
        ready = daemon.notify.wait_for("READY=1", timeout=10.0)
        assert "restart to apply: tier dram: capacity" in ready
        # A broken file: the daemon says so and keeps serving with what it has.
        daemon.write_config(dram_node(log_level="loud"))
        daemon.signal(signal.SIGHUP)
        daemon.notify.wait_for("RELOADING=1", timeout=10.0)
        ready = daemon.notify.wait_for("READY=1", timeout=10.0)
        assert "last reload failed" in ready and "node.log_level" in ready
        assert daemon.proc.poll() is None
    finally:
        assert daemon.stop() == 0
    log = daemon.log()
    assert "log level info -> warning" in log
    assert "reload: tier dram: capacity changed; restart the daemon (hicache-tier@dram) to apply" in log
    assert "reload failed, keeping the running configuration" in log
    assert "tier dram stopped" not in log  # the new level took effect: no more info lines


def test_serving_every_tier_is_ready_when_each_answers(tmp_path):
    daemon = DaemonProcess(str(tmp_path), dram_node(("spare", "8MiB"), ("dram", "8MiB")), tier=None)
    try:
        ready = daemon.wait_ready()  # pings dram; the supervisor pinged both before READY=1
        assert "STATUS=serving tiers spare, dram" in ready
        assert ping(f"ipc://{daemon.runtime_dir}/spare.sock", 5.0)
        daemon.signal(signal.SIGTERM)
        daemon.notify.wait_for("STOPPING=1", timeout=10.0)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    assert len([m for m in daemon.notify.messages if "READY=1" in m]) == 1  # children do not speak to systemd


def test_repeated_failures_do_not_flood_the_log(tmp_path):
    daemon = DaemonProcess(str(tmp_path), dram_node())
    conns = []
    try:
        daemon.wait_ready()
        fd_socket = os.path.join(daemon.runtime_dir, "dram.fd.sock")
        for _ in range(MAX_CONNECTIONS + 40):  # the last 40 are refused, each with a warning
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(fd_socket)
            conns.append(conn)
        assert ping(daemon.endpoint, 5.0)  # the loop has accepted (and refused) them all by now
        time.sleep(0.5)
    finally:
        for conn in conns:
            conn.close()
        assert daemon.stop() == 0
    assert daemon.log().count("refused an attach connection") == 1, daemon.log()[-2000:]


def _send_big_put(endpoint, pages=48, page_bytes=4 << 20):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([P.request("hello", 1, ns="drain", client="test")])
    assert sock.poll(5000)
    session = P.unpack(sock.recv_multipart()[0])["session"]
    payload = [os.urandom(1024) * (page_bytes // 1024)] * pages
    sock.send_multipart([P.request("put", 2, session=session, keys=[f"k{i}" for i in range(pages)]), *payload],
                        copy=False)
    # Replies come in order of completion: once the stats reply is in, the put has been taken up.
    sock.send_multipart([P.request("stats", 3, session=session)])
    assert sock.poll(10000)
    # A reply, not a request: P.unpack bounds a request's map at 64 fields, and stats has more.
    assert msgpack.unpackb(sock.recv_multipart()[0], raw=False)["id"] == 3
    return sock


def _slow_tier(tmp_path) -> str:
    """Durable disk writes keep a big put busy for hundreds of milliseconds on any machine; a
    DRAM put of the same bytes can finish (~40 ms) before the test gets to send its signal."""
    return node_toml(nvme_tier("1GiB", fsync=True, max_page_bytes="8MiB", path=str(tmp_path / "chunks")))


def test_sigterm_finishes_requests_in_flight_then_exits_0(tmp_path):
    daemon = DaemonProcess(str(tmp_path), _slow_tier(tmp_path), tier="nvme")
    try:
        daemon.wait_ready()
        sock = _send_big_put(daemon.endpoint)
        in_flight = not sock.poll(0)  # the put's reply has not come yet
        daemon.signal(signal.SIGTERM)
        assert sock.poll(20000), "the request in flight at SIGTERM got no reply"
        reply = P.unpack(sock.recv_multipart()[0])
        sock.close(linger=0)
        assert reply["id"] == 2 and reply["ok"] and reply["stored"] == b"\x01" * 48
        assert daemon.proc.wait(20) == 0, daemon.log()
    finally:
        daemon.stop()
    assert in_flight, "the put finished before SIGTERM: the test did not exercise draining"
    assert "finishing in-flight requests" in daemon.log()


def test_second_signal_exits_at_once(tmp_path):
    daemon = DaemonProcess(str(tmp_path), _slow_tier(tmp_path), tier="nvme")
    try:
        daemon.wait_ready()
        sock = _send_big_put(daemon.endpoint, pages=64)
        daemon.signal(signal.SIGTERM)
        daemon.notify.wait_for("STOPPING=1", timeout=10.0)
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(10) == 1
        sock.close(linger=0)
    finally:
        daemon.stop()


# ------------------------------------------------------------------- units

def _analyze(*args):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (apt-get install systemd) and cannot be run here")
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60)


def test_install_units_and_systemd_analyze_verify(tmp_path, capsys):
    fake = tmp_path / "bin" / "hicache-tiers"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -m tiers.cli \"$@\"\n")
    fake.chmod(0o755)
    prefix, etc, doc = tmp_path / "units", tmp_path / "etc", tmp_path / "doc"
    args = ["install-units", "--prefix", str(prefix), "--config-dir", str(etc), "--exec", str(fake),
            "--doc-dir", str(doc)]
    assert main(args) == 0
    # tmp_path is where the units' PrivateTmp= would hide the executable: said, not refused.
    assert "PrivateTmp" in capsys.readouterr().err
    unit = (prefix / "hicache-tier@.service").read_text()
    # Documentation= names a file install-units put there.
    assert f"Documentation=file://{doc}/OPERATIONS.md" in unit and (doc / "OPERATIONS.md").exists()
    assert f"ExecStart={fake} serve --config {etc}/node.toml --tier %i" in unit
    assert f"ExecStart={fake} serve --config {etc}/pool.toml --tier pool" in (prefix / "hicache-pool.service").read_text()
    for directive in ("Type=notify", "WatchdogSec=", "RuntimeDirectory=hicache-tiers", "RuntimeDirectoryPreserve=yes",
                      "StateDirectory=hicache-tiers", "LimitMEMLOCK=infinity", "NoNewPrivileges=yes",
                      "ProtectSystem=strict", "ReadWritePaths=", "ProtectHome=yes", "PrivateTmp=yes",
                      "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert directive in unit, directive
    # The example configuration is valid and is never overwritten.
    assert main(["config", "check", str(etc / "node.toml")]) == 0
    assert main(["config", "check", str(etc / "pool.toml")]) == 0
    (etc / "node.toml").write_text("# mine\n")
    assert main(args) == 0
    assert (etc / "node.toml").read_text() == "# mine\n"
    assert "kept" in capsys.readouterr().out
    proc = _analyze("verify", str(prefix / "hicache-tier@.service"), str(prefix / "hicache-pool.service"))
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    # Instances of the template verify too.
    shutil.copy(prefix / "hicache-tier@.service", prefix / "hicache-tier@nvme.service")
    proc = _analyze("verify", str(prefix / "hicache-tier@nvme.service"))
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_install_units_without_sources_fails_with_1(tmp_path):
    assert main(["install-units", "--prefix", str(tmp_path / "u"), "--config-dir", str(tmp_path / "e"),
                 "--source", str(tmp_path / "nowhere"), "--exec", "/bin/true"]) == 1


def _expand(group: str, seen=None) -> set:
    """Every system call a SystemCallFilter group allows (nested groups expanded)."""
    seen = seen if seen is not None else set()
    out = set()
    lines = _analyze("syscall-filter", group).stdout.splitlines()
    for line in lines[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        if item.startswith("@"):
            if item not in seen:
                seen.add(item)
                out |= _expand(item, seen)
        else:
            out.add(item)
    return out


def test_syscall_filter_keeps_shared_memory_and_fd_passing(tmp_path):
    unit = open(os.path.join(UNITS, "hicache-tier@.service"), encoding="utf-8").read()
    groups = re.search(r"^SystemCallFilter=(.*)$", unit, re.M).group(1).split()
    allowed = set()
    for group in groups:
        allowed |= _expand(group)
    needed = {"memfd_create", "mmap", "munmap", "ftruncate", "sendmsg", "recvmsg", "socket", "bind", "connect",
              "accept4", "mlock", "madvise", "pread64", "pwrite64", "preadv", "pwritev", "fsync", "fdatasync",
              "epoll_wait", "eventfd2", "pipe2", "clone", "futex", "rename", "renameat2", "unlink", "unlinkat"}
    assert needed <= allowed, f"the filter would refuse: {sorted(needed - allowed)}"
    assert "AF_UNIX" in re.search(r"^RestrictAddressFamilies=(.*)$", unit, re.M).group(1)
    for dangerous in ("PrivateDevices=yes", "MemoryDenyWriteExecute=yes", "PrivateNetwork=yes"):
        assert dangerous not in unit, f"{dangerous} would break RDMA or the remote tier"


def test_a_stalled_loop_and_a_watchdog_abort_leave_every_threads_stack_in_the_log(tmp_path):
    """The daemon's loop blocked (a reload reading a configuration that is a FIFO nobody writes: the open waits
    forever): once it has not ticked for 2/3 of WatchdogSec the log holds every thread's stack, the loop's
    inside the reload; unblocked, it serves again.  Then SIGABRT (what systemd's watchdog sends a daemon
    that stopped pinging it) ends it with the stacks in the log once more."""
    daemon = DaemonProcess(str(tmp_path), dram_node(), watchdog_usec=1_500_000)  # stall dump after 1 s
    try:
        daemon.wait_ready()
        text = open(daemon.config_path, encoding="utf-8").read()
        os.unlink(daemon.config_path)
        os.mkfifo(daemon.config_path)
        daemon.signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "Timeout (" not in daemon.log():
            time.sleep(0.1)
        log = daemon.log()
        assert "Timeout (" in log, log[-2000:]  # faulthandler's dump_traceback_later
        stall = log[log.index("Timeout ("):]
        assert "in reload" in stall and "in serve_forever" in stall, stall[:3000]
        with open(daemon.config_path, "w", encoding="utf-8") as fifo:  # the reload reads it and goes on
            fifo.write(text)
        assert ping(daemon.endpoint, 10.0), "the daemon did not serve again after its loop was unblocked"
        daemon.signal(signal.SIGABRT)
        assert daemon.proc.wait(15) == -signal.SIGABRT
        aborted = daemon.log()[len(log):]
        assert "Fatal Python error: Aborted" in aborted and "in serve_forever" in aborted, aborted[-3000:]
        print(f"\nstalled loop: {stall.count('Thread 0x')} threads' stacks in the log; abort: "
              f"{aborted.count('Thread 0x')} threads' stacks")
    finally:
        daemon.stop()
