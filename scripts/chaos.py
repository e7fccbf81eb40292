#!/usr/bin/env python3
"""Chaos: rank processes write and read through the real backend while tier daemons are SIGKILLed and restarted.

Four rank processes (``--ranks``) each build the backend the way SGLang does
(factory, real host pool, the controller's page functions) and loop: write a
new chain of pages (content derived from each page's key, so any reader can
verify any page) or read back a chain written earlier and verify every page
returned.  Meanwhile this process SIGKILLs a random tier daemon, restarts it,
and keeps it up for ``--hold`` seconds before the next kill.

Checked and reported (``--json``):
- wrong pages: a page reported read whose bytes are not its key's content (must be 0);
- exceptions escaping the backend (must be 0);
- recovery: per restart, the time from the daemon answering again to every
  rank completing a fully acknowledged write (must be under 2 s);
- durability: at the end every daemon is SIGKILLed and restarted, and every
  page any rank had acknowledged must read back correctly (write_through onto
  an NVMe tier with fsync; DRAM comes back empty, so the pages come from disk).

    python scripts/chaos.py --seconds 90 --json chaos.json
    python scripts/chaos.py --seconds 20 --tiers dram,nvme    # the suite's short version
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPE = dict(layers=4, kv_heads=2, head_dim=64, page_size=16)  # 32 KiB pages
CHAIN = 8  # pages a write
POOL_PAGES = 3 * CHAIN
RECOVERY_LIMIT_S = 2.0


def node_config(tiers: List[str], nvme_capacity: str) -> str:
    text = '[node]\nwrite_policy = "write_through"\n'
    for name in tiers:
        if name == "dram":
            text += ('\n[[tiers]]\nname = "dram"\nkind = "dram"\ncapacity = "16MiB"\nblock_size = "4KiB"\n'
                     'max_page_bytes = "1MiB"\n')
        elif name == "nvme":
            text += (f'\n[[tiers]]\nname = "nvme"\nkind = "nvme"\ncapacity = "{nvme_capacity}"\n'
                     'max_page_bytes = "1MiB"\nfsync = true\n')
        else:
            raise SystemExit(f"unknown tier {name!r} (dram, nvme)")
    return text


# ------------------------------------------------------------------ a rank

class Rank:
    """One SGLang rank: a host pool, the backend from SGLang's factory, the controller's page functions."""

    def __init__(self, rank: int, ranks: int, runtime_dir: str, config_path: str):
        from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, create_backend,
                                                make_storage_config)
        self.rank = rank
        self.pool = build_mha_host_pool(layout="page_first", allocator=os.environ.get("CHAOS_ALLOCATOR", "shm"), pages=POOL_PAGES, **SHAPE)
        extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
                 "runtime_dir": runtime_dir, "tiers_config": config_path, "interface_v1": 1, "allocator": os.environ.get("CHAOS_ALLOCATOR", "shm")}
        self.config = make_storage_config(tp_rank=rank, tp_size=ranks, model_name="chaos", layout="page_first",
                                          extra_config=extra)
        self.backend = create_backend("dynamic", self.config, self.pool)
        self.exceptions: List[str] = []
        self._count_exceptions()
        self.driver = PageDriver(self.backend, self.pool, self.config, "dynamic")
        self._expected: Dict[str, int] = {}

    def _count_exceptions(self) -> None:
        """Wrap the backend methods the controller calls: anything raised escaped the backend."""
        backend = self.backend
        for name in ("batch_set_v1", "batch_get_v1", "batch_exists", "batch_set", "batch_get", "exists"):
            method = getattr(backend, name, None)
            if method is None:
                continue

            def counted(*args, _method=method, _name=name, **kwargs):
                try:
                    return _method(*args, **kwargs)
                except BaseException as exc:
                    self.exceptions.append(f"{_name}: {type(exc).__name__}: {exc}")
                    raise
            setattr(backend, name, counted)

    def indices(self, first: int, n: int):
        from hicache_ext.lab.sglang_harness import host_indices_for_pages
        return host_indices_for_pages(self.pool, first, n)

    def fill(self, keys: List[str], first: int) -> None:
        """Write each key's own content into consecutive pages from slot first."""
        from hicache_ext.lab.sglang_harness import fill_pages
        for i, key in enumerate(keys):
            fill_pages(self.pool, self.indices(first + i, 1), key_seed(key))

    def expected(self, key: str) -> int:
        """The checksum of key's content, derived from the key alone (scratch slot 2*CHAIN)."""
        value = self._expected.get(key)
        if value is None:
            from hicache_ext.lab.sglang_harness import page_checksums
            slot = 2 * CHAIN
            self.fill([key], slot)
            value = page_checksums(self.pool, self.indices(slot, 1))[0]
            self._expected[key] = value
        return value

    def write(self, keys: List[str]) -> int:
        self.fill(keys, 0)
        return self.driver.backup(keys, self.indices(0, len(keys)))

    def read(self, keys: List[str]):
        """(pages read, pages whose bytes are not their key's content)."""
        from hicache_ext.lab.sglang_harness import page_checksums, zero_pages
        idx = self.indices(CHAIN, len(keys))
        zero_pages(self.pool, idx)
        done = self.driver.prefetch(keys, idx)
        sums = page_checksums(self.pool, idx)
        wrong = [k for k, s in zip(keys[:done], sums[:done]) if s != self.expected(k)]
        return done, wrong

    def close(self) -> None:
        try:
            self.backend.close()
        except Exception as exc:
            self.exceptions.append(f"close: {type(exc).__name__}: {exc}")


def key_seed(key: str) -> int:
    return int(key[:15], 16)


def chain_keys(rank: int, n: int) -> List[str]:
    from hicache_ext.lab.sglang_harness import make_keys
    return make_keys(CHAIN, salt=rank * 1_000_003 + n, page_size=SHAPE["page_size"])


def run_rank(args, rank_id: int, conn, log_path: str) -> None:
    """A forked rank process: ready -> (go) chaos loop -> done -> (verify) -> result, over a pipe."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)  # SGLang's and the backend's log lines
    os.close(log)
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    rank = Rank(rank_id, args.ranks, args.runtime_dir, args.config)
    rng = random.Random(args.seed * 100 + rank_id)
    conn.send({"ready": rank_id})
    go = conn.recv()
    acked: List[List[str]] = []  # chains with every page acknowledged
    partial: List[List[str]] = []  # leading acknowledged pages of chains written in part
    ops = []  # (start, end, kind, ok)
    wrong: List[str] = []
    n = 0
    stats = {"writes": 0, "write_pages_acked": 0, "reads": 0, "pages_read": 0, "reads_of_unwritten_hit": 0}
    while time.time() < go["until"]:
        start = time.time()
        choice = rng.random()
        if choice < 0.5:
            fresh = stats["write_pages_acked"] < args.max_pages or not acked
            # Past --max-pages a rank rewrites its own chains (same keys, same content): still
            # a write that needs every tier, no new capacity.
            keys = chain_keys(rank_id, n) if fresh else rng.choice(acked)
            n += fresh
            done = rank.write(keys)
            stats["writes"] += 1
            if fresh:
                stats["write_pages_acked"] += done
                if done == len(keys):
                    acked.append(keys)
                elif done:
                    partial.append(keys[:done])
            ops.append((start, time.time(), "write", done == len(keys)))
        elif choice < 0.95 and acked:
            keys = rng.choice(acked)
            done, bad = rank.read(keys)
            wrong += bad
            stats["reads"] += 1
            stats["pages_read"] += done
            ops.append((start, time.time(), "read", done == len(keys)))
        else:  # a chain nobody wrote: any page returned would be a wrong page
            keys = chain_keys(rank_id + 1000, rng.randrange(1 << 30))
            done, bad = rank.read(keys)
            wrong += bad + keys[:done]
            stats["reads_of_unwritten_hit"] += done
    conn.send({"done": rank_id})
    conn.recv()  # verify: every daemon was killed and restarted
    lost, verify_wrong = verify(rank, acked + partial, args.verify_seconds)
    rank.close()
    conn.send({"rank": rank_id, "ops": ops, "wrong": wrong, "exceptions": rank.exceptions, "stats": stats,
               "acked_pages": sum(len(c) for c in acked + partial), "lost": lost, "verify_wrong": verify_wrong})
    conn.close()
    os._exit(0)  # no atexit handlers inherited from the parent


def verify(rank: Rank, chains: List[List[str]], seconds: float):
    """Read every acknowledged chain back; retries while the daemons come back. (lost keys, wrong keys).

    A chain still short when the first pass's time is up gets a second pass of its own (up to 2 s
    each, seconds in all): on a loaded machine one read can miss without any page being gone (a lease
    that expired before this process copied it), and the first pass's deadline may pass mid-way."""
    end = time.time() + seconds
    short, wrong = [], []
    for keys in chains:
        done = read_until(rank, keys, end, wrong)
        if done < len(keys):
            short.append(keys)
    lost = []
    end = time.time() + seconds
    for keys in short:
        done = read_until(rank, keys, min(end, time.time() + 2.0), wrong)
        lost += keys[done:]
    return lost, wrong


def read_until(rank: Rank, keys: List[str], end: float, wrong: List[str]) -> int:
    """Pages of keys read (a prefix), retrying until all are or end passes; wrong pages added to wrong."""
    while True:
        done, bad = rank.read(keys)
        wrong += bad
        if done == len(keys) or time.time() > end:
            return done
        time.sleep(0.1)


# ------------------------------------------------------------- the driver

def run(args) -> dict:
    from multiprocessing import get_context

    from tiers.ops.node_runner import NodeRunner

    tiers = args.tiers.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="hicache-chaos-")
    runner = NodeRunner(node_config(tiers, args.nvme_capacity), os.path.join(work, "run"), os.path.join(work, "data"),
                        log_level="warning")
    args.runtime_dir, args.config = runner.runtime_dir, runner.config_path
    t0 = time.time()
    pipes, procs = [], []
    try:  # from the first daemon on: whatever fails below, every process started here is stopped
        daemon_log = open(runner.log_path, "ab")
        for name in tiers:  # started now, waited for after the ranks are up
            runner.procs[name] = subprocess.Popen(runner.command(name), stdout=daemon_log, stderr=daemon_log)
        daemon_log.close()
        # SGLang and torch take ~13 s of CPU to import: once here, then fork the rank processes
        # (no thread runs yet, no ZeroMQ context exists in this process before the fork).
        import hicache_ext.lab.sglang_harness  # noqa: F401
        ctx = get_context("fork")
        rng = random.Random(args.seed)
        for r in range(args.ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_rank, args=(args, r, child, os.path.join(work, f"rank{r}.log")), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        for name in tiers:
            runner.wait_ready(name)
        for pipe in pipes:
            expect(pipe, "ready", 300)
        started = time.time()
        phases = {"startup_s": round(started - t0, 1)}
        until = started + args.seconds
        for pipe in pipes:
            pipe.send({"until": until})
        events = []
        time.sleep(min(args.hold, args.seconds / 4))
        first = rng.randrange(len(tiers))
        while time.time() + args.max_down + args.hold < until:
            tier = tiers[(first + len(events)) % len(tiers)]  # every tier in turn, at random moments
            killed = time.time()
            runner.kill(tier)
            time.sleep(rng.uniform(args.min_down, args.max_down))
            restarted = time.time()
            runner.start(tier)
            ready = time.time()
            events.append({"tier": tier, "killed": killed, "restart": restarted, "ready": ready})
            time.sleep(rng.uniform(args.hold, args.hold * 1.5))
        for pipe in pipes:
            expect(pipe, "done", args.seconds + 120)
        counters = {"before_final_kill": tier_counters(runner, tiers)}
        # Durability: SIGKILL every daemon (NVMe included) and restart; acknowledged pages must all be there.
        runner.kill()
        runner.start()
        final_ready = time.time()
        for pipe in pipes:
            pipe.send({"verify": True})
        results = [expect(pipe, "rank", args.verify_seconds * 3 + 300) for pipe in pipes]
        phases["verify_s"] = round(time.time() - final_ready, 1)
        counters["after_verify"] = tier_counters(runner, tiers)
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        runner.stop()
    summary = summarize(args, tiers, started, events, results, final_ready, work)
    summary.update(phases)
    summary["tier_counters"] = counters
    if summary["lost_pages"]:
        summary["lost_diagnosis"] = diagnose_losses([k for r in results for k in r["lost"]],
                                                    os.path.join(work, "data"), runner.log_path)
    return summary


# What a daemon's stats say about pages that went away, read before the final kill and after the read-back.
COUNTERS = ("pages", "used_bytes", "evictions", "corrupt_removed", "read_errors", "enospc_retries", "checksum_refused",
            "stale_removed", "torn_removed", "temp_removed", "rebuild_files", "open_fds", "fd_limit")


def tier_counters(runner, tiers: List[str]) -> Dict[str, dict]:
    """Each tier's COUNTERS (an empty map for a tier that did not answer)."""
    from tiers.wire.client import Deadlines, TierClient
    out = {}
    for name in tiers:
        client = TierClient(name, runner.config.tier(name).endpoint, "_admin", "chaos", Deadlines(base=5.0))
        try:
            stats = client.stats() or {}
        finally:
            client.close()
        out[name] = {k: stats[k] for k in COUNTERS if k in stats}
    return out


def diagnose_losses(lost: List[str], data_dir: str, daemon_log: str) -> dict:
    """Where lost pages went, read once every daemon has stopped: is each on disk, whole (its header
    verifies), and what did the daemons warn about."""
    from tiers.stores.nvme import batch, chunkfile as cf
    wanted = set(lost)
    on_disk: Dict[str, List[str]] = {}
    for top, _dirs, files in os.walk(data_dir):
        for name in files:
            path = os.path.join(top, name)
            try:
                if batch.TOP in path.split(os.sep) and batch.parse_name(name) is not None:
                    found = [hdr for _block, hdr in batch.records_of(path)]
                else:
                    found = [cf.read_header(path, None)]
            except (OSError, cf.CorruptChunk, ValueError):
                continue
            for hdr in found:
                if hdr.key in wanted:
                    on_disk.setdefault(hdr.key, []).append(os.path.relpath(path, data_dir))
    try:
        with open(daemon_log, errors="replace") as fh:
            lines = [line.strip() for line in fh if "WARNING" in line or "ERROR" in line]
    except OSError:
        lines = []
    warnings: Dict[str, int] = {}  # each message once (its timestamp cut off), with how often it came
    for line in lines:
        text = line.split(" ", 2)[-1]
        warnings[text] = warnings.get(text, 0) + 1
    return {"lost_on_disk": len(on_disk), "lost_not_on_disk": len(wanted) - len(on_disk),
            "files_of_lost_on_disk": sorted({p for paths in on_disk.values() for p in paths})[:10],
            "daemon_warnings": [f"{n}x {text}" for text, n in list(warnings.items())[-30:]]}


def expect(pipe, field: str, timeout: float) -> dict:
    end = time.time() + timeout
    while pipe.poll(max(0.0, end - time.time())):
        try:
            msg = pipe.recv()
        except EOFError:
            raise RuntimeError(f"a rank exited before saying {field}; see its log") from None
        if field in msg:
            return msg
    raise TimeoutError(f"no {field} from a rank within {timeout}s")


def recovery_times(events: List[dict], results: List[dict]) -> List[Optional[float]]:
    """Per restart: seconds from the daemon answering to the last rank's first fully acknowledged write."""
    out = []
    for i, event in enumerate(events):
        horizon = events[i + 1]["killed"] if i + 1 < len(events) else float("inf")
        worst = 0.0
        for result in results:
            firsts = [end for start, end, kind, ok in result["ops"]
                      if kind == "write" and ok and start >= event["ready"] and end < horizon]
            if not firsts:
                worst = None  # this rank did not complete a write before the next kill (or stopped writing)
                break
            worst = max(worst, min(firsts) - event["ready"])
        out.append(worst)
    return out


def latencies(results: List[dict]) -> dict:
    """Per kind of operation: p50, p99 and max milliseconds."""
    out = {}
    for kind in ("write", "read"):
        times = sorted((end - start) * 1000 for r in results for start, end, k, _ok in r["ops"] if k == kind)
        if times:
            out[kind] = {"p50": round(times[len(times) // 2], 1), "p99": round(times[int(len(times) * 0.99)], 1),
                         "max": round(times[-1], 1)}
    return out


def throughput(results: List[dict], started: float, seconds: float, bucket: float = 1.0, ok: bool = True) -> List[int]:
    """Operations completed (ok) or failed per bucket of seconds."""
    n = int(seconds / bucket) + 1
    counts = [0] * n
    for result in results:
        for start, end, kind, success in result["ops"]:
            if success == ok:
                i = int((end - started) / bucket)
                if 0 <= i < n:
                    counts[i] += 1
    return counts


def summarize(args, tiers, started, events, results, final_ready, work) -> dict:
    recoveries = recovery_times(events, results)
    measured = [r for r in recoveries if r is not None]
    summary = {
        "tiers": tiers, "ranks": args.ranks, "seconds": args.seconds, "seed": args.seed, "workdir": work,
        "kills": len(events), "kills_by_tier": {t: sum(e["tier"] == t for e in events) for t in tiers},
        "restart_to_ready_s": [round(e["ready"] - e["restart"], 3) for e in events],
        "recovery_s": [None if r is None else round(r, 3) for r in recoveries],
        "recovery_max_s": round(max(measured), 3) if measured else None,
        "recovery_limit_s": RECOVERY_LIMIT_S,
        "wrong_pages": sum(len(r["wrong"]) + len(r["verify_wrong"]) for r in results),
        "exceptions": [e for r in results for e in r["exceptions"]],
        "writes": sum(r["stats"]["writes"] for r in results),
        "reads": sum(r["stats"]["reads"] for r in results),
        "pages_read": sum(r["stats"]["pages_read"] for r in results),
        "acked_pages": sum(r["acked_pages"] for r in results),
        "lost_pages": sum(len(r["lost"]) for r in results),
        "lost_examples": [k for r in results for k in r["lost"]][:5],
        "ops_per_second": throughput(results, started, args.seconds),
        "op_latency_ms": latencies(results),
        "failed_ops_per_second": throughput(results, started, args.seconds, ok=False),
    }
    durable = "nvme" in tiers
    summary["durable"] = durable
    summary["ok"] = (summary["wrong_pages"] == 0 and not summary["exceptions"]
                     and (not measured or summary["recovery_max_s"] <= RECOVERY_LIMIT_S)
                     and (not durable or summary["lost_pages"] == 0) and summary["acked_pages"] > 0)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="length of the chaos phase (default 90)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tiers", default="dram,nvme", help="tier chain, fastest first (default dram,nvme)")
    parser.add_argument("--nvme-capacity", default="2GiB")
    parser.add_argument("--max-pages", type=int, default=4000, help="new pages a rank writes at most (then it rewrites its own; keeps NVMe from evicting)")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a restarted daemon stays up before the next kill")
    parser.add_argument("--min-down", type=float, default=0.1)
    parser.add_argument("--max-down", type=float, default=1.0)
    parser.add_argument("--verify-seconds", type=float, default=20.0, help="how long the final read-back may retry")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", help="daemon sockets, data and logs (default: a fresh temp dir)")
    parser.add_argument("--json", metavar="FILE", help="write the summary here")
    args = parser.parse_args(argv)
    summary = run(args)
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    brief = {k: v for k, v in summary.items() if k not in ("ops_per_second",)}
    print(json.dumps(brief, indent=1))
    print("ok" if summary["ok"] else "FAILED")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
