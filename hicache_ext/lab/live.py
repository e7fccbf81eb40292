"""Live replay: a trace's requests through the real backend against running tier daemons.

The simulation's semantics (tiers/sim/simulate.py), so a fresh one-tier DRAM
node of the same policy and capacity gives the simulator's hits access for access:
- a request's hit is ``driver.exists(keys)``: the leading run held at arrival;
- then every block in request order: a held block is read (prefetch: the
  daemon's get touches the policy), a missing one written (backup: the put
  evicts while the arena is full, then inserts with the previous block of the
  request as parent, passed as SGLang's prefix keys).
Blocks go in runs, one controller call per run.  A run of reads changes nothing
that is held (touches never evict).  A run of writes stops before a block held
now and before a block repeated within the run, so every block in it is still
missing when the daemon reaches it (a put over a held page would remove and
re-insert it instead of touching it).  So a block held after a missing one is
read in its place, as the simulator touches it.  Which blocks are held past
the leading run comes from the backend's own tier clients (a lookup never
touches the policy).

Pages are the smallest SGLang host pool accepts (1 layer, 1 KV head, head
dimension 1, bf16, 1 token: 4 bytes); the DRAM tier's block size is the page
size, so capacity in blocks is capacity in pages.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tiers.wire.lookup import lookup_all
from tiers.sim.capacity import Capacity
from tiers.sim.simulate import access_hits, leading_run, score
from tiers.sim.sweep import Row, ceiling
from tiers.sim.trace import Trace

LIVE_SHAPE = dict(layers=1, kv_heads=1, head_dim=1, page_size=1)  # bf16: K 2 B + V 2 B a page
LIVE_MODEL = "replay-live"  # model name, hence namespace, of the replay's pages
DTYPE_BYTES = 2  # bf16


class LiveError(RuntimeError):
    """The live replay cannot be trusted (a tier stopped answering, a transfer fell short)."""


def page_bytes(shape: Optional[dict] = None) -> int:
    """Bytes of one page of an MHA host pool of shape (K and V)."""
    s = dict(LIVE_SHAPE if shape is None else shape)
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * s["page_size"] * DTYPE_BYTES


def page_key(block: int) -> str:
    """The 64-hex page key of a dense block id (the ids already namespace each trace file)."""
    return hashlib.sha256(f"hicache-tiers-replay:{block}".encode()).hexdigest()


def page_keys(trace: Trace) -> List[str]:
    """page_key of every block id of trace."""
    return [page_key(k) for k in range(trace.n_keys)]


def dram_node_config(blocks: int, policy: str, page_size_bytes: int) -> str:
    """A one-tier DRAM node holding exactly ``blocks`` pages of page_size_bytes under policy."""
    if blocks <= 0:
        raise ValueError("a live node needs a capacity of at least one block")
    return f"""[node]
write_policy = "write_through"

[[tiers]]
name = "dram"
kind = "dram"
capacity = {blocks * page_size_bytes}
policy = "{policy}"
block_size = {page_size_bytes}
max_page_bytes = {page_size_bytes}
prefault = false
"""


class LiveEngine:
    """One SGLang rank on a node: a real host pool, the backend from SGLang's factory, the controller's page functions."""

    def __init__(self, runtime_dir: str, config_path: Optional[str], pages: int, shape: Optional[dict] = None,
                 model: str = LIVE_MODEL, deadline_s: float = 30.0):
        from hicache_ext.lab.sglang_harness import (PageDriver, build_mha_host_pool, create_backend,
                                                host_indices_for_pages, make_storage_config)
        shape = dict(LIVE_SHAPE if shape is None else shape)
        self.pool = build_mha_host_pool(layout="page_first", allocator="shm", pages=max(pages, 1), **shape)
        self.page_size = shape["page_size"]
        _, sizes = self.pool.get_page_buffer_meta(host_indices_for_pages(self.pool, 0, 1))
        self.page_bytes = int(sum(sizes))
        if self.page_bytes != page_bytes(shape):
            raise LiveError(f"host pool pages are {self.page_bytes} bytes, expected {page_bytes(shape)}")
        # Generous deadlines: on a loaded machine a timed-out call would be a miss, not a hit rate.
        extra = {"backend_name": "hicache_tiers", "module_path": "hicache_ext", "class_name": "TieredHiCacheStorage",
                 "interface_v1": 1, "allocator": "shm", "runtime_dir": runtime_dir,
                 "deadline_base_s": deadline_s, "lookup_timeout_s": deadline_s}
        if config_path:
            extra["tiers_config"] = config_path
        self.config = make_storage_config(model_name=model, layout="page_first", extra_config=extra)
        self.backend = create_backend("dynamic", self.config, self.pool)
        self.driver = PageDriver(self.backend, self.pool, self.config, "dynamic")
        self.indices = host_indices_for_pages(self.pool, 0, max(pages, 1))
        inner = getattr(self.backend, "_backend", self.backend)  # SGLang may wrap it in its failure injector
        self.clients = inner._router.clients

    def slots(self, n: int):
        """Host slots of the first n pages."""
        return self.indices[:n * self.page_size]

    def held(self, keys: List[str]) -> bytes:
        """One byte per key, 1 when some tier holds it (LiveError when a tier does not answer)."""
        out = bytearray(len(keys))
        # every tier asked at once: the replay compares each tier's answer with its policy class
        for client, flags in zip(self.clients, lookup_all(self.clients, keys, head_start=0)):
            if flags is None:
                raise LiveError(f"tier {client.name} did not answer a lookup")
            for i, flag in enumerate(flags):
                if flag:
                    out[i] = 1
        return bytes(out)

    def clear(self) -> None:
        """Drop this replay's namespace from every tier."""
        for client in self.clients:
            if client.clear() is None:
                raise LiveError(f"tier {client.name} did not clear")

    def tier_stats(self) -> Dict[str, Optional[dict]]:
        return {c.name: c.stats() for c in self.clients}

    def check_up(self) -> None:
        down = [c.name for c in self.clients if c.is_down()]
        if down:
            raise LiveError(f"tier {', '.join(down)} stopped answering; the replay's hits would be misses")

    def close(self) -> None:
        self.backend.close()


@dataclass
class LiveRun:
    """What the daemons saw: per-access hit flags, per-request exists() hits, timing, calls."""

    hits: np.ndarray  # per access: read (held when reached) or written
    exists: np.ndarray  # per request: driver.exists() at arrival
    seconds: float
    calls: Dict[str, int] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return len(self.exists) / self.seconds if self.seconds else 0.0


def replay(trace: Trace, engine: LiveEngine, keys: Optional[List[str]] = None,
           progress: Optional[Callable[[int], None]] = None) -> LiveRun:
    """Drive every request through the backend in order, with the simulation's per-block semantics."""
    keys = page_keys(trace) if keys is None else keys
    driver, calls = engine.driver, Counter()
    hits = np.zeros(trace.n_accesses, dtype=bool)
    exists = np.zeros(trace.n_requests, dtype=np.int64)
    offsets = trace.offsets.tolist()
    ids = trace.keys.tolist()
    started = time.perf_counter()
    for r in range(trace.n_requests):
        base, end = offsets[r], offsets[r + 1]
        request = [keys[k] for k in ids[base:end]]
        n = len(request)
        if not n:
            continue
        exists[r] = h = driver.exists(request)
        calls["exists"] += 1
        pos = 0
        if h:
            _transfer(engine, request, 0, h, calls, write=False)
            hits[base:base + h] = True
            pos = h
        while pos < n:
            held = engine.held(request[pos:])
            calls["lookup"] += 1
            run = _held_run(held) if held[0] else _missing_run(held, request, pos)
            _transfer(engine, request, pos, run, calls, write=not held[0])
            if held[0]:
                hits[base + pos:base + pos + run] = True
                calls["blocks_held_after_a_miss"] += run
            pos += run
        engine.check_up()
        if progress:
            progress(n)
    return LiveRun(hits=hits, exists=exists, seconds=time.perf_counter() - started, calls=dict(calls))


def _held_run(held: bytes) -> int:
    """Leading held keys."""
    run = 0
    while run < len(held) and held[run]:
        run += 1
    return run


def _missing_run(held: bytes, request: List[str], pos: int) -> int:
    """Leading missing keys, stopping before a key repeated within the run (it would be held by then)."""
    seen = set()
    run = 0
    while run < len(held) and not held[run] and request[pos + run] not in seen:
        seen.add(request[pos + run])
        run += 1
    return run


def _transfer(engine: LiveEngine, request: List[str], pos: int, run: int, calls: Counter, write: bool) -> None:
    """Back up (write) or prefetch (read) request[pos:pos + run]; LiveError when fewer pages complete.

    prefix_keys (a list, even empty) makes the controller chain each batch of
    128 pages to the previous one, so every written page's parent is the
    previous block of the request.
    """
    op = engine.driver.backup if write else engine.driver.prefetch
    done = op(request[pos:pos + run], engine.slots(run), prefix_keys=request[:pos])
    calls["backup" if write else "prefetch"] += 1
    if done != run:
        engine.check_up()
        raise LiveError(f"{'backup wrote' if write else 'prefetch read'} {done} of {run} pages")


@dataclass
class LiveRow(Row):
    """A live replay's row: the simulation's columns plus timing and the check against the simulator."""

    requests_per_s: float = 0.0
    sim_hit_blocks: int = 0
    sim_hit_tokens: int = 0
    matches_simulation: bool = False
    request_mismatches: int = 0  # requests whose live hit (exists) differs from the simulated one
    access_mismatches: int = 0  # accesses the daemon saw as hit/miss differently from the simulator
    daemon_hits: int = 0
    daemon_inserts: int = 0
    daemon_evictions: int = 0
    calls: Dict[str, int] = field(default_factory=dict)


def live_row(trace: Trace, run: LiveRun, policy: str, capacity: Capacity, flat: bool = False,
             stats: Optional[dict] = None) -> LiveRow:
    """Score a live run like the simulation and compare it with the simulator at the same point."""
    best = ceiling(trace, flat)
    result = score(trace, run.hits, flat=flat)
    sim_hits = access_hits(trace, policy, capacity.blocks)
    sim = score(trace, sim_hits, flat=flat)
    live_leading = per_request_hits(trace, run.hits)
    sim_leading = per_request_hits(trace, sim_hits)
    request_mismatches = int(np.count_nonzero((live_leading != sim_leading) | (run.exists != live_leading)))
    access_mismatches = int(np.count_nonzero(run.hits != sim_hits))
    stats = stats or {}
    return LiveRow(policy=policy, capacity=capacity.label, capacity_blocks=capacity.blocks,
                   capacity_tokens=capacity.blocks * trace.block_tokens, token_hit_rate=result.token_hit_rate,
                   block_hit_rate=result.block_hit_rate,
                   ceiling_fraction=result.token_hit_rate / best.token_hit_rate if best.token_hit_rate else 0.0,
                   requests=trace.n_requests, accesses=trace.n_accesses, hit_blocks=result.hit_blocks,
                   hit_tokens=result.hit_tokens, flat=flat, engine="live", seconds=run.seconds,
                   requests_per_s=run.requests_per_s, sim_hit_blocks=sim.hit_blocks, sim_hit_tokens=sim.hit_tokens,
                   matches_simulation=request_mismatches == 0 and access_mismatches == 0,
                   request_mismatches=request_mismatches, access_mismatches=access_mismatches,
                   daemon_hits=int(stats.get("hits", 0)), daemon_inserts=int(stats.get("inserts", 0)),
                   daemon_evictions=int(stats.get("evictions", 0)), calls=dict(run.calls))


def per_request_hits(trace: Trace, hits: np.ndarray) -> np.ndarray:
    """Blocks in each request's leading run of hits."""
    counted = np.concatenate([[0], np.cumsum(leading_run(trace, hits))])
    return counted[trace.offsets[1:]] - counted[trace.offsets[:-1]]


def max_request_blocks(trace: Trace) -> int:
    return int(np.diff(trace.offsets).max()) if trace.n_requests else 1


# ------------------------------------------------------------- nodes of our own
def make_runners(points: Sequence[Tuple[str, int]], base_dir: str, page_size_bytes: int) -> list:
    """One (not yet started) one-tier DRAM NodeRunner per (policy, blocks), each in its own runtime dir."""
    from tiers.ops.node_runner import NodeRunner
    return [NodeRunner(dram_node_config(blocks, policy, page_size_bytes), os.path.join(base_dir, f"n{i}", "run"),
                       os.path.join(base_dir, f"n{i}", "data")) for i, (policy, blocks) in enumerate(points)]


def _all(pool: ThreadPoolExecutor, work: Callable, items: Sequence) -> list:
    """work(item) for every item on pool; results in order; the first exception raised after all finish."""
    futures = [pool.submit(work, item) for item in items]
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]


def replay_started(trace: Trace, policies: Sequence[str], capacities: Sequence[Capacity], flat: bool = False,
                   progress: Optional[Callable[[int], None]] = None, parallel: int = 4,
                   on_row: Optional[Callable[[LiveRow], None]] = None) -> List[LiveRow]:
    """Per (policy, capacity) a fresh one-tier DRAM node of that policy and capacity, replayed through the backend."""
    return replay_points([(trace, p, c) for p in policies for c in capacities], flat, progress, parallel, on_row)


def replay_points(points: Sequence[Tuple[Trace, str, Capacity]], flat: bool = False,
                  progress: Optional[Callable[[int], None]] = None, parallel: int = 4,
                  on_row: Optional[Callable[[LiveRow], None]] = None) -> List[LiveRow]:
    """Rows for (trace, policy, capacity) points; up to ``parallel`` nodes run and replay at once.

    Nodes start while SGLang is imported (the slowest step); each point has
    its own node and backend, so points replayed side by side cannot see
    each other.
    """
    parallel = max(1, parallel)
    size = page_bytes()
    keys = {id(t): page_keys(t) for t, _, _ in points}
    rows: List[LiveRow] = []
    with tempfile.TemporaryDirectory(prefix="hicache-live-") as base, ThreadPoolExecutor(parallel) as pool:
        for first in range(0, len(points), parallel):
            chunk = points[first:first + parallel]
            runners = make_runners([(p, c.blocks) for _, p, c in chunk], os.path.join(base, str(first)), size)
            try:
                started = [pool.submit(r.start) for r in runners]
                importlib.import_module("hicache_ext.lab.sglang_harness")  # meanwhile: seconds of SGLang imports
                for future in started:
                    if future.exception() is not None:
                        raise LiveError(f"a live node did not start: {future.exception()}")
                def one(job) -> LiveRow:
                    (trace, policy, capacity), runner = job
                    return _replay_one(trace, runner.runtime_dir, runner.config_path, policy, capacity, flat,
                                       keys[id(trace)], progress, clear=False)
                chunk_rows = _all(pool, one, list(zip(chunk, runners)))
            finally:
                _all(pool, lambda r: r.stop(), runners)
            for row in chunk_rows:
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def replay_running(trace: Trace, runtime_dir: Optional[str], config_path: Optional[str], flat: bool = False,
                   progress: Optional[Callable[[int], None]] = None) -> LiveRow:
    """Replay against daemons already running; the point is the top tier's policy and capacity in pages."""
    from tiers.ops.config import load_config
    node = load_config(config_path, runtime_dir=runtime_dir)
    top = node.tiers[0]
    blocks = top.capacity // page_bytes()
    if top.kind == "dram":  # pages take whole blocks of the arena
        block = int(top.options.get("block_size", page_bytes()))
        blocks = (top.capacity // block) // -(-page_bytes() // block)
    capacity = Capacity(label=f"{blocks}b", blocks=blocks)
    return _replay_one(trace, node.runtime_dir, config_path, top.policy, capacity, flat, page_keys(trace), progress,
                       clear=True)


def _replay_one(trace: Trace, runtime_dir: str, config_path: Optional[str], policy: str, capacity: Capacity,
                flat: bool, keys: List[str], progress, clear: bool) -> LiveRow:
    engine = LiveEngine(runtime_dir, config_path, max_request_blocks(trace))
    try:
        if clear:
            engine.clear()
        run = replay(trace, engine, keys, progress)
        stats = next(iter(engine.tier_stats().values()), None)  # the top tier's
    finally:
        engine.close()
    row = live_row(trace, run, policy, capacity, flat, stats)
    row.live_run = run  # per-request and per-access detail, kept out of the JSON/CSV columns
    return row
