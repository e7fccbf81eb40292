"""The ``plan`` sub-command: from a trace and a bench file to tier sizes, TTFT and the SGLang settings that matter."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from tiers.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, output_file, positive_int

PLAN_HELP = """\
Simulate the whole hierarchy for a trace: SGLang's GPU (L1) and host (L2) pools
with its radix-tree eviction, write policy and prefetch rules, in front of the
node's tiers (DRAM, NVMe, remote) run by the daemons' own policy classes.
Every point of the capacity grid gives hit tokens per level and per-request
TTFT = (admission - arrival) + max((L2+L3 tokens) x host-to-GPU, computed x W,
computed x T), with the tiers' read and write speeds and lookup latency taken
from a `hicache-tiers bench --json` file of the target machine and T from the
model and GPU presets. The table marks three Pareto fronts: cost against mean
TTFT (m), p90 TTFT (p) and hit rate (h); the settings table changes one SGLang setting at
a time at one point (default: the fastest point with tiers) and says where L3
hits were lost (below_threshold, cut_short, host_full, anchor_not_backed,
rate_limited, ...). --profile takes a real server's measured profile (from
`hicache-tiers bench --only ttft --ttft-profile FILE`) instead of the model
and GPU presets; --check-profile predicts every case it measured with this
formula and prints predicted against measured. See docs/EXPERIMENTS.md.
"""


def _floats(text: str) -> list:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers of GB") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers >= 0")
    return values


def _costs(text: str) -> dict:
    from tiers.sim.plan import DEFAULT_COSTS, TIER_KINDS
    costs = dict(DEFAULT_COSTS)
    for part in [p for p in text.split(",") if p.strip()]:
        kind, _, value = part.partition("=")
        kind = kind.strip()
        if kind not in TIER_KINDS:
            raise argparse.ArgumentTypeError(f"{part!r}: the kind must be one of {', '.join(TIER_KINDS)}")
        try:
            costs[kind] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected KIND=DOLLARS_PER_GB") from None
    return costs


def _point(text: str):
    from tiers.sim.plan import Point
    values = _floats(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected DRAM_GB,NVME_GB,REMOTE_GB")
    return Point(*values)


def _one_policy(text: str) -> str:
    """A policy name, or FILE.py:Class made absolute (worker processes and daemons run elsewhere)."""
    from tiers.plugins import PluginError, absolute_policy, policy_class
    text = absolute_policy(text)
    try:
        policy_class(text)
    except PluginError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _policy(text: str) -> tuple:
    """POLICY for every tier, or KIND=POLICY,... per tier kind (the others: lru): (default, overrides)."""
    from tiers.sim.plan import TIER_KINDS
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.partition("=")[0] in TIER_KINDS and "=" in p for p in parts):
        return _one_policy(text), ()
    return "lru", tuple((p.partition("=")[0], _one_policy(p.partition("=")[2])) for p in parts)


def register(subparsers) -> None:
    from tiers.sim.hierarchy import PREFETCH_POLICIES
    from tiers.sim.node_tiers import ROUTER_WRITE_POLICIES
    from tiers.sim.prefill import PRESETS
    from tiers.sim.radix_tree import WRITE_POLICIES
    from tiers.sim.timing import GPU_PRESETS
    p = subparsers.add_parser("plan", help="size the node's tiers for a trace: Pareto front of cost and TTFT",
                              description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", metavar="TRACE",
                   help="Mooncake JSONL trace file(s) (none with --check-profile)")
    p.add_argument("--bench", required=True, metavar="FILE",
                   help="hicache-tiers bench --json file of the target machine (tier speeds, lookup latency)")
    p.add_argument("--cost", type=_costs, default=_costs(""), metavar="KIND=$/GB,...",
                   help="dollars per GB of each tier kind (default: dram=3,nvme=0.08,remote=4)")
    p.add_argument("--dram-gb", type=_floats, default=[0, 256, 1024, 2048, 4096], metavar="GB,...",
                   help="DRAM tier capacities to try (default: 0,256,1024,2048,4096)")
    p.add_argument("--nvme-gb", type=_floats, default=[0, 16000], metavar="GB,...",
                   help="NVMe tier capacities to try (default: 0,16000)")
    p.add_argument("--remote-gb", type=_floats, default=[0], metavar="GB,...",
                   help="remote pool capacities to try (default: 0)")
    p.add_argument("--policy", type=_policy, default=("lru", ()), metavar="POLICY | KIND=POLICY,...",
                   help="the tiers' eviction policy, an installed name or FILE.py:Class; or one per tier kind, "
                        "e.g. dram=s3fifo,nvme=lru (unnamed kinds: lru; default: lru)")
    p.add_argument("--tier-write-policy", choices=ROUTER_WRITE_POLICIES, default="write_back",
                   help="the backend's write policy across the tiers (default: %(default)s)")
    p.add_argument("--no-promote", action="store_true", help="do not copy pages read from a lower tier to the top")
    p.add_argument("--promote-min-reads", type=positive_int, default=2, metavar="N",
                   help="reads of a page from a lower tier before it is copied to the top, as the backend's "
                        "promote_min_reads (default: %(default)s; 1: on every read)")
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-3-8b", help="model preset (default: %(default)s)")
    p.add_argument("--gpu", choices=sorted(GPU_PRESETS), default="h100-sxm",
                   help="GPU preset: dense BF16 TFLOPs and host-to-GPU GB/s with sources (default: %(default)s)")
    p.add_argument("--gpus", type=positive_int, default=1,
                   help="GPUs of the engine (tensor parallel): T and host-to-GPU time divide by it (default: %(default)s)")
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of the GPU peak prefill reaches (default: %(default)s)")
    p.add_argument("--compute-us-per-token", type=float, default=None, metavar="US",
                   help="a measured prefill time per token T, instead of the GPU preset's")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="a measured engine (hicache-tiers bench --only ttft --ttft-profile FILE): its KV shape, "
                        "page size and fitted prefill, per-cached-token and host-to-GPU costs replace --model, "
                        "--gpu, --gpus and --mfu")
    p.add_argument("--check-profile", action="store_true",
                   help="predict every case --profile measured (recompute, device, host and L3 hits per prompt "
                        "length; L3 reads at the --bench file's tier speeds) with the TTFT formula; print "
                        "predicted against measured (with the fastest and slowest repetition, and which off cases are "
                        "predicted between them), exit 1 when one is off by more than 15%%; no trace needed")
    p.add_argument("--device-gb", type=float, default=40.0, help="the GPU's KV pool, GB (default: %(default)s)")
    p.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="SGLang's host pool over device pool (default: %(default)s, SGLang's)")
    p.add_argument("--hicache-size", type=float, default=None, metavar="GB",
                   help="SGLang's host pool in GB (overrides --hicache-ratio)")
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through",
                   help="SGLang's --hicache-write-policy (default: %(default)s)")
    p.add_argument("--page-size", type=positive_int, default=None,
                   help="SGLang's page size, tokens (default: the profile's, else 64)")
    p.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout",
                   help="SGLang's --hicache-storage-prefetch-policy (default: %(default)s)")
    p.add_argument("--prefetch-threshold", type=int, default=256,
                   help="SGLang's prefetch_threshold, tokens (default: %(default)s)")
    p.add_argument("--prefetch-timeout-base", type=float, default=1.0, help="seconds (default: %(default)s)")
    p.add_argument("--prefetch-timeout-per-ki-token", type=float, default=0.25, help="seconds (default: %(default)s)")
    p.add_argument("--scheduler-step-ms", type=float, default=0.0,
                   help="from a request's arrival to the scheduler's first admission poll (default: %(default)s)")
    p.add_argument("--queue", action="store_true", help="one FCFS GPU: requests wait for the previous prefill")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival times (with --queue: >1 lowers the load; default: %(default)s)")
    p.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per hash block (default: %(default)s)")
    p.add_argument("--settings-at", type=_point, default=None, metavar="DRAM,NVME,REMOTE",
                   help="where the settings table is run (default: the lowest mean TTFT of a point with tiers)")
    p.add_argument("--no-settings", action="store_true", help="skip the table of SGLang settings")
    p.add_argument("--live", action="store_true",
                   help="make the settings point's L3 calls against a fresh one-tier DRAM daemon and compare "
                        "(its node must be one DRAM tier)")
    p.add_argument("--parallel", type=positive_int, default=None, metavar="N",
                   help="points simulated at once (default: CPU count, at most 8)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write points, settings and checks as JSON")
    p.add_argument("--csv", metavar="FILE", type=output_file, help="write the grid's rows as CSV")
    p.add_argument("--requests", metavar="FILE", type=output_file,
                   help="write per-request tokens by level and TTFT at the settings point as CSV")
    p.add_argument("--plot", metavar="FILE.png", type=output_file, help="plot the front and the hit rates")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)


def _setup(args, bench, profile=None):
    from tiers.sim.hierarchy import SGLangFlags
    from tiers.sim.plan import Setup
    page_size = args.page_size or (profile.page_tokens if profile is not None else 64)
    flags = SGLangFlags(write_policy=args.write_policy, page_size=page_size,
                        prefetch_threshold=args.prefetch_threshold, prefetch_policy=args.prefetch_policy,
                        prefetch_timeout_base=args.prefetch_timeout_base,
                        prefetch_timeout_per_ki_token=args.prefetch_timeout_per_ki_token,
                        scheduler_step_s=args.scheduler_step_ms / 1000.0)
    return Setup(bench=bench, model=args.model, gpu=args.gpu, gpus=args.gpus, mfu=args.mfu,
                 compute_s=args.compute_us_per_token * 1e-6 if args.compute_us_per_token else None,
                 device_gb=args.device_gb, hicache_ratio=args.hicache_ratio, host_gb=args.hicache_size,
                 flags=flags, tier_policy=args.policy[0], tier_policies=args.policy[1],
                 tier_write_policy=args.tier_write_policy, promote=not args.no_promote,
                 promote_min_reads=args.promote_min_reads, queue=args.queue,
                 time_scale=args.time_scale, costs=args.cost, profile=profile)


def _check_profile(args, bench, profile) -> int:
    """--check-profile: the profile's measured cases against the planner's TTFT formula."""
    from tiers.sim import profile_check
    rows = profile_check.check(profile, bench)
    print(f"{args.profile}: {profile.source or 'no source'}")
    print(profile_check.fit_summary(profile))
    print(f"tier speeds and lookups from {args.bench} ({bench.meta.get('date', 'undated')})\n")
    print(profile_check.table(rows))
    off = [r for r in rows if not r.holds]
    print(f"\n{profile_check.summary(rows)}")
    return EXIT_FAILED if off else EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tiers.sim import plan, plan_report
    from tiers.sim.profile import Profile, ProfileError
    from tiers.sim.timing import BenchError
    if args.check_profile and not args.profile:
        print("plan: --check-profile needs --profile FILE", file=sys.stderr)
        return EXIT_USAGE
    if not args.traces and not args.check_profile:
        print("plan: give at least one TRACE (or --profile FILE --check-profile)", file=sys.stderr)
        return EXIT_USAGE
    try:
        bench = plan.load_bench(args.bench)
        profile = Profile.load(args.profile) if args.profile else None
        if args.check_profile:
            return _check_profile(args, bench, profile)
        trace = plan.load_trace(args.traces, block_tokens=args.block_tokens)
        setup = _setup(args, bench, profile)
        used = [1 if any(gb > 0 for gb in gbs) else 0 for gbs in (args.dram_gb, args.nvme_gb, args.remote_gb)]
        setup.time(setup.node(plan.Point(*used), trace.block_tokens))  # every figure the grid needs
        setup.engine()
    except OSError as exc:
        print(f"plan: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except (BenchError, ProfileError, ValueError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    points = plan.grid(args.dram_gb, args.nvme_gb, args.remote_gb)
    parallel = args.parallel or plan.default_parallel()
    engine = (f"the engine of {args.profile}" if profile is not None else f"{args.model} on {args.gpus} x {args.gpu}")
    print(f"{trace.n_requests:,} requests, {int(trace.input_lengths.sum()):,} tokens; {len(points)} points; "
          f"{engine} ({setup.shape.kv_bytes_per_token / 1024:g} KiB of KV a token); "
          f"tier speeds from {args.bench} ({bench.meta.get('date', 'undated')})")
    with tqdm(total=len(points), unit="point", disable=args.quiet or None, file=sys.stderr) as bar:
        rows = plan.sweep(trace, setup, points, parallel=parallel, progress=bar.update)
    print(plan_report.grid_table(rows))
    chosen = args.settings_at
    if chosen is None:
        # the fastest point that has tiers (a table of SGLang's L3 settings without an L3 says nothing)
        best = min([r for r in rows if r["cost"] > 0] or rows, key=lambda r: (r["ttft_mean_s"], r["cost"]))
        chosen = plan.Point(best["dram_gb"], best["nvme_gb"], best["remote_gb"])
    settings, extra = [], {}
    if not args.no_settings:
        with tqdm(total=1 + sum(len(v) for v in plan.SETTING_VALUES.values()), unit="run",
                  disable=args.quiet or None, file=sys.stderr) as bar:
            settings = plan.settings_rows(trace, setup, chosen, parallel=parallel, progress=bar.update)
        print(f"\nSGLang settings at DRAM {chosen.dram_gb:,.0f} GB, NVMe {chosen.nvme_gb:,.0f} GB, "
              f"remote {chosen.remote_gb:,.0f} GB (one changed at a time; d = against the base):")
        print(plan_report.settings_table(settings))
    if args.live or args.requests:
        status = _point_outputs(args, trace, setup, chosen, extra)
        if status != EXIT_OK:
            return status
    meta = {"command": " ".join(sys.argv), "traces": args.traces, "bench": args.bench,
            "bench_date": bench.meta.get("date"), "profile": args.profile, "setup": _setup_fields(setup),
            "time_model": _time_figures(setup.time(setup.node(chosen, trace.block_tokens)))}
    if args.json:
        plan_report.write_json(args.json, meta, rows, settings, extra)
        print(f"wrote {args.json}")
    if args.csv:
        from tiers.sim.report import write_dict_csv
        write_dict_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    if args.plot:
        names = ", ".join(os.path.basename(n) for n in args.traces)
        plan_report.plot(args.plot, rows, f"{names}: {args.model} on {args.gpu}, tiers from {args.bench}")
        print(f"wrote {args.plot}")
    return EXIT_FAILED if extra.get("live", {}).get("matches") is False else EXIT_OK


def _setup_fields(setup) -> dict:
    """The setup as plain values (flags flattened beside the rest; no bench object)."""
    fields = {k: v for k, v in vars(replace(setup, bench=None, profile=None)).items()
              if k not in ("bench", "flags", "profile")}
    return {**fields, **vars(setup.flags)}


def _time_figures(time) -> dict:
    """The per-token figures the simulation used (microseconds), and where T comes from."""
    return {"compute_us_per_token": time.compute_s * 1e6, "host_to_gpu_us_per_token": time.h2d_s * 1e6,
            "tier_read_us_per_token": [t * 1e6 for t in time.tier_read_s], "write_us_per_token": time.write_s * 1e6,
            "lookup_128_us": time.lookup_s(128) * 1e6, "overhead_ms_per_request": time.overhead_s * 1e3,
            "compute_ns_per_token_squared": time.compute_s2 * 1e9, "cached_us_per_token": time.cached_s * 1e6,
            "load_added_to_compute": time.serial_load, "prefetch_ms_per_query": time.prefetch_s * 1e3,
            "source": time.source}


def _point_outputs(args, trace, setup, point, extra: dict) -> int:
    """--requests and --live at one point."""
    from tiers.sim import plan
    from tiers.sim.report import write_dict_csv
    node = setup.node(point, trace.block_tokens)
    if args.live and [s.kind for s in node.tiers] != ["dram"]:
        print("plan: --live needs the settings point to be one DRAM tier (use --settings-at DRAM,0,0)",
              file=sys.stderr)
        return EXIT_USAGE
    row, result = plan.run_point(trace, setup, point, record_ops=args.live)
    if args.requests:
        write_dict_csv(args.requests, result.request_rows())
        print(f"wrote {args.requests}")
    if args.live:
        from tqdm import tqdm

        from tiers.plugins import PluginError, lab
        from tiers.sim.sweep import run_sweep
        from tiers.sim.capacity import Capacity
        try:
            live_ops = lab("live_ops")
        except PluginError as exc:
            print(f"plan: --live: {exc}", file=sys.stderr)
            return EXIT_USAGE
        blocks = node.tiers[0].blocks
        with tqdm(total=len(result.ops), unit="call", disable=args.quiet or None, file=sys.stderr) as bar:
            check = live_ops.check_against_dram_node(result.ops, setup.policy_of("dram"), blocks, progress=bar.update)
        alone = run_sweep(trace, [setup.policy_of("dram")], [Capacity(f"{blocks}b", blocks)])[0]
        sim_l3 = result.counters["l3"]["tiers"][0]
        extra["live"] = {"matches": check.matches and check.daemon == {k: sim_l3[k] for k in check.daemon},
                         "lookups": check.lookups, "mismatches": check.mismatches,
                         "sim_hit_blocks": check.sim_hit_blocks, "live_hit_blocks": check.live_hit_blocks,
                         "daemon": check.daemon, "simulated": {k: sim_l3[k] for k in ("hits", "inserts", "evictions")},
                         "seconds": check.seconds, "storage_hit_rate": row["storage_hit_rate"],
                         "l3_alone_token_hit_rate": alone.token_hit_rate, "first_mismatch": check.first_mismatch}
        live = extra["live"]
        print(f"\nlive check ({setup.policy_of('dram')}, {blocks:,} blocks of DRAM): {live['lookups']:,} storage hit "
              f"queries, {live['mismatches']} answered differently; hit blocks simulated {live['sim_hit_blocks']:,}, "
              f"live {live['live_hit_blocks']:,}; daemon hits/inserts/evictions {check.daemon} against simulated "
              f"{live['simulated']}; {check.seconds:.0f} s")
        print(f"L3 token hit rate behind L1/L2: {row['storage_hit_rate']:.4f}; the same tier alone "
              f"(replay, = replay --live): {alone.token_hit_rate:.4f}")
    return EXIT_OK
