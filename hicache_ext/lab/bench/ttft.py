"""The ``ttft`` part: time to first token on a real SGLang server (CPU) in front of a node of real daemons.

One server (``hicache_ext/lab/server.py``: ``python -m sglang.launch_server``
with ``--enable-metrics``) and one node whose tiers are DRAM, NVMe and remote
(a pool daemon reached over the Transfer Engine's TCP) under write_through, so
every page SGLang backs up reaches every tier. The cases, per repetition on
fresh prompts of each length (``ttft_cases.py``): recompute, device hit, host
hit, and L3 hits from DRAM, from NVMe with a cold page cache (the DRAM tier
cleared first, as a restarted DRAM daemon leaves it; chunk files dropped from
the page cache with posix_fadvise(DONTNEED), never the machine-wide
drop_caches) and from the remote pool (DRAM and NVMe cleared). The same run
measures each tier's read GB/s at the model's page size with the rig
(``project.run_dram`` ...) and the backend's lookup latency, so the bound of
the report (tiers/bench/ttft_report.py) and the profile's check use figures
of this run. The profile (``--ttft-profile``) is ``tiers.sim.profile``'s.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Dict, List

from hicache_ext.lab.bench.rig import MiB, Node, Rank, node_toml, tier_toml
from hicache_ext.lab.server import ModelSpec, SGLangServer, ServerOptions, random_llama
from tiers.bench.stats import Figures, Progress, size_label
from tiers.stores.remote.loopback import free_ports, pool_config

PAGE_TOKENS = 16
STORAGE_BATCH_PAGES = 128  # SGLang's storage batch: what one prefetch read asks for at most
TIER_KINDS = ("dram", "nvme", "remote")
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
# The bench's models: the 8-layer one has 8 KiB of KV a token (128 KiB pages); the tiny one 2 KiB (32 KiB).
# llama-8l keeps its KV (8 layers x 4 KV heads x head dim 64) with little compute around it (hidden 256,
# as many query heads as KV heads, MLP 256): on this CPU bf16 matmuls run at ~5 GFLOP/s, and with hidden
# 512 / MLP 1,024 a device hit's extend of 16 tokens took 60-125 ms, varying by +-15 ms between two
# requests in a row, several times the few ms an L3 hit adds; now 35-55 ms (+-3 ms). A GPU's extend is
# a few ms, so the hits' own costs weigh here about as they do there.
MODELS: Dict[str, ModelSpec] = {
    "llama-8l": ModelSpec(layers=8, hidden=256, heads=4, kv_heads=4, intermediate=256),
    "tiny": ModelSpec(),
}


def model_params(spec: ModelSpec) -> int:
    """Parameters of the random Llama (embedding and head untied, as LlamaConfig's default)."""
    head_dim = spec.hidden // spec.heads
    attention = 2 * spec.hidden * spec.hidden + 2 * spec.hidden * spec.kv_heads * head_dim
    layer = attention + 3 * spec.hidden * spec.intermediate + 2 * spec.hidden
    return spec.layers * layer + 2 * spec.vocab * spec.hidden + spec.hidden


def pools(lengths: List[int], page: int = PAGE_TOKENS) -> Dict[str, int]:
    """The device pool (the longest prompt and a margin), the filler prompts that push every prompt off it,
    and the host pool ratio that keeps every prompt and the fillers at once."""
    device = -(-(max(lengths) + 256) // page) * page
    filler = max(page, min(1024, device // 4) // page * page)
    fillers = -(-(device + page) // filler)
    host_needed = sum(lengths) + fillers * filler + device
    return {"device_tokens": device, "filler_tokens": filler, "fillers": fillers,
            "hicache_ratio": max(2, math.ceil(host_needed / device))}


def _rig_rates(figs: Figures, args, progress: Progress, page_bytes: int, kinds: List[str]) -> None:
    """Each tier's GB/s at the model's page size with the rig (unless this run has them) in batches of
    SGLang's 128 pages, as the server reads (whatever --pages says), and lookups."""
    from hicache_ext.lab.bench import project
    runners = {"dram": project.run_dram, "nvme": project.run_nvme, "remote": project.run_remote}
    label = size_label(page_bytes)
    rig_args = copy.copy(args)
    rig_args.pages = STORAGE_BATCH_PAGES
    # The bound an L3 hit is held to comes from this rate: as many repetitions as the hits get (the NVMe
    # tier's cold rate at 128 KiB pages was 0.65 GB/s in one run of 3 and 0.84 in the next).
    rig_args.repeat = max(args.repeat, args.ttft_repeat)
    for kind in kinds:
        if figs.median(f"{kind}.{label}.read") is None:
            progress.step(f"ttft: {kind} read rate at {label} pages (the rig, {STORAGE_BATCH_PAGES} pages a batch)")
            runners[kind](figs, rig_args, progress, page_bytes)
    if figs.median("lookup.128.p50") is None:
        _lookups(figs, args, progress)


def _lookups(figs: Figures, args, progress: Progress) -> None:
    """p50/p99 of batch_exists of 1 and 128 held keys on a DRAM tier (the planner's lookup figures)."""
    from hicache_ext.lab.bench.lookup import _latencies
    node = Node(os.path.join(args.work_dir, "ttft-lookup"), node_toml([tier_toml("dram", 8 * MiB, MiB)]))
    try:
        rank = Rank.tiered(node, MiB, 128, tiny=True)
        keys = rank.keys(13)
        if rank.write(keys) != len(keys):
            figs.failures.append("ttft: could not store the pages to look up")
            return
        progress.step("ttft: lookups of 1 and 128 keys")
        _latencies(figs, rank, {"lookup.1": keys[:1], "lookup.128": keys}, 50 if args.quick else 300)
        rank.close()
    finally:
        node.close()


def node_config(root: str, kinds: List[str], tier_bytes: int, page_bytes: int, pool_port: int) -> str:
    """The server's node: the kinds asked for, in chain order, under write_through; where sglang-args reads it."""
    tiers = []
    for kind in TIER_KINDS:
        if kind in kinds:
            extra = {"block_size": size_label(page_bytes)} if kind == "dram" and page_bytes < 64 << 10 else {}
            tiers.append(tier_toml(kind, tier_bytes, page_bytes, pool_port=pool_port if kind == "remote" else None,
                                   **extra))
    text = node_toml(tiers, "write_through")
    return text.replace("[node]\n", f'[node]\nruntime_dir = "{root}/run"\ndata_dir = "{root}/data"\n', 1)


def run_ttft(figs: Figures, args, progress: Progress) -> None:
    """The part: rig rates, then the node, the pool and the server, the repetitions, the profile."""
    from hicache_ext.lab.bench.ttft_cases import Cases
    spec = MODELS[args.ttft_model]
    lengths = sorted(args.ttft_lengths)
    kinds = [k for k in TIER_KINDS if k in args.ttft_tiers]
    page_bytes = spec.kv_bytes_per_token * PAGE_TOKENS
    sizes = pools(lengths)
    _rig_rates(figs, args, progress, page_bytes, kinds)
    root = os.path.join(args.work_dir, "ttft")
    per_rep_tokens = sum(lengths) + sizes["fillers"] * sizes["filler_tokens"]
    tier_bytes = 2 * per_rep_tokens * spec.kv_bytes_per_token
    pool = None
    (port,) = free_ports(1)
    if "remote" in kinds:
        pool = Node(os.path.join(root, "pool"), pool_config([port], capacity=f"{(tier_bytes >> 20) + 128}MiB",
                                                            block_size="64KiB", max_page_bytes="1MiB"))
    node = server = None
    try:
        node = Node(os.path.join(root, "node"), node_config(os.path.join(root, "node"), kinds, tier_bytes,
                                                            page_bytes, port))
        model = random_llama(spec, Path(args.work_dir) / "models")
        options = ServerOptions(model=model, node_config=Path(node.runner.config_path), page_size=PAGE_TOKENS,
                                max_total_tokens=sizes["device_tokens"], hicache_ratio=sizes["hicache_ratio"],
                                extra_args=["--enable-metrics"])
        progress.step(f"ttft: starting SGLang ({args.ttft_model}, device pool {sizes['device_tokens']:,} tokens, "
                      f"host pool x{sizes['hicache_ratio']}; about a minute)")
        server = SGLangServer(options, Path(root) / "server.log").start()
        figs.info["ttft"] = {"model": args.ttft_model, "spec": vars(spec), "kv_bytes_per_token":
                             spec.kv_bytes_per_token, "page_tokens": PAGE_TOKENS, "page_bytes": page_bytes,
                             "page_label": size_label(page_bytes), "lengths": lengths, "tiers": kinds,
                             "repeat": args.ttft_repeat, "params": model_params(spec), **sizes,
                             "nvme_cold": "DRAM tier cleared, chunk files dropped with posix_fadvise(DONTNEED)",
                             "prefetch_threshold": 256, "prefetch_policy": options.prefetch_policy}
        cases = Cases(server, node, kinds, spec, sizes, figs, progress)
        try:
            cases.warm_up()
            for rep in range(args.ttft_repeat):
                cases.repetition(rep, args.ttft_repeat, lengths)
        finally:
            cases.close()
    finally:
        if server is not None:
            server.stop()
        if node is not None:
            node.close()
        if pool is not None:
            pool.close()
    _references(figs, args, progress, options, root, lengths, spec)
    if getattr(args, "ttft_profile", None):
        meta = getattr(args, "run_meta", {})
        machine = meta.get("machine", {}).get("cpu", "?")
        source = f"`{meta.get('command', '?')}`, {meta.get('date', 'undated')}, {machine}"
        write_profile(figs, args.ttft_profile, spec, source)
        progress.done(f"ttft: wrote the profile {args.ttft_profile}")


def _references(figs: Figures, args, progress: Progress, options: ServerOptions, root: str,
                lengths: List[int], spec: ModelSpec) -> None:
    """The same L3 hits through SGLang's own file backend and through the in-process memory backend (the
    floor of any backend), each on a server of the same model and pools, started after ours stopped."""
    from hicache_ext.lab.bench.memory_backend import extra_config
    from hicache_ext.lab.bench.ttft_cases import FileDirectory, InProcessMemory, ReferenceHits
    directory = Path(root) / "file-backend"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    references = [("l3_file", "its own file backend", dataclasses.replace(options, file_backend_dir=directory),
                   FileDirectory(directory, figs)),
                  ("l3_memory", "the in-process memory backend",
                   dataclasses.replace(options, reference_backend=extra_config()), InProcessMemory())]
    if args.quick:  # a smoke run: the floor only (each reference is a server start, ~30 s on 2 cores)
        references = references[1:]
        figs.note("ttft", "--quick: the L3 hit through SGLang's own file backend is left out (full runs have it).")
    try:
        for case, what, reference_options, store in references:
            progress.step(f"ttft: starting SGLang with {what} (a reference L3 hit; about a minute)")
            server = SGLangServer(reference_options, Path(root) / f"server-{case}.log").start()
            try:
                hits = ReferenceHits(server, case, store, figs, progress)
                server.generate([7] * 512, max_new_tokens=1)  # warm-up, untimed
                for rep in range(args.ttft_repeat):
                    hits.repetition(rep, lengths, spec.vocab)
            finally:
                server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_bench(figs: Figures):
    """This run's figures as the planner reads them (lookup_s raises BenchError where none was measured)."""
    from tiers.sim.timing import BenchFigures
    return BenchFigures({"figures": figs.as_dict()["figures"]}, "this run")


def _query_overhead(figs: Figures, info: dict, bench) -> float:
    """SGLang's wait for a storage hit query beyond the lookup: the median over lengths of its
    storage_prefetch_wait on recompute (the query finds nothing) less the lookup of that many keys."""
    import statistics

    from tiers.sim.timing import BenchError
    try:
        waits = [figs.median(f"ttft.recompute.{n}.sglang.storage_prefetch_wait")
                 - bench.lookup_s(min(n // info["page_tokens"], 128)) for n in info["lengths"]
                 if figs.median(f"ttft.recompute.{n}.sglang.storage_prefetch_wait") is not None]
    except BenchError:
        return 0.0
    return max(statistics.median(waits), 0.0) if waits else 0.0


def _hit_handoff(figs: Figures, info: dict, bench, prefetch_s: float) -> float:
    """SGLang's time to carry an L3 hit from its query to its reads and back: the median over the L3 hits of
    storage_prefetch_wait less the transfer and the query, the query costed by the planner's own
    storage_query_s (its lookups a 128-page batch and prefetch_s)."""
    import statistics

    from tiers.sim.hierarchy import storage_query_s
    from tiers.sim.profile import L3_KINDS
    from tiers.sim.timing import BenchError, TimeModel
    page = info["page_tokens"]
    query_model = TimeModel(compute_s=0.0, h2d_s=0.0, tier_read_s=(), write_s=0.0, page_tokens=page, bench=bench,
                            prefetch_s=prefetch_s)
    try:
        handoffs = []
        for case in L3_KINDS:
            for n in info["lengths"]:
                wait = figs.median(f"ttft.{case}.{n}.sglang.storage_prefetch_wait")
                transfer = figs.median(f"ttft.{case}.{n}.sglang.transfer")
                if wait is None or transfer is None:
                    continue
                hit = figs.median(f"ttft.{case}.{n}.cached.storage") or (n // page - 1) * page
                handoffs.append(wait - transfer - storage_query_s(query_model, n // page, int(hit) // page))
    except BenchError:
        return 0.0
    return max(statistics.median(handoffs), 0.0) if handoffs else 0.0


def write_profile(figs: Figures, path: str, spec: ModelSpec, source: str) -> None:
    """The profile of this run's medians (tiers.sim.profile), and its fit as figures of the report."""
    from tiers.sim.prefill import ModelShape
    from tiers.sim.profile import CASES, L3_KINDS, build_profile
    from tiers.bench.ttft_report import SOURCES
    info = figs.info["ttft"]
    measured: Dict[str, Dict[int, float]] = {}
    ranges: Dict[str, Dict[int, tuple]] = {}
    hits: Dict[str, Dict[int, int]] = {}
    for case in CASES:
        for n in info["lengths"]:
            seconds = figs.median(f"ttft.{case}.{n}")
            if seconds is None:
                continue
            measured.setdefault(case, {})[n] = seconds
            ranges.setdefault(case, {})[n] = figs.spread(f"ttft.{case}.{n}")
            if SOURCES[case]:
                hits.setdefault(case, {})[n] = int(figs.median(f"ttft.{case}.{n}.cached.{SOURCES[case]}") or 0)
    shape = ModelShape(layers=spec.layers, kv_heads=spec.kv_heads, head_dim=spec.head_dim, dtype_bytes=2,
                       params=float(info["params"]))
    engine = {k: info[k] for k in ("device_tokens", "hicache_ratio", "prefetch_threshold", "prefetch_policy")}
    transfers = {case: {n: t for n in info["lengths"]
                        if (t := figs.median(f"ttft.{case}.{n}.sglang.transfer")) is not None}
                 for case in L3_KINDS}
    bench = _run_bench(figs)
    prefetch_s = _query_overhead(figs, info, bench)
    profile = build_profile(measured, hits, shape, info["page_tokens"], engine, source, prefetch_s=prefetch_s,
                            transfers=transfers, hit_handoff_s=_hit_handoff(figs, info, bench, prefetch_s),
                            ranges=ranges)
    for name, value in vars(profile.fit).items():
        if isinstance(value, float):
            figs.set(f"ttft.fit.{name}", value, "s")
    for case, error in profile.fit.errors.items():
        figs.set(f"ttft.fit.error.{case}", error, "ratio")
    for kind, read in profile.l3_reads.items():
        figs.set(f"ttft.fit.read.{kind}.fixed_s", read.fixed_s, "s")
        figs.set(f"ttft.fit.read.{kind}.s_per_byte", read.s_per_byte, "s")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    profile.save(path)
