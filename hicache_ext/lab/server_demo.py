"""``hicache-tiers demo --server``: a real SGLang server on this machine, serving from the node's tiers.

Starts the node's daemons, writes a small random Llama, launches
``python -m sglang.launch_server`` with ``hicache-tiers sglang-args``' flags
(on CPU when there is no GPU), and sends a shared-prefix workload in three
rounds: cold (the first request computes, the others hit the device cache),
after ``/flush_cache`` (the first request's prefix comes from L3, the top
tier; the others find it on the device again), and after the top tier
restarted empty (from the tier below).  Each request
prints where SGLang says its cached tokens came from and its TTFT; each tier
prints its hits.  Every round must generate the same tokens as the cold one.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from hicache_ext.lab.server import (ModelSpec, SGLangServer, ServerError, ServerOptions,
                                    random_llama, shared_prefix_prompts)
from tiers.ops.node_runner import NodeRunner
from tiers.wire.client import TierClient


# The embedded default's chain (DRAM in front of NVMe, write_back), sized for a demo beside a server
# on a small machine: SGLang keeps 10 GiB of host memory free for itself and refuses to start otherwise.
DEMO_NODE_TOML = """\
# hicache-tiers demo --server: DRAM in front of NVMe, write_back, small
[node]
write_policy = "write_back"

[[tiers]]
name = "dram"
kind = "dram"
capacity = "512MiB"

[[tiers]]
name = "nvme"
kind = "nvme"
capacity = "4GiB"
staging_bytes = "256MiB"
"""


def tier_stats(runner: NodeRunner) -> Dict[str, dict]:
    """Each tier daemon's stats, through an admin-free session of its own."""
    out = {}
    for tier in runner.config.tiers:
        client = TierClient(tier.name, tier.endpoint, "_demo", curve=tier.curve)
        try:
            out[tier.name] = client.stats() or {}
        finally:
            client.close()
    return out


def wait_for_pages(runner: NodeRunner, pages: int, timeout: float = 60.0) -> bool:
    """Until the top tier holds at least pages (SGLang backs pages up to L3 after the request returned)."""
    top = runner.config.tiers[0].name
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tier_stats(runner).get(top, {}).get("pages", 0) >= pages:
            return True
        time.sleep(0.2)
    return False


def run_server_demo(args) -> int:
    temp = tempfile.TemporaryDirectory(prefix="hicache-demo-server-")
    root = Path(temp.name)
    config_text = open(args.config, encoding="utf-8").read() if args.config else DEMO_NODE_TOML
    runner = NodeRunner(config_text, args.runtime_dir or str(root / "run"), args.data_dir or str(root / "data"),
                        config_path=str(root / "node.toml"), log_level="warning")
    spec = ModelSpec(layers=args.model_layers, hidden=args.model_hidden, heads=max(1, args.model_hidden // 64),
                     kv_heads=max(1, args.model_hidden // 128))
    prompt_tokens = args.prefix_tokens + args.suffix_tokens
    options = ServerOptions(model=random_llama(spec, root / "models"), node_config=root / "node.toml",
                            runtime_dir=Path(runner.runtime_dir), device=args.device,
                            max_total_tokens=max(2048, 2 * prompt_tokens))
    server = SGLangServer(options, root / "server.log")
    tiers = [t.name for t in runner.config.tiers]
    try:
        print(f"starting tiers {', '.join(tiers)}; model: random Llama, {spec.layers} layers, hidden {spec.hidden}, "
              f"{spec.kv_bytes_per_token} bytes of KV a token")
        runner.start()
        print(f"starting python -m sglang.launch_server --device {args.device} (a minute on a small CPU) ...")
        server.start()
        prompts = shared_prefix_prompts(args.requests, args.prefix_tokens, args.suffix_tokens, spec.vocab, seed=0)
        rounds = [_round("cold", server, runner, prompts)]
        wait_for_pages(runner, args.prefix_tokens // options.page_size)
        server.flush_cache()
        rounds.append(_round(f"L3 ({tiers[0]})", server, runner, prompts))
        if len(tiers) > 1:
            runner.stop(tiers[0])
            runner.start(tiers[0])  # back empty: the prefix is only below it now
            server.flush_cache()
            rounds.append(_round(f"L3 ({tiers[0]} restarted empty)", server, runner, prompts))
        return _report(rounds, tiers)
    except ServerError as exc:
        print(f"demo --server: {exc}")
        return 1
    finally:
        server.stop()
        runner.stop()
        if os.environ.get("HICACHE_TIERS_KEEP_DEMO"):
            print(f"kept {root}")
        else:
            temp.cleanup()


def _round(name: str, server: SGLangServer, runner: NodeRunner, prompts: List[List[int]]):
    """(name, generations, pages each tier served during the round)."""
    before = {tier: s.get("hits", 0) for tier, s in tier_stats(runner).items()}
    generations = [server.generate(prompt, 4) for prompt in prompts]
    after = {tier: s.get("hits", 0) for tier, s in tier_stats(runner).items()}
    return name, generations, {tier: after[tier] - before.get(tier, 0) for tier in after}


def _report(rounds, tiers: List[str]) -> int:
    print()
    print(f"{'round':34}{'request':>8}{'device':>8}{'host':>8}{'L3':>8}{'TTFT ms':>10}   pages served by each tier")
    for name, generations, served in rounds:
        for i, g in enumerate(generations):
            print(f"{name if i == 0 else '':34}{i + 1:>8}{g.cached['device']:>8}{g.cached['host']:>8}"
                  f"{g.cached['storage']:>8}{g.seconds * 1e3:>10.1f}")
        per_tier = ", ".join(f"{tier} {served.get(tier, 0)}" for tier in tiers)
        print(f"{'':34}{'median':>8}{'':>24}{statistics.median(g.seconds for g in generations) * 1e3:>10.1f}"
              f"   {per_tier}")
    reference = [g.output_ids for g in rounds[0][1]]
    same = all([g.output_ids for g in generations] == reference for _, generations, _ in rounds)
    # After a flush the first request reads the shared prefix from L3; the others find it on the device again.
    from_l3 = all(generations[0].cached["storage"] > 0 for _, generations, _ in rounds[1:])
    print("the same tokens in every round: " + ("yes" if same else "NO"))
    print("the first request after each flush read its prefix from L3: " + ("yes" if from_l3 else "NO"))
    print("demo --server: OK" if same and from_l3 else "demo --server: FAILED (see above)")
    return 0 if same and from_l3 else 1
