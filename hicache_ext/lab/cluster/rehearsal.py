"""A cluster on one machine: pool nodes and inference nodes, each in its own network namespace.

Every node runs what a real node runs, as real processes: a pool node its
pool daemon (``kind = "pool"``, tcp:// on the node's own address, the Transfer
Engine over TCP), an inference node its remote tier daemon (ipc://, pools
reached over the fabric) and an engine process (hicache_ext/lab/cluster/engine.py:
the real backend on a real SGLang host pool).  The fabric
(hicache_ext/lab/cluster/fabric.py) joins them on a private bridge; links can
be slowed, made lossy, or cut.  ``scripts/cluster`` and tests/test_cluster.py
drive it.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hicache_ext.lab.cluster.fabric import Fabric
from tiers.ops.node_runner import NodeRunner, stop_process

POOL_PORT = 7400  # every pool node has its own address, so one port number serves all
MASTER_PORT = 50051  # the mooncake_master's RPC port on pool node 0 (kind mooncake_store)


@dataclass
class Layout:
    """What runs where: pools first, then inference nodes, one namespace each."""

    pools: int = 2
    engines: int = 2
    page_bytes: int = 256 << 10
    pages: int = 32  # pages an engine writes or reads a call
    pool_capacity: str = "256MiB"
    pool_block: str = "256KiB"
    remote: Dict[str, object] = field(default_factory=dict)  # extra options of each remote tier
    backend: Dict[str, object] = field(default_factory=dict)  # extra config of each engine's backend
    curve_dir: Optional[str] = None  # CurveZMQ keys (hicache-tiers keys generate) for every tcp:// link
    # "remote": pool daemons on the pool nodes; "mooncake_store": a mooncake_master on pool node 0 and each
    # inference node's tier a Mooncake Store client contributing store_segment of memory
    kind: str = "remote"
    store_segment: str = "64MiB"
    # Seconds mooncake_master keeps a silent store client's memory in placement (its --client_ttl; its own
    # default is 10): how long writes to a lost node's memory keep failing.
    store_client_ttl_s: int = 10


class EngineProc:
    """The parent's handle on an engine process: one JSON request, one JSON answer."""

    def __init__(self, cmd: List[str], log_path: str):
        """Launched; ``wait_ready`` before the first call (engines import SGLang, ~10 s of CPU each: a
        cluster launches them all, then waits, so they import at once)."""
        self.log_path = log_path
        self.namespace = ""
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=open(log_path, "wb"), env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 120.0) -> "EngineProc":
        first = self._line(timeout)
        if not first.get("ready"):
            raise RuntimeError(f"engine did not start: {first}; see {self.log_path}")
        self.namespace = first["namespace"]
        return self

    def _line(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = open(self.log_path, errors="replace").read().strip().splitlines()[-3:]
            return {"error": f"no answer within {timeout:.0f} s (exit {self.proc.poll()}): {tail}"}
        return json.loads(line)

    def call(self, timeout: float = 120.0, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        stop_process(self.proc, 30.0)


class Cluster:
    """A Layout started on a fresh Fabric under work_dir; close() (or the with block) removes everything."""

    def __init__(self, work_dir: str, layout: Layout):
        self.work_dir = work_dir
        os.makedirs(work_dir, exist_ok=True)
        self.layout = layout
        self.fabric = Fabric(layout.pools + layout.engines)
        self.pools: List[NodeRunner] = []
        self.tiers: List[NodeRunner] = []
        self.engines: List[EngineProc] = []
        self.master: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------ layout
    def pool_node(self, i: int) -> int:
        return i

    def engine_node(self, i: int) -> int:
        return self.layout.pools + i

    def pool_endpoint(self, i: int) -> str:
        return f"tcp://{self.fabric.addresses[self.pool_node(i)]}:{POOL_PORT}"

    def _curve_node_keys(self, server: bool) -> str:
        d = self.layout.curve_dir
        if d is None:
            return "allow_insecure_tcp = true\n"
        keys = [f'curve_client_key = "{d}/client.key_secret"', f'curve_server_key = "{d}/server.key"']
        if server:  # admits the *.key files of d (the client's); its own key admits nobody. The client key
            # is the node's operator's: `hicache-tiers stats` on the pool's node (scenarios.pool_stats).
            keys = [f'curve_server_key = "{d}/server.key_secret"', f'curve_authorized_keys = "{d}"',
                    f'curve_client_key = "{d}/client.key_secret"']
        return "\n".join(keys) + "\n"

    def _pool_config(self, i: int) -> str:
        lay = self.layout
        return (f"[node]\n{self._curve_node_keys(True)}\n[[tiers]]\nname = \"pool\"\nkind = \"pool\"\n"
                f"capacity = \"{lay.pool_capacity}\"\nblock_size = \"{lay.pool_block}\"\n"
                f"max_page_bytes = \"{max(1, lay.page_bytes >> 20)}MiB\"\nendpoint = \"{self.pool_endpoint(i)}\"\n"
                f"te_hostname = \"{self.fabric.addresses[self.pool_node(i)]}\"\n")

    def _store_config(self, i: int) -> str:
        lay = self.layout
        return (f"[[tiers]]\nname = \"remote\"\nkind = \"mooncake_store\"\n"
                f"master_server_address = \"{self.fabric.addresses[self.pool_node(0)]}:{MASTER_PORT}\"\n"
                f"te_hostname = \"{self.fabric.addresses[self.engine_node(i)]}\"\n"
                f"global_segment_size = \"{lay.store_segment}\"\nlocal_buffer_size = \"32MiB\"\n"
                f"max_page_bytes = \"{max(1, lay.page_bytes >> 20)}MiB\"\n")

    def _start_master(self) -> None:
        master = shutil.which("mooncake_master")
        if master is None:
            raise RuntimeError("mooncake_master is not installed (pip install mooncake-transfer-engine)")
        address = self.fabric.addresses[self.pool_node(0)]
        log = open(os.path.join(self.work_dir, "master.log"), "wb")
        self.master = subprocess.Popen([*self.fabric.prefix_of(self.pool_node(0)), master, f"--rpc_address={address}",
                                        f"--rpc_port={MASTER_PORT}", "--enable_metric_reporting=false",
                                        f"--client_ttl={self.layout.store_client_ttl_s}",
                                        f"--metrics_host={address}"],
                                       stdout=log, stderr=log, env={**os.environ, "MC_FORCE_TCP": "1"})
        log.close()
        time.sleep(1.5)  # the master answers no hello; the tiers' start fails loudly if it is not up
        if self.master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {self.master.returncode}; see {self.work_dir}/master.log")

    def _remote_config(self, i: int) -> str:
        lay = self.layout
        if lay.kind == "mooncake_store":
            return self._store_config(i)
        pools = ", ".join(f'"{self.pool_endpoint(p)}"' for p in range(lay.pools))
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in lay.remote.items())
        return (f"[node]\n{self._curve_node_keys(False)}\n[[tiers]]\nname = \"remote\"\nkind = \"remote\"\n"
                f"pools = [{pools}]\nmax_page_bytes = \"{max(1, lay.page_bytes >> 20)}MiB\"\n"
                f"te_hostname = \"{self.fabric.addresses[self.engine_node(i)]}\"\n{extra}")

    # --------------------------------------------------------- lifecycle
    def start(self) -> "Cluster":
        try:
            self.fabric.create()
            if self.layout.kind == "mooncake_store":
                self._start_master()
            else:
                for i in range(self.layout.pools):
                    self.pools.append(self._runner(f"pool{i}", self._pool_config(i), self.pool_node(i)))
            for i in range(self.layout.engines):
                runner = self._runner(f"node{i}", self._remote_config(i), self.engine_node(i))
                self.tiers.append(runner)
                self.engines.append(self._engine(i, runner))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _runner(self, name: str, config: str, node: int) -> NodeRunner:
        root = os.path.join(self.work_dir, name)
        runner = NodeRunner(config, os.path.join(root, "run"), os.path.join(root, "data"),
                            launcher=self.fabric.prefix_of(node), log_level="info")
        runner.start(timeout=60.0)
        return runner

    def _engine(self, i: int, runner: NodeRunner) -> EngineProc:
        spec = {"runtime_dir": runner.runtime_dir, "config": runner.config_path, "page_bytes": self.layout.page_bytes,
                "pages": self.layout.pages, "extra": self.layout.backend}
        cmd = [*self.fabric.prefix_of(self.engine_node(i)), sys.executable, "-m", "hicache_ext.lab.cluster.engine",
               json.dumps(spec)]
        return EngineProc(cmd, os.path.join(self.work_dir, f"engine{i}.log"))

    def close(self) -> None:
        """Engines, daemons, then the fabric: whatever failed before, nothing is left behind."""
        for engine in self.engines:
            try:
                engine.close()
            except Exception:  # keep tearing down
                pass
        for runner in [*self.tiers, *self.pools]:
            try:
                runner.kill()
            except Exception:
                pass
        if self.master is not None:
            stop_process(self.master, 10.0)
        self.fabric.remove()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------- failures
    def kill_store_node(self, i: int) -> None:
        """Kill inference node i's tier daemon (kind mooncake_store: the memory it contributed goes with it)."""
        self.tiers[i].kill()

    def kill_pool(self, i: int) -> None:
        self.pools[i].kill()

    def restart_pool(self, i: int) -> None:
        self.pools[i].start(timeout=60.0)

    def partition_pool(self, i: int) -> None:
        self.fabric.partition(self.pool_node(i))

    def heal_pool(self, i: int) -> None:
        self.fabric.heal(self.pool_node(i))

    def describe(self) -> List[str]:
        lines = [f"fabric {self.fabric.tag}: bridge in namespace {self.fabric.switch}, {self.fabric.prefix}.0/24, "
                 "no uplink, no default route"]
        if self.master is not None:
            lines.append(f"  {self.fabric.nodes[0]}  {self.fabric.addresses[0]}  mooncake_master "
                         f"{self.fabric.addresses[0]}:{MASTER_PORT} (pid {self.master.pid})")
        for i in range(len(self.pools)):
            node = self.pool_node(i)
            lines.append(f"  {self.fabric.nodes[node]}  {self.fabric.addresses[node]}  pool daemon "
                         f"{self.pool_endpoint(i)} (pid {self.pools[i].pid('pool')})")
        for i in range(self.layout.engines):
            node = self.engine_node(i)
            lines.append(f"  {self.fabric.nodes[node]}  {self.fabric.addresses[node]}  remote tier "
                         f"{self.tiers[i].config.tier('remote').endpoint} (pid {self.tiers[i].pid('remote')}), "
                         f"engine pid {self.engines[i].proc.pid}, namespace {self.engines[i].namespace}")
        return lines
