#!/usr/bin/env python3
"""Promotion on the n-th read from below, on real traces: promote_min_reads 1 against 2 (or any values).

The trace simulator (tiers/sim) runs each trace through a node of DRAM over
NVMe for every DRAM size and every promote_min_reads value, and prints the
promotions made, the DRAM tier's hits, the storage hit rate and TTFT, so the
backend's promote_min_reads can be judged on a workload before it is set.

    python3 scripts/promote_admission.py ../shared/data/traces/conversation_trace.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _floats(text: str):
    return [float(x) for x in text.split(",") if x]


def _ints(text: str):
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Mooncake JSONL traces, each run on its own")
    p.add_argument("--dram-gb", type=_floats, default=[20.0, 100.0], metavar="GB,...",
                   help="DRAM tier sizes (default: 20,100)")
    p.add_argument("--nvme-gb", type=float, default=4000.0, help="NVMe tier size (default: 4000)")
    p.add_argument("--device-gb", type=float, default=5.0, help="the GPU's KV pool (default: 5)")
    p.add_argument("--min-reads", type=_ints, default=[1, 2], metavar="N,...",
                   help="promote_min_reads values to compare (default: 1,2)")
    p.add_argument("--write-policy", default="write_back", choices=("write_through", "write_back", "selective"),
                   help="the backend's write policy across the tiers (default: write_back)")
    p.add_argument("--bench", default="docs/bench.json", help="bench figures for the time model (default: %(default)s)")
    args = p.parse_args(argv)
    from tiers.sim import plan
    try:
        bench = plan.load_bench(args.bench)
    except (OSError, ValueError) as exc:
        print(f"promote_admission: cannot read {args.bench}: {exc}", file=sys.stderr)
        return 2
    print("| trace | DRAM GB | promote_min_reads | promotions | not promoted | DRAM tier hits | NVMe tier hits | "
          "storage hit rate | TTFT mean ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.traces:
        try:
            trace = plan.load_trace([path])
        except (OSError, ValueError) as exc:
            print(f"promote_admission: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        for dram_gb in args.dram_gb:
            for min_reads in args.min_reads:
                setup = plan.Setup(bench=bench, tier_write_policy=args.write_policy, promote_min_reads=min_reads,
                                   device_gb=args.device_gb)
                row, result = plan.run_point(trace, setup, plan.Point(dram_gb=dram_gb, nvme_gb=args.nvme_gb))
                l3 = result.counters["l3"]
                hits = {t["kind"]: t["hits"] for t in l3["tiers"]}
                print(f"| {os.path.basename(path)} | {dram_gb:g} | {min_reads} | {l3['promoted']:,} | "
                      f"{l3['not_promoted']:,} | {hits.get('dram', 0):,} | {hits.get('nvme', 0):,} | "
                      f"{row['storage_hit_rate']:.4f} | {row['ttft_mean_s'] * 1e3:.1f} | {row['ttft_p90_s'] * 1e3:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
