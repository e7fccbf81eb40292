"""An engine process of a cluster rehearsal: the real backend on a real SGLang host pool, in a node.

The parent (hicache_ext/lab/cluster/rehearsal.py) starts it inside a node's
network namespace and sends one JSON request a line on stdin; it answers one
JSON line on stdout.  Pages are written and read with SGLang's own controller
page functions (``PageDriver``), as the tests and the benchmark do, and their
xxh3 checksums come back so the parent can compare what one node wrote with
what another read.

Requests: ``{"op": "write", "salt": S, "seed": K}`` (fill the pages from seed
K, back them up under keys of salt S), ``{"op": "read", "salt": S}`` (zero the
pages, prefetch them), ``{"op": "lookup", "salt": S}``, ``{"op": "quit"}``.
Each answer carries ``seconds``, the time of the backend call.
"""
from __future__ import annotations

import json
import sys
import time


def _serve(spec: dict) -> int:
    from hicache_ext.lab.bench.rig import Rank
    from hicache_ext.lab.sglang_harness import fill_pages, page_checksums, zero_pages

    extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
             "interface_v1": 1, "runtime_dir": spec["runtime_dir"], "tiers_config": spec["config"],
             **spec.get("extra", {})}
    rank = Rank("dynamic", spec["page_bytes"], spec["pages"], extra, model=spec.get("model", "rehearsal"))
    print(json.dumps({"ready": True, "namespace": rank.backend.namespace}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            print(json.dumps({"error": "not JSON"}), flush=True)
            continue
        op = req.get("op")
        if op == "quit":
            break
        keys = rank.keys(int(req.get("salt", 0)))
        start = time.perf_counter()
        if op == "write":
            fill_pages(rank.pool, rank.indices, seed=int(req.get("seed", 0)))
            sums = page_checksums(rank.pool, rank.indices)
            start = time.perf_counter()
            done = rank.write(keys)
            answer = {"written": done, "sums": sums}
        elif op == "read":
            zero_pages(rank.pool, rank.indices)
            start = time.perf_counter()
            done = rank.read(keys)
            answer = {"read": done, "sums": page_checksums(rank.pool, rank.indices)[:done]}
        elif op == "lookup":
            answer = {"hits": rank.driver.exists(keys)}
        else:
            print(json.dumps({"error": f"unknown op {op!r}"}), flush=True)
            continue
        answer["seconds"] = time.perf_counter() - start
        print(json.dumps(answer), flush=True)
    rank.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(json.loads(sys.argv[1])))
