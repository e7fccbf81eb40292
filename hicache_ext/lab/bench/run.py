"""Run the selected parts of the benchmark, then write the JSON, BENCHMARKS.md and the plot."""
from __future__ import annotations

import datetime
import importlib
import json
import os
import shlex
import shutil
import sys
import time
import traceback

from tiers.bench import machine, report
from tiers.bench.stats import Figures, Progress, size_label

PER_SIZE = ("dram", "sealed", "file", "nvme", "remote", "policies", "mooncake")  # in this order for each page size
ONCE = ("zmq", "lookup", "ranks", "restart")
LAST = ("ttft",)  # a real SGLang server: after everything else, at the model's own page size
PARTS = ONCE[:2] + PER_SIZE + ONCE[2:] + LAST


# Each part's module and function, imported when the part runs: all but the round trips load torch and SGLang
# (10 s here), which a run of the round trips alone (scripts/ab_bench.py's quickest A/B) need not pay.
RUNNERS = {"zmq": "round_trip:run_zmq", "lookup": "lookup:run_lookup", "ranks": "ranks:run_ranks",
           "restart": "restart:run_restart", "ttft": "ttft:run_ttft", "dram": "project:run_dram",
           "sealed": "project:run_sealed", "nvme": "project:run_nvme", "remote": "project:run_remote",
           "policies": "project:run_policies", "file": "peers:run_file", "mooncake": "peers:run_mooncake"}


def _runner(part: str):
    module, _, function = RUNNERS[part].partition(":")
    return getattr(importlib.import_module(f"hicache_ext.lab.bench.{module}"), function)


def _command_line() -> str:
    """How this run was started: the hicache-tiers command or the script with its arguments."""
    argv = sys.argv
    if len(argv) > 1 and argv[1] == "bench":
        return "hicache-tiers " + " ".join(map(shlex.quote, argv[1:]))
    return "python " + " ".join(map(shlex.quote, argv))


def run(args) -> int:
    parts = [p for p in PARTS if p in set(args.only)]
    figs = Figures()
    meta = {"command": args.command or _command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine.describe(args.work_dir), "pages": args.pages, "repeat": args.repeat,
            "page_sizes": [size_label(b) for b in args.page_sizes], "parts": parts}
    started = time.monotonic()
    os.makedirs(args.work_dir, exist_ok=True)
    steps = [(p, None) for p in parts if p in ONCE]  # rank processes first: peers may keep memory mapped
    steps += [(p, m) for m in args.page_sizes for p in PER_SIZE if p in parts]
    steps += [(p, None) for p in parts if p in LAST]
    args.run_meta = meta  # the ttft part's profile names the run it came from
    progress = Progress(total=len(steps), quiet=args.quiet)
    try:
        for i, (part, page) in enumerate(steps, 1):
            label = part if page is None else f"{part}, {size_label(page)} pages"
            progress.advance(f"({i}/{len(steps)}) {label}")
            try:
                fn = _runner(part)
                fn(figs, args, progress) if page is None else fn(figs, args, progress, page)
            except Exception as exc:  # one part failing must not lose the others' figures
                figs.failures.append(f"{label}: {type(exc).__name__}: {exc}")
                progress.done(f"{label} FAILED: {type(exc).__name__}: {exc}")
                if args.verbose:
                    traceback.print_exc()
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    meta["seconds"] = time.monotonic() - started
    progress.close()
    progress.done(f"done in {meta['seconds']:.0f} s, {len(figs.failures)} failure(s)")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        if report.plot(figs, meta["page_sizes"], args.plot):
            out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()
            meta["plot"] = os.path.relpath(os.path.abspath(args.plot), out_dir)
    text = report.markdown(figs, meta["page_sizes"], meta)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, **figs.as_dict()}, fh, indent=1)
    if not args.quiet:
        print(text)
    return 1 if figs.failures else 0
