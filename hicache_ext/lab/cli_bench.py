"""``bench``: limits, peers and this project measured in one run (registration only; the work is in hicache_ext.lab.bench)."""
from __future__ import annotations

import argparse
import os

from tiers.cli import output_file, positive_int

PARTS = ("zmq", "lookup", "dram", "sealed", "file", "nvme", "remote", "policies", "mooncake", "ranks", "restart")
EXTRA_PARTS = ("ttft",)  # not in the default run: a real SGLang server, ~5 minutes at the default lengths
TTFT_MODELS = ("llama-8l", "tiny")
TTFT_TIERS = ("dram", "nvme", "remote")
DEFAULT_LENGTHS = "512,1024,2048,4096,8192"
# What a hit adds over a device hit is a median of this many pairs at least: at three, one server's extend over
# the same cached prefix varied enough (24-60 ms at 8,192 tokens) to move a cell's median across its bound
# between runs; five cost the part ~1.5 minutes more (~5.3 minutes in all here).
TTFT_REPEAT = 5
KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB)


def _sizes(text: str):
    """'64KiB,1MiB' -> bytes; each a whole number of tokens of the bench's model shapes."""
    from tiers.config_values import ConfigError, parse_size
    try:
        sizes = [parse_size(p.strip(), "page size") for p in text.split(",") if p.strip()]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    bad = [s for s in sizes if s <= 0 or (s % MiB if s >= MiB else s % (32 * KiB))]
    if bad or not sizes:
        raise argparse.ArgumentTypeError(f"{text!r}: page sizes are multiples of 32KiB below 1MiB and of 1MiB "
                                         "from it (e.g. 64KiB,256KiB,1MiB)")
    return sizes


def _list(kind, allowed=None):
    def parse(text: str):
        try:
            items = [kind(p.strip()) for p in text.split(",") if p.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
        bad = [i for i in items if allowed is not None and i not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(map(str, allowed))}" if allowed else "empty list")
        return items
    return parse


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure the limits, the peers and every tier on this machine; write BENCHMARKS.md",
        description="Measure, in one run: this machine's limits (memcpy, raw disk write and O_DIRECT read, the raw "
                    "Mooncake Transfer Engine, a ZeroMQ round trip), the peers (SGLang's file and mooncake backends "
                    "through SGLang's own page functions) and this project through the real backend and a real "
                    "host pool (each tier, each write policy, prefix lookups, 1 to 16 rank processes, an NVMe "
                    "restart). Figures are medians of --repeat repetitions with their spread; ratios are within "
                    "the run. Exits 1 when a run failed (never because a figure is low). The ttft part (not in "
                    "the default run; about 5 minutes at the default lengths and 5 repetitions on a quiet 2-core "
                    "machine, more when other work shares it) starts a "
                    "real SGLang server on CPU with this backend and measures time to first token per prompt "
                    "length: recompute, device hit, host hit, and L3 hits from DRAM, cold NVMe and a remote pool, "
                    "each checked against where SGLang says the hit came from; the same run measures each tier's "
                    "read rate at the model's page size for the bound an L3 hit is held to.")
    p.add_argument("--only", type=_list(str, PARTS + EXTRA_PARTS), default=list(PARTS), metavar="PARTS",
                   help=f"comma-separated parts: {','.join(PARTS + EXTRA_PARTS)} (default all but "
                        f"{','.join(EXTRA_PARTS)}, which takes about 5 minutes more)")
    p.add_argument("--page-sizes", type=_sizes, default="64KiB,256KiB,1MiB,4MiB,8MiB", metavar="SIZES",
                   help="page sizes, comma-separated, multiples of 32KiB below 1MiB and of 1MiB from it "
                        "(default 64KiB,256KiB,1MiB,4MiB,8MiB)")  # a string default goes through _sizes
    p.add_argument("--pages", type=positive_int, default=128, help="pages a batch (default 128)")
    p.add_argument("--repeat", type=positive_int, default=3, help="repetitions; figures are medians (default 3)")
    p.add_argument("--restart-chunks", type=positive_int, default=1_000_000,
                   help="chunks the NVMe tier restarts over in the restart part (default 1000000)")
    p.add_argument("--quick", action="store_true", help="smoke size: 8 pages of 1 MiB, 2 repetitions, "
                   "10000 chunks to restart over; ttft: one 512-token prompt, the tiny model, 1 repetition, "
                   "the in-process floor as the only reference (no file-backend server)")
    p.add_argument("--ttft-lengths", type=_list(int), default=None, metavar="TOKENS",
                   help=f"ttft: prompt lengths, comma-separated (default {DEFAULT_LENGTHS}; --quick: 512)")
    p.add_argument("--ttft-tiers", type=_list(str, TTFT_TIERS), default=list(TTFT_TIERS), metavar="KINDS",
                   help="ttft: the node's tiers and so the L3 cases, comma-separated from dram,nvme,remote "
                        "(default all three)")
    p.add_argument("--ttft-model", choices=TTFT_MODELS, default=None,
                   help="ttft: llama-8l (8 layers, hidden 256, 4 KV heads: 8 KiB of KV a token, 128 KiB pages) or "
                        "tiny (4 layers, hidden 256, 2 KV heads: 2 KiB, 32 KiB pages) "
                        "(default llama-8l; --quick: tiny)")
    p.add_argument("--ttft-repeat", type=positive_int, default=None, metavar="N",
                   help=f"ttft: repetitions of each case (default {TTFT_REPEAT}, or --repeat when larger; --quick: 1); "
                        "what a hit adds over a device hit is a median of this many paired differences")
    p.add_argument("--ttft-profile", metavar="FILE", type=output_file,
                   help="ttft: write the measured profile here (JSON; hicache-tiers plan --profile FILE)")
    p.add_argument("--work-dir", default=None, help="scratch directory on the disk to measure "
                   "(default /var/tmp/hicache-bench-PID; removed afterwards)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write every sample here")
    p.add_argument("--out", metavar="FILE", type=output_file, help="write the Markdown report here (e.g. BENCHMARKS.md)")
    p.add_argument("--plot", metavar="PNG", type=output_file, help="write a bar chart here (needs matplotlib)")
    p.add_argument("--command", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress lines, no report on stdout")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failed parts")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.quick:
        args.pages, args.repeat = min(args.pages, 8), min(args.repeat, 2)
        args.restart_chunks = min(args.restart_chunks, 10_000)
        if args.page_sizes == list(DEFAULT_SIZES):
            args.page_sizes = [MiB]
    if args.pages < 1 or args.repeat < 1:
        print("bench: --pages and --repeat must be positive")
        return 2
    args.ttft_repeat = 1 if args.quick else (args.ttft_repeat or max(args.repeat, TTFT_REPEAT))
    args.ttft_model = args.ttft_model or ("tiny" if args.quick else "llama-8l")
    if args.ttft_lengths is None:
        args.ttft_lengths = [512] if args.quick else [int(n) for n in DEFAULT_LENGTHS.split(",")]
    if any(n < 512 or n > 16000 for n in args.ttft_lengths):
        print("bench: --ttft-lengths must be within 512..16000 tokens (SGLang prefetches from L3 only from 256 "
              "cached tokens; the model has 16,384 positions)")
        return 2
    args.work_dir = args.work_dir or f"/var/tmp/hicache-bench-{os.getpid()}"
    from hicache_ext.lab.bench.run import run  # torch and sglang load only here
    return run(args)
