"""Scripting the whole-hierarchy simulator: the node's tier policy (a user's own among them) across DRAM sizes.

    python scripts/examples/plan_api.py ../shared/data/traces/conversation_trace.jsonl \
        --bench docs/bench.json --plot policies.png

Every row is a dict (tiers/sim/plan.py); plan.dataframe turns a list of them into a pandas DataFrame.
"""
from __future__ import annotations

import argparse
import os
import sys

from tiers.sim import plan

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = {"lru": "lru", "s3fifo": "s3fifo", "slru (user file)": os.path.join(HERE, "slru_policy.py") + ":SLRUPolicy"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Mooncake JSONL trace")
    parser.add_argument("--bench", default="docs/bench.json", help="hicache-tiers bench --json file (default: %(default)s)")
    parser.add_argument("--dram-gb", default="128,512,2048", help="DRAM tier sizes, GB (default: %(default)s)")
    parser.add_argument("--device-gb", type=float, default=40.0, help="the GPU's KV pool, GB (default: %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (default: %(default)s)")
    parser.add_argument("--plot", help="write storage hit rate and mean TTFT against DRAM size here (PNG)")
    args = parser.parse_args(argv)

    trace = plan.load_trace([args.trace], block_tokens=args.block_tokens)
    bench = plan.load_bench(args.bench)
    sizes = [float(x) for x in args.dram_gb.split(",")]
    rows = []
    for label, policy in POLICIES.items():
        setup = plan.Setup(bench=bench, device_gb=args.device_gb, tier_policy=policy)
        for row in plan.sweep(trace, setup, plan.grid(dram_gb=sizes), parallel=plan.default_parallel()):
            rows.append(dict(row, policy=label))
    table = plan.dataframe(rows)
    for value in ("storage_hit_rate", "ttft_mean_s", "ttft_p90_s"):
        print(f"\n{value}:")
        print(table.pivot(index="dram_gb", columns="policy", values=value).round(4).to_string())
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for label, group in table.groupby("policy"):
            left.plot(group["dram_gb"], group["storage_hit_rate"], "-o", label=label)
            right.plot(group["dram_gb"], group["ttft_mean_s"], "-o", label=label)
        left.set(xlabel="DRAM tier (GB)", ylabel="L3 token hit rate", xscale="log")
        right.set(xlabel="DRAM tier (GB)", ylabel="mean TTFT (s)", xscale="log")
        left.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
