"""The ``replay`` and ``model`` sub-commands: trace-driven hit rates and the prefill model."""
from __future__ import annotations

import argparse
import json
import sys

from tiers.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, output_file, positive_int
from tiers.plugins import POLICY_FILE, PluginError, absolute_policy, policy_class, policy_names
from tiers.sim.capacity import DEFAULT_CAPACITIES, SYNTAX, parse_capacities
from tiers.sim import prefill
from tiers.sim.prefill import PRESETS, ModelShape, PrefillModel


REPLAY_HELP = """\
Replay Mooncake request traces (JSONL: timestamp, input_length, output_length,
hash_ids of prefix blocks) through the daemons' own eviction policies.

Semantics: one shared block cache; requests in timestamp order (several files
are merged by timestamp, hash ids namespaced per file).  A request's hit is the
leading run of its hash_ids present when it arrives.  Then every block of the
request is accessed in order: a hit touches the policy, a miss makes room
(pop_victim while the cache is full) and is inserted with the previous block of
the request as its parent, exactly as tiers/stores/dram.py drives a policy.
Reported: token hit rate = sum(min(hit blocks x block tokens, input_length)) /
sum(input_length); block hit rate = hit blocks / blocks; and the infinite-cache
ceiling.  --flat drops the prefix rule: every access is scored on its own.

Engines: lru uses one pass of LRU stack distances for every capacity; the other
policies run a compiled twin of the policy class (kernels.c, checked access by
access against the class in the tests); --engine policy runs the Python class.

--live replays the same requests through the real backend (built by SGLang's
factory, a 4-byte-page host pool, the controller's page functions) against
tier daemons: --start runs a fresh one-tier DRAM node per policy and capacity
(block size = page size, so capacity in blocks is pages); without --start the
node's running daemons are used (their top tier's policy and capacity).  Hits
must equal the simulation's; every row says whether they do.
"""


def _split(text: str) -> list:
    """Comma-separated words, blanks dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def cmd_replay(args: argparse.Namespace) -> int:
    """Run the sweep and print/write its results."""
    from tiers.sim import kernels, report, sweep
    from tiers.sim.trace import read_traces

    installed = policy_names()
    policies = installed if args.policy == "all" else [p if POLICY_FILE.match(p) else p.lower()
                                                       for p in _split(args.policy)]
    unknown = [p for p in policies if p not in installed and not POLICY_FILE.match(p)]
    if unknown:
        print(f"replay: unknown policy {', '.join(unknown)}; choose from {', '.join(installed)} "
              f"or FILE.py:Class", file=sys.stderr)
        return EXIT_USAGE
    try:  # a user's file: made absolute (the daemons of --live --start run elsewhere) and loaded now
        policies = [absolute_policy(p) for p in policies]
        for p in policies:
            policy_class(p)
    except PluginError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        capacities = parse_capacities(args.capacity, args.block_tokens)
        trace = read_traces(args.traces, block_tokens=args.block_tokens)
    except OSError as exc:
        print(f"replay: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if len(args.traces) > 1:
        print(f"merging {len(args.traces)} traces by timestamp into one cache (hash ids kept apart per file)")
    best = sweep.ceiling(trace, flat=args.flat)
    if args.live:
        return cmd_replay_live(args, trace, policies, capacities, best)
    print(f"{trace.n_requests:,} requests, {trace.n_accesses:,} block accesses, {trace.n_keys:,} unique blocks "
          f"of {trace.block_tokens} tokens; {'flat (no prefix rule)' if args.flat else 'prefix rule'}")
    if args.bench:
        print(report.bench_table(sweep.bench(trace, policies, capacities)))
        return EXIT_OK
    from tqdm import tqdm
    with tqdm(total=trace.n_accesses * len(policies) * len(capacities), unit="acc", unit_scale=True,
              disable=args.quiet or None, leave=False, file=sys.stderr) as bar:
        try:
            rows = sweep.run_sweep(trace, policies, capacities, flat=args.flat, engine=args.engine,
                                   progress=bar.update)
        except kernels.KernelUnavailable as exc:
            print(f"replay: compiled kernels unavailable ({exc}); use --engine auto or policy", file=sys.stderr)
            return EXIT_FAILED
    return _report_rows(args, trace, rows, best, {})


def _report_rows(args: argparse.Namespace, trace, rows, best, extra_meta: dict) -> int:
    """The hit-rate tables on stdout; JSON, CSV and plot when asked."""
    from tiers.sim import report
    print(report.hit_rate_table(rows, best, "token_hit_rate"))
    print(report.hit_rate_table(rows, best, "block_hit_rate"))
    meta = {"traces": args.traces, "block_tokens": args.block_tokens, "flat": args.flat,
            "requests": trace.n_requests, "accesses": trace.n_accesses, "unique_blocks": trace.n_keys, **extra_meta}
    if args.json:
        report.write_json(args.json, rows, best, meta)
        print(f"wrote {args.json}")
    if args.csv:
        report.write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    if args.plot:
        from tiers.sim.plots import hit_rate_plot
        names = ", ".join(n.rsplit("/", 1)[-1] for n in args.traces)
        hit_rate_plot(args.plot, rows, best, title=f"{names}: {'flat' if args.flat else 'prefix'} token hit rate")
        print(f"wrote {args.plot}")
    return EXIT_OK


def cmd_replay_live(args: argparse.Namespace, trace, policies: list, capacities: list, best) -> int:
    """--live: the trace through the real backend against tier daemons, checked against the simulation."""
    import threading
    import time

    from tqdm import tqdm

    from tiers.plugins import PluginError, lab
    try:
        live = lab("live")
    except PluginError as exc:
        print(f"replay --live: {exc}", file=sys.stderr)
        return EXIT_USAGE

    if args.bench:
        print("replay: --bench measures the simulator; it does not combine with --live", file=sys.stderr)
        return EXIT_USAGE
    if args.start and args.runtime_dir:
        print("replay: --start runs its own nodes in temporary directories; drop --runtime-dir", file=sys.stderr)
        return EXIT_USAGE
    if args.start and any(c.blocks <= 0 for c in capacities):
        print("replay --live --start: every capacity must be at least one block", file=sys.stderr)
        return EXIT_USAGE
    points = len(policies) * len(capacities) if args.start else 1
    print(f"{trace.n_requests:,} requests, {trace.n_accesses:,} block accesses, {trace.n_keys:,} unique blocks "
          f"of {trace.block_tokens} tokens; live: {live.page_bytes()}-byte pages through the SGLang backend, "
          f"{'a fresh DRAM node per point' if args.start else 'the running daemons'}")
    lock = threading.Lock()
    started = time.perf_counter()
    with tqdm(total=trace.n_accesses * points, unit="acc", unit_scale=True, disable=args.quiet or None,
              leave=False, file=sys.stderr) as bar:
        def progress(n: int) -> None:
            with lock:
                bar.update(n)
        try:
            if args.start:
                rows = live.replay_started(trace, policies, capacities, flat=args.flat, progress=progress,
                                           parallel=args.live_parallel)
            else:
                from tiers.cli.serve import config_path
                rows = [live.replay_running(trace, args.runtime_dir, config_path(args), flat=args.flat,
                                            progress=progress)]
        except (live.LiveError, OSError, ValueError, RuntimeError, TimeoutError) as exc:
            print(f"replay --live: {exc}", file=sys.stderr)
            return EXIT_FAILED
    wall = time.perf_counter() - started
    print(f"{'policy':>10}  {'capacity':>9}  {'blocks':>8}  {'hit blocks':>10}  {'simulated':>10}  {'match':>5}  "
          f"{'seconds':>8}  {'requests/s':>10}")
    for r in rows:
        print(f"{r.policy:>10}  {r.capacity:>9}  {r.capacity_blocks:>8,}  {r.hit_blocks:>10,}  {r.sim_hit_blocks:>10,}  "
              f"{'yes' if r.matches_simulation else 'NO':>5}  {r.seconds:>8.2f}  {r.requests_per_s:>10,.0f}")
    print(f"wall time {wall:.1f} s for {len(rows)} point(s) (daemon starts and SGLang import included)")
    code = _report_rows(args, trace, rows, best, {"live": True, "page_bytes": live.page_bytes(),
                                                   "wall_seconds": wall})
    wrong = [r for r in rows if not r.matches_simulation]
    for r in wrong:
        print(f"replay --live: {r.policy} at {r.capacity}: {r.request_mismatches} requests and "
              f"{r.access_mismatches} accesses differ from the simulation"
              + ("" if args.start else " (a tier shared with other pages, or not fresh, cannot match)"),
              file=sys.stderr)
    return EXIT_FAILED if wrong else code


def model_from_args(args: argparse.Namespace) -> PrefillModel:
    """The preset, with any explicit shape option overriding it."""
    base = PRESETS[args.model]
    shape = ModelShape(layers=args.layers or base.layers, kv_heads=args.kv_heads or base.kv_heads,
                       head_dim=args.head_dim or base.head_dim, dtype_bytes=args.dtype_bytes or base.dtype_bytes,
                       params=args.params or base.params)
    for name in ("tflops", "mfu", "read_gbps", "write_gbps", "tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "params"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive (0: the preset's)")
    return PrefillModel(shape=shape, tflops=args.tflops, mfu=args.mfu, read_gbps=args.read_gbps,
                        write_gbps=args.write_gbps)


def cmd_model(args: argparse.Namespace) -> int:
    """Print the prefill model's speed-up curve (and plot it)."""
    try:
        model = model_from_args(args)
        curve = model.curve(args.tokens, args.points)
    except ValueError as exc:
        print(f"model: {exc}", file=sys.stderr)
        return EXIT_USAGE
    kv = model.shape.kv_bytes_per_token
    print(f"{args.model}: KV {kv / 1024:,.0f} KiB/token; T = {model.compute_s * 1e3:.4f} ms/token "
          f"({args.tflops:g} TFLOPs x {args.mfu:g}); R = {model.read_s * 1e3:.4f} ms/token ({args.read_gbps:g} GB/s); "
          f"W = {model.write_s * 1e3:.4f} ms/token ({args.write_gbps:g} GB/s)")
    print(f"e = T/R = {model.e:.3f}; crossover a* = e/(1+e) = {model.crossover:.3f}; "
          f"peak speed-up {args.tokens * model.compute_s / model.ttft(model.crossover, args.tokens):.2f}x there; "
          f"N = {args.tokens:,} tokens, TTFT without reuse {args.tokens * model.compute_s * 1e3:,.1f} ms")
    print(f"{'a':>5}  {'TTFT ms':>10}  {'speed-up':>8}  bound")
    for point in curve:
        print(f"{point['a']:>5.2f}  {point['ttft_s'] * 1e3:>10.1f}  {point['speedup']:>7.2f}x  {point['bound']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": args.model, "kv_bytes_per_token": kv, "T_s": model.compute_s, "R_s": model.read_s,
                       "W_s": model.write_s, "e": model.e, "crossover": model.crossover, "curve": curve}, handle, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from tiers.sim.plots import speedup_plot
        speedup_plot(args.plot, model.curve(args.tokens, 401), model.crossover,
                     f"{args.model}: {args.read_gbps:g} GB/s reads, {args.write_gbps:g} GB/s writes, "
                     f"{args.tflops:g} TFLOPs x {args.mfu:g}, N = {args.tokens:,} tokens")
        print(f"wrote {args.plot}")
    return EXIT_OK


def register(subparsers) -> None:
    """Add the replay and model sub-commands."""
    replay = subparsers.add_parser("replay", help="replay request traces through the eviction policies",
                                   description=REPLAY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("traces", nargs="+", metavar="TRACE", help="Mooncake JSONL trace file(s)")
    replay.add_argument("--policy", default="lru,fifo,lfu,s3fifo,radix-lru",
                        help=f"comma-separated policies, or 'all' (registered: {', '.join(policy_names())}; "
                             "a user's own as FILE.py:Class; default: %(default)s)")
    replay.add_argument("--capacity", default=DEFAULT_CAPACITIES,
                        help=f"comma-separated capacities, {SYNTAX} (default: %(default)s)")
    replay.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per hash block (default: %(default)s)")
    replay.add_argument("--flat", action="store_true", help="score every access, no prefix rule (libCacheSim's view)")
    replay.add_argument("--engine", choices=["auto", "kernel", "policy"], default="auto",
                        help="auto: stack distances for lru, compiled kernels for the rest; "
                             "policy: the Python policy classes (slow) (default: %(default)s)")
    replay.add_argument("--json", metavar="FILE", type=output_file, help="write rows and the ceiling as JSON")
    replay.add_argument("--csv", metavar="FILE", type=output_file, help="write rows as CSV")
    replay.add_argument("--plot", metavar="FILE.png", type=output_file, help="plot token hit rate against capacity")
    replay.add_argument("--bench", action="store_true", help="measure accesses/s per policy and engine instead")
    replay.add_argument("--quiet", action="store_true", help="no progress bar")
    replay.add_argument("--live", action="store_true",
                        help="replay through the real SGLang backend against tier daemons and check the hits "
                             "against the simulation")
    replay.add_argument("--start", action="store_true",
                        help="with --live: start a fresh one-tier DRAM node per policy and capacity "
                             "(default: the running daemons of the node configuration)")
    replay.add_argument("--config", metavar="FILE",
                        help="with --live: node configuration of the running daemons (default $HICACHE_TIERS_CONFIG, "
                             "then the system file, then the embedded default)")
    replay.add_argument("--runtime-dir", metavar="DIR", help="with --live: where the running daemons' sockets are")
    replay.add_argument("--live-parallel", type=positive_int, default=4, metavar="N",
                        help="with --live --start: nodes run and replayed at once (default: %(default)s)")
    replay.set_defaults(func=cmd_replay)

    model = subparsers.add_parser("model", help="prefill model of KV offloading: TTFT speed-up over reuse fraction",
                                  description=prefill.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    model.add_argument("--model", choices=sorted(PRESETS), default="llama-3-70b", help="shape preset (default: %(default)s)")
    model.add_argument("--layers", type=int, default=0, help="override the preset's layer count (default: preset)")
    model.add_argument("--kv-heads", type=int, default=0, help="override the preset's KV heads (default: preset)")
    model.add_argument("--head-dim", type=int, default=0, help="override the preset's head dimension (default: preset)")
    model.add_argument("--dtype-bytes", type=float, default=0, help="bytes per KV element, 2 for FP16 (default: preset)")
    model.add_argument("--params", type=float, default=0, help="parameter count, e.g. 70.6e9 (default: preset)")
    model.add_argument("--tflops", type=float, default=312.0, help="GPU dense peak TFLOPs (default: %(default)s, A100 BF16)")
    model.add_argument("--mfu", type=float, default=0.5, help="fraction of the peak prefill reaches (default: %(default)s)")
    model.add_argument("--read-gbps", type=float, default=1.7,
                       help="tier read bandwidth in GB/s (default: %(default)s, shared memory end to end here)")
    model.add_argument("--write-gbps", type=float, default=1.7, help="tier write bandwidth in GB/s (default: %(default)s)")
    model.add_argument("--tokens", type=positive_int, default=8192, help="prompt length N for absolute TTFT (default: %(default)s)")
    model.add_argument("--points", type=int, default=21, help="values of a from 0 to 1 (default: %(default)s)")
    model.add_argument("--json", metavar="FILE", type=output_file, help="write the curve as JSON")
    model.add_argument("--plot", metavar="FILE.png", type=output_file, help="plot the speed-up curve")
    model.set_defaults(func=cmd_model)
