"""1, 2, 4, 8 and 16 concurrent rank processes on one DRAM tier: aggregate GB/s and lookups under writes.

Each rank is its own process (``python -m hicache_ext.lab.bench.ranks``) with its
own host pool and backend (TP rank i of N, so its own namespace).  The parent
releases every rank at once for each step and takes the slowest rank's time.
A third step has rank 0 look its 128 keys up again and again while every
other rank writes: the lookup latency a prefetch sees on a busy node.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from hicache_ext.lab.bench.rig import MiB, Node, node_toml, tier_toml
from tiers.bench.stats import Figures, Progress, gbps

RANK_COUNTS = (1, 2, 4, 8, 16)
PAGE_BYTES = 4 * MiB
LOOKUP_KEYS, LOOKUP_CALLS = 128, 400


def run_ranks(figs: Figures, args, progress: Progress) -> None:
    pages = max(4, args.pages // 4)  # per rank: 4 ranks of 4 MiB pages hold as much as one 128-page batch
    batch = pages * PAGE_BYTES
    counts = [n for n in RANK_COUNTS if n <= (4 if args.quick else max(RANK_COUNTS))]
    node = Node(os.path.join(args.work_dir, "ranks"),
                node_toml([tier_toml("dram", max(counts) * batch, PAGE_BYTES)]))
    try:
        for n in counts:
            progress.step(f"ranks: starting {n} rank process(es)")
            spec = {"runtime_dir": node.runner.runtime_dir, "config": node.runner.config_path, "pages": pages,
                    "tp_size": n}
            logs = [os.path.join(args.work_dir, f"rank{n}-{i}.log") for i in range(n)]
            procs = [subprocess.Popen([sys.executable, "-m", "hicache_ext.lab.bench.ranks", json.dumps({**spec, "tp_rank": i})],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      stderr=open(log, "wb")) for i, log in enumerate(logs)]
            try:
                for p, log in zip(procs, logs):
                    line = p.stdout.readline().strip()
                    if line != "ready":
                        tail = open(log, errors="replace").read().strip().splitlines()[-1:]
                        raise RuntimeError(f"rank process {p.pid} did not start ({line!r}): {tail}")
                for rep in range(args.repeat):
                    progress.step(f"ranks: {n} rank(s), repetition {rep + 1}/{args.repeat}")
                    for step in ("write", "read", "lookup"):
                        # lookup: rank 0 looks up while the others write (alone, it looks up on an idle node)
                        for i, p in enumerate(procs):
                            p.stdin.write((step if step != "lookup" or i == 0 else "write") + "\n")
                            p.stdin.flush()
                        answers = [json.loads(p.stdout.readline()) for p in procs]
                        if not all(a["ok"] for a in answers):
                            figs.failures.append(f"ranks.{n}.{step}: {[a for a in answers if not a['ok']]}")
                            continue
                        if step == "lookup":
                            figs.add(f"ranks.{n}.lookup{LOOKUP_KEYS}.p50", answers[0]["p50_us"], "us")
                            figs.add(f"ranks.{n}.lookup{LOOKUP_KEYS}.p99", answers[0]["p99_us"], "us")
                        else:
                            figs.add(f"ranks.{n}.{step}", gbps(n * batch, max(a["seconds"] for a in answers)))
            finally:
                for p in procs:
                    try:
                        p.stdin.write("quit\n")
                        p.stdin.flush()
                    except OSError:
                        pass
                for p in procs:
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    finally:
        node.close()


def _worker(spec: dict) -> int:
    """One rank: set up, say ready, then time each step the parent asks for."""
    import time
    from types import SimpleNamespace

    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    from hicache_ext.lab.bench.rig import Rank
    node = SimpleNamespace(runner=SimpleNamespace(runtime_dir=spec["runtime_dir"], config_path=spec["config"]))
    # SGLang refuses a host pool unless 10 GiB of host RAM stay free beyond it, sampled when the pool is
    # built; 16 of these processes (torch and sglang loaded in each) leave less than that on a 24 GiB
    # machine although each pool is 128 MiB.  SGLang's launcher books pools against one budget with this
    # scope; each rank is given its own pool's size (the parent sized the node for all of them).
    with host_memory_budget_scope(2 * spec["pages"] * PAGE_BYTES):
        rank = Rank.tiered(node, PAGE_BYTES, spec["pages"], tp_rank=spec["tp_rank"], tp_size=spec["tp_size"])
    rank.write(rank.keys(99))
    rank.clear()
    print("ready", flush=True)
    rep = 0
    keys = None
    for line in sys.stdin:
        step = line.strip()
        if step == "quit":
            break
        if step == "lookup":
            print(json.dumps(_lookups(rank, keys)), flush=True)
            continue
        if step == "write":
            rep += 1
            rank.clear()
            keys = rank.keys(7000 + rep)
            start = time.perf_counter()
            ok = rank.write(keys) == rank.pages
        else:
            rank.zero()
            start = time.perf_counter()
            ok = rank.read(keys) == rank.pages
        seconds = time.perf_counter() - start
        if ok and step == "read":
            ok = rank.wrong_pages(rank.pages) == 0
        print(json.dumps({"ok": ok, "seconds": seconds}), flush=True)
    # The node is sized for one round's ranks: pages left by this round's namespaces (tp{rank}-{size})
    # would crowd out the next round's, whose ranks then evict each other's batches.
    rank.clear()
    rank.close()
    return 0


def _lookups(rank, keys) -> dict:
    """p50/p99 of LOOKUP_CALLS lookups of this rank's first LOOKUP_KEYS keys (written in the write step)."""
    import time
    from tiers.bench.stats import percentile
    batch = (keys * (LOOKUP_KEYS // len(keys) + 1))[:LOOKUP_KEYS]  # ranks with fewer pages repeat their keys
    samples = []
    for _ in range(LOOKUP_CALLS):
        start = time.perf_counter()
        hits = rank.backend.batch_exists(batch)
        samples.append(time.perf_counter() - start)
        if hits != len(batch):
            return {"ok": False, "why": f"{hits} of {len(batch)} keys found"}
    return {"ok": True, "p50_us": percentile(samples, 50) * 1e6, "p99_us": percentile(samples, 99) * 1e6}


if __name__ == "__main__":
    sys.exit(_worker(json.loads(sys.argv[1])))
