"""Helpers that start real tier daemons for tests (no mocks)."""
from __future__ import annotations

import zmq

from tiers.wire import protocol as P
from tiers.wire.client import Deadlines
from tiers.ops.node_runner import NodeRunner

# For a call whose point is the bytes or the state it leaves, not the time it takes: a call past its deadline
# is a miss by design, and a 2-core machine shared with another test worker does not always serve within 1 s.
PATIENT = Deadlines(base=10.0, lookup=10.0, connect_wait=1.0, backoff_min=0.05, backoff_max=0.2)


def node_toml(*tiers: dict, **node) -> str:
    """A node configuration: [node] keys and one [[tiers]] table per dict (written by tomli-w)."""
    import tomli_w
    return tomli_w.dumps({**({"node": node} if node else {}), "tiers": list(tiers)})


def dram_tier(capacity="16MiB", **options) -> dict:
    return {"name": "dram", "kind": "dram", "capacity": capacity, "block_size": "4KiB", **options}


def nvme_tier(capacity="64MiB", **options) -> dict:
    return {"name": "nvme", "kind": "nvme", "capacity": capacity, "fsync": False, **options}


def dram_config(capacity: str = "64MiB", policy: str = "lru", block_size: str = "4KiB",
                max_page_bytes: str = "16MiB", write_policy: str = "write_through") -> str:
    return node_toml(dram_tier(capacity, policy=policy, block_size=block_size, max_page_bytes=max_page_bytes),
                     write_policy=write_policy)


def start_node(tmp_path, config_text: str) -> NodeRunner:
    runner = NodeRunner(config_text, str(tmp_path / "run"), str(tmp_path / "data"))
    runner.start()
    return runner


class RawPeer:
    """A bare DEALER socket for sending hand-made (and malformed) messages."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames, timeout: float = 5.0):
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        parts = self.sock.recv_multipart()
        return P.unpack(parts[0]), parts[1:]

    def call(self, op: str, req_id: int = 7, frames=(), **fields):
        return self.send(P.request(op, req_id, **fields), *frames)

    def hello(self, ns: str = "ns") -> int:
        reply, _ = self.call("hello", ns=ns)
        assert reply["ok"], reply
        return reply["session"]

    def close(self):
        self.sock.close(linger=0)


def remote_node(tmp_path, staging_bytes: str = "64MiB"):
    """A pool daemon and a remote tier daemon on loopback: (the engine's node, the pool's node), started."""
    from tiers.stores.remote.loopback import free_ports, pool_config, remote_node_config
    (port,) = free_ports(1)
    pool = NodeRunner(pool_config([port], capacity="64MiB", block_size="256KiB", max_page_bytes="4MiB"),
                      str(tmp_path / "pool" / "run"), str(tmp_path / "pool" / "data"))
    pool.start()
    node = start_node(tmp_path / "node", "[node]\n" + remote_node_config([port], max_page_bytes="4MiB")
                      + f'staging_bytes = "{staging_bytes}"\n')
    return node, pool


def eventually(check, within: float = 10.0, step: float = 0.05):
    """check() until it is truthy or within seconds pass; its last value (truthy on success)."""
    import time
    end = time.monotonic() + within
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(step)
    return check()


def thaw(pid: int) -> None:
    """SIGCONT a daemon a test froze with SIGSTOP; nothing when it is gone already (teardown)."""
    import os
    import signal
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP a daemon and return once every thread of it is stopped: kill() only queues the signal, and on a
    busy machine a thread may still run (answer a transfer) after it returned."""
    import os
    import signal
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = []
            for task in tasks:
                with open(f"/proc/{pid}/task/{task}/stat") as fh:
                    states.append(fh.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return True  # gone: nothing of it runs
        return all(state in ("T", "t") for state in states)
    if not eventually(stopped, timeout, 0.001):
        raise AssertionError(f"process {pid} did not stop within {timeout} s of SIGSTOP")


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), for memory-bound checks."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def module_node(prefix: str, config_text: str = None):
    """A module-scoped pytest fixture: one real node (default: one DRAM tier) for every test of a module."""
    import pytest

    @pytest.fixture(scope="module")
    def node(tmp_path_factory):
        runner = start_node(tmp_path_factory.mktemp(prefix), config_text or dram_config())
        yield runner
        runner.stop()

    return node
