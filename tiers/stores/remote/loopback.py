"""Loopback clusters for tests, benchmarks and demos: pool daemons and inference nodes on 127.0.0.1."""
from __future__ import annotations

import socket
from typing import List


def free_ports(n: int) -> List[int]:
    """n TCP ports free on 127.0.0.1 right now."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def pool_config(ports: List[int], capacity: str = "64MiB", block_size: str = "256KiB",
                max_page_bytes: str = "16MiB", policy: str = "lru", max_lease_ms: int = 30000) -> str:
    """One pool tier a port, all served from one config (each tier is its own process)."""
    return "".join(f"""
[[tiers]]
name = "pool{i}"
kind = "pool"
capacity = "{capacity}"
policy = "{policy}"
block_size = "{block_size}"
max_page_bytes = "{max_page_bytes}"
max_lease_ms = {max_lease_ms}
endpoint = "tcp://127.0.0.1:{port}"
allow_insecure_tcp = true
""" for i, port in enumerate(ports))


def pool_endpoints(ports: List[int]) -> List[str]:
    return [f"tcp://127.0.0.1:{port}" for port in ports]


def remote_node_config(ports: List[int], max_page_bytes: str = "16MiB", pool_timeout_ms: int = 200,
                       pool_retry_max_ms: int = 1000, io_threads: int = 2) -> str:
    pools = ", ".join(f'"{e}"' for e in pool_endpoints(ports))
    return f"""
[[tiers]]
name = "remote"
kind = "remote"
pools = [{pools}]
max_page_bytes = "{max_page_bytes}"
te_hostname = "127.0.0.1"
pool_timeout_ms = {pool_timeout_ms}
pool_retry_max_ms = {pool_retry_max_ms}
io_threads = {io_threads}
"""
