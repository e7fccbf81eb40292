"""The rehearsal's scenarios, each returning the figures its issue asks for (tests and scripts/cluster).

Every scenario checks bytes: what an engine reads is compared page by page
(xxh3 of every byte) with what was written, and a page that differs is a
wrong page.  A read may stop early (a prefix of the pages), never return a
wrong one.  Call times are the backend calls' own, measured in the engine.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

from hicache_ext.lab.cluster.fabric import Link
from hicache_ext.lab.cluster.rehearsal import Cluster


def call_deadline(cluster: Cluster) -> float:
    """The backend's deadline for one batch: deadline_base_s plus its bytes at deadline_min_gbps."""
    backend = cluster.layout.backend
    nbytes = cluster.layout.pages * cluster.layout.page_bytes
    return float(backend.get("deadline_base_s", 1.0)) + nbytes / (float(backend.get("deadline_min_gbps", 0.1)) * 1e9)


def _check(wrote: dict, read: dict) -> Dict[str, float]:
    n = read.get("read", 0)
    wrong = sum(1 for a, b in zip(read.get("sums", []), wrote["sums"][:n]) if a != b)
    return {"pages_read": n, "wrong_pages": wrong}


def share(cluster: Cluster, salt: int = 1, seed: int = 11) -> Dict[str, float]:
    """Engine 0 writes a prefix; engine 1, on another node, finds it and reads it bit-exact through the pools."""
    a, b = cluster.engines[0], cluster.engines[1]
    a.call(op="write", salt=salt + 50000, seed=seed)  # untimed: first handshakes and Transfer Engine segments
    b.call(op="read", salt=salt + 50000)
    wrote = a.call(op="write", salt=salt, seed=seed)
    found = b.call(op="lookup", salt=salt)
    read = b.call(op="read", salt=salt)
    nbytes = cluster.layout.pages * cluster.layout.page_bytes
    return {"pages": cluster.layout.pages, "written": wrote.get("written", 0), "found": found.get("hits", 0),
            **_check(wrote, read), "bytes_checked": read.get("read", 0) * cluster.layout.page_bytes,
            "write_gbps": nbytes / wrote["seconds"] / 1e9 if wrote.get("written") else 0.0,
            "read_gbps": nbytes / read["seconds"] / 1e9 if read.get("read") else 0.0,
            "lookup_s": found.get("seconds", 0.0)}


def pool_stats(cluster: Cluster, i: int) -> dict:
    """The pool daemon's own stats, asked from inside its node (its tcp:// address is not reachable from here)."""
    runner = cluster.pools[i]
    cmd = [*cluster.fabric.prefix_of(cluster.pool_node(i)), sys.executable, "-m", "tiers.cli", "stats", "--config",
           runner.config_path, "--runtime-dir", runner.runtime_dir, "--data-dir", runner.data_dir, "--json",
           "--timeout", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return (json.loads(out.stdout or "{}").get("pool") or {}) if out.returncode == 0 else {}


def _fail_mid_batch(engine, salt: int, fail: Callable[[], None]) -> Tuple[dict, float]:
    """engine writes a batch under salt while fail() strikes 20 ms into it: (the write's answer, when)."""
    results: List[dict] = []
    writer = threading.Thread(target=lambda: results.append(engine.call(op="write", salt=salt, seed=salt)))
    writer.start()
    time.sleep(0.02)  # into the batch
    failed_at = time.monotonic()
    fail()
    writer.join()
    return results[0], failed_at


def pool_failure(cluster: Cluster, how: str = "kill", rounds: int = 3, recover_within: float = 30.0) -> Dict[str, float]:
    """Pool 0 dies (``kill``: SIGKILL) or is cut off (``partition``: its link down) while engine 0 writes a
    batch; engine 1 reads what was acknowledged.  Then writes go on with pool 0 gone (its keys rehashed to
    the others), pool 0 comes back (restarted empty, or its link healed), and the time until a write
    lands on it again is measured."""
    a, b = cluster.engines[0], cluster.engines[1]
    deadline = call_deadline(cluster)
    worst, wrong, checked = 0.0, 0, 0
    first, failed_at = _fail_mid_batch(a, 100, lambda: cluster.kill_pool(0) if how == "kill"
                                       else cluster.partition_pool(0))
    # With pool 0 gone: every acknowledged page reads back elsewhere bit-exact, and once the engine's node
    # counts the pool down (the call that finds it so loses its pages there) whole batches land again.
    rehashed, written_while_down, r = None, 0, 0
    while r < rounds or (rehashed is None and time.monotonic() - failed_at < recover_within):
        salt = 100 + r
        wrote = first if r == 0 else a.call(op="write", salt=salt, seed=salt)
        worst = max(worst, wrote.get("seconds", 0.0))
        read = b.call(op="read", salt=salt)
        worst = max(worst, read.get("seconds", 0.0))
        got = _check(wrote, read)
        wrong += got["wrong_pages"]
        checked += got["pages_read"] * cluster.layout.page_bytes
        if rehashed is None and r > 0 and wrote.get("written") == cluster.layout.pages:
            rehashed, written_while_down = time.monotonic() - failed_at, wrote["written"]
        r += 1
    back_at = time.monotonic()
    cluster.restart_pool(0) if how == "kill" else cluster.heal_pool(0)
    before = pool_stats(cluster, 0).get("pages", 0)
    recovered, salt = None, 1000
    while time.monotonic() - back_at < recover_within:
        salt += 1
        wrote = a.call(op="write", salt=salt, seed=salt)
        worst = max(worst, wrote.get("seconds", 0.0))
        if pool_stats(cluster, 0).get("pages", 0) > before:
            recovered = time.monotonic() - back_at
            break
    # Engine 0's node writing to pool 0 again says nothing of engine 1's: its client of pool 0 counts the
    # pool down until its own probe (backing off up to pool_retry_max_ms) is answered, and meanwhile reads
    # the keys pool 0 holds as misses.  The cluster is whole again when engine 1 reads a fresh batch whole.
    read_whole = None
    while recovered is not None and time.monotonic() - back_at < recover_within:
        salt += 1
        wrote = a.call(op="write", salt=salt, seed=salt)
        read = b.call(op="read", salt=salt)
        worst = max(worst, wrote.get("seconds", 0.0), read.get("seconds", 0.0))
        got = _check(wrote, read)
        wrong += got["wrong_pages"]
        checked += got["pages_read"] * cluster.layout.page_bytes
        if read.get("read") == cluster.layout.pages:
            read_whole = time.monotonic() - back_at
            break
    return {"pages_a_batch": cluster.layout.pages, "bytes_checked": checked, "wrong_pages": wrong,
            "written_while_down": written_while_down,
            "whole_batches_again_s": rehashed if rehashed is not None else float("nan"),
            "worst_call_s": worst, "deadline_s": deadline,
            "recovered_s": recovered if recovered is not None else float("nan"),
            "read_whole_again_s": read_whole if read_whole is not None else float("nan"),
            "seconds_down": back_at - failed_at}


def netem(cluster: Cluster, link: Link, rounds: int = 3) -> Dict[str, float]:
    """Throughput and lookup time with every node's link shaped, against the same cluster unshaped."""
    def measure(tag: str) -> Dict[str, float]:
        writes, reads, lookups = [], [], []
        for r in range(rounds):
            salt = (1 if tag == "plain" else 2) * 10000 + r
            wrote = cluster.engines[0].call(op="write", salt=salt, seed=r)
            found = cluster.engines[1].call(op="lookup", salt=salt)
            read = cluster.engines[1].call(op="read", salt=salt)
            nbytes = cluster.layout.pages * cluster.layout.page_bytes
            if _check(wrote, read)["wrong_pages"] or read.get("read") != cluster.layout.pages:
                raise AssertionError(f"{tag}: read {read.get('read')} pages, some wrong")
            writes.append(nbytes / wrote["seconds"] / 1e9)
            reads.append(nbytes / read["seconds"] / 1e9)
            lookups.append(found["seconds"])
        mid = rounds // 2
        return {f"{tag}_write_gbps": sorted(writes)[mid], f"{tag}_read_gbps": sorted(reads)[mid],
                f"{tag}_lookup_ms": sorted(lookups)[mid] * 1e3}

    out = measure("plain")
    for node in range(len(cluster.fabric.nodes)):
        cluster.fabric.shape(node, link)
    try:
        out.update(measure("shaped"))
    finally:
        for node in range(len(cluster.fabric.nodes)):
            cluster.fabric.shape(node, Link())
    return out


def _hello_from(cluster: Cluster, node: int, endpoint: str, key_dir: str) -> bool:
    """Whether a client in node's namespace gets a hello answered at endpoint (with key_dir's client keys,
    or with none when key_dir is "")."""
    code = ("import sys; from tiers.ops.node_runner import ping; from tiers.wire.security import CurveSettings; "
            "d = sys.argv[2]; curve = CurveSettings(server_key=d + '/server.key', "
            "client_key=d + '/client.key_secret') if d else None; "
            "sys.exit(0 if ping(sys.argv[1], 3.0, curve) else 1)")
    out = subprocess.run([*cluster.fabric.prefix_of(node), sys.executable, "-c", code, endpoint, key_dir],
                         capture_output=True, text=True, timeout=60)
    return out.returncode == 0


def curve(cluster: Cluster) -> Dict[str, float]:
    """With CurveZMQ on every pool: pages still cross nodes bit-exact; a client without the keys, on a
    node of the fabric, is refused by a pool."""
    got = share(cluster, salt=77, seed=77)
    endpoint, node = cluster.pool_endpoint(0), cluster.engine_node(0)
    got["keyed_hello_answered"] = _hello_from(cluster, node, endpoint, cluster.layout.curve_dir or "")
    got["keyless_hello_answered"] = _hello_from(cluster, node, endpoint, "")
    return got


def store_node_failure(cluster: Cluster, how: str = "kill", rounds: int = 3,
                       recover_within: float = 60.0) -> Dict[str, float]:
    """kind mooncake_store: inference node 1's store client (and the memory it gave the cluster) is killed,
    or its link cut, while engine 0 writes a batch.  Engine 0 reads back what it wrote, round after
    round: no wrong page, no call past its deadline; then node 1 comes back and the time until engine 1
    reads engine 0's pages again is measured."""
    a, b = cluster.engines[0], cluster.engines[1]
    deadline = call_deadline(cluster)
    worst, wrong, checked, whole = 0.0, 0, 0, 0
    first, failed_at = _fail_mid_batch(a, 300, lambda: cluster.kill_store_node(1) if how == "kill"
                                       else cluster.fabric.partition(cluster.engine_node(1)))
    # Until the master stops placing pages in the lost memory, writes and reads of them fail; round after
    # round until whole batches land again (or recover_within).
    whole_at, r = None, 0
    while r < rounds or (whole_at is None and time.monotonic() - failed_at < recover_within):
        salt = 300 + r
        wrote = first if r == 0 else a.call(op="write", salt=salt, seed=salt)
        read = a.call(op="read", salt=salt)
        worst = max(worst, wrote.get("seconds", 0.0), read.get("seconds", 0.0))
        got = _check(wrote, read)
        wrong += got["wrong_pages"]
        checked += got["pages_read"] * cluster.layout.page_bytes
        if wrote.get("written") == cluster.layout.pages and got["pages_read"] == cluster.layout.pages:
            whole += 1
            whole_at = whole_at or time.monotonic() - failed_at
        r += 1
    back_at = time.monotonic()
    if how == "kill":
        cluster.tiers[1].start(timeout=60.0)
    else:
        cluster.fabric.heal(cluster.engine_node(1))
    recovered, salt = None, 2000
    while time.monotonic() - back_at < recover_within:
        salt += 1
        wrote = a.call(op="write", salt=salt, seed=salt)
        read = b.call(op="read", salt=salt)
        got = _check(wrote, read)
        wrong += got["wrong_pages"]
        if wrote.get("written") == cluster.layout.pages and got["pages_read"] == cluster.layout.pages:
            recovered = time.monotonic() - back_at
            break
        time.sleep(0.2)
    return {"pages_a_batch": cluster.layout.pages, "bytes_checked": checked, "wrong_pages": wrong,
            "whole_rounds_while_down": whole, "rounds_while_down": r,
            "whole_batches_again_s": whole_at if whole_at is not None else float("nan"), "worst_call_s": worst,
            "deadline_s": deadline, "seconds_down": back_at - failed_at,
            "recovered_s": recovered if recovered is not None else float("nan")}
