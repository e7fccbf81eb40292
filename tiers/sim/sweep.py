"""Policies x capacities over one trace: result rows, the infinite-cache ceiling, throughput."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from tiers.sim import kernels
from tiers.sim.capacity import Capacity
from tiers.sim.simulate import Score, access_hits, infinite_hits, policy_hits, score, stack_distances, stack_sweep
from tiers.sim.trace import Trace


@dataclass
class Row:
    """One policy at one capacity."""

    policy: str
    capacity: str
    capacity_blocks: int
    capacity_tokens: int
    token_hit_rate: float
    block_hit_rate: float
    ceiling_fraction: float  # token hit rate over the infinite-cache token hit rate
    requests: int
    accesses: int
    hit_blocks: int
    hit_tokens: int
    flat: bool
    engine: str
    seconds: float

    def as_dict(self) -> dict:
        """The row as a JSON/CSV-ready dict."""
        return asdict(self)


def engine_for(policy: str, engine: str) -> str:
    """The engine 'auto' resolves to for policy: stack for LRU, kernel when built, else policy."""
    if engine != "auto":
        return engine
    if kernels.available() is not None:
        return "stack" if policy == "lru" else "policy"
    return "stack" if policy == "lru" else ("kernel" if policy in kernels.KERNEL_POLICIES else "policy")


def ceiling(trace: Trace, flat: bool = False) -> Score:
    """The infinite-cache score (the best any policy can do)."""
    return score(trace, infinite_hits(trace), flat=flat)


def run_sweep(trace: Trace, policies: Sequence[str], capacities: Sequence[Capacity], flat: bool = False,
              engine: str = "auto", progress: Optional[Callable[[int], None]] = None) -> List[Row]:
    """Score every policy at every capacity; progress(n) is called with accesses simulated."""
    best = ceiling(trace, flat)
    tokens = trace.block_tokens_per_access()
    parents = trace.parents()
    rows: List[Row] = []
    for policy in policies:
        chosen = engine_for(policy, engine)
        if chosen == "stack":
            if policy != "lru":
                raise ValueError("the stack engine is exact for lru only")
            start = time.perf_counter()
            scores = stack_sweep(trace, [c.blocks for c in capacities], flat=flat)
            share = (time.perf_counter() - start) / max(len(capacities), 1)
            timed = [(c, scores[c.blocks], share) for c in capacities]
            if progress:
                progress(trace.n_accesses * len(capacities))
        else:
            timed = []
            for capacity in capacities:
                start = time.perf_counter()
                hits = access_hits(trace, policy, capacity.blocks, engine=chosen, parents=parents)
                timed.append((capacity, score(trace, hits, flat=flat, tokens=tokens), time.perf_counter() - start))
                if progress:
                    progress(trace.n_accesses)
        for capacity, result, seconds in timed:
            rows.append(Row(policy=policy, capacity=capacity.label, capacity_blocks=capacity.blocks,
                            capacity_tokens=capacity.blocks * trace.block_tokens,
                            token_hit_rate=result.token_hit_rate, block_hit_rate=result.block_hit_rate,
                            ceiling_fraction=result.token_hit_rate / best.token_hit_rate if best.token_hit_rate else 0.0,
                            requests=trace.n_requests, accesses=trace.n_accesses, hit_blocks=result.hit_blocks,
                            hit_tokens=result.hit_tokens, flat=flat, engine=chosen, seconds=seconds))
    return rows


def bench(trace: Trace, policies: Sequence[str], capacities: Sequence[Capacity], repeat: int = 3,
          reference_points: int = 1) -> List[Dict[str, object]]:
    """Accesses per second per policy and capacity point, for each engine (best of repeat)."""
    parents = trace.parents()
    results: List[Dict[str, object]] = []

    def record(policy: str, engine: str, points: int, seconds: float) -> None:
        results.append({"policy": policy, "engine": engine, "capacity_points": points, "seconds": seconds,
                        "accesses_per_s": trace.n_accesses * points / seconds if seconds else float("inf")})

    blocks = [c.blocks for c in capacities]
    if "lru" in policies:
        many = sorted(set(np.geomspace(1, max(trace.n_keys, 1), 1000).astype(int).tolist()))
        for points in (blocks, many):
            best = min(_timed(lambda: stack_sweep(trace, points, distances=stack_distances(trace)))
                       for _ in range(repeat))
            record("lru", "stack", len(points), best)
        seconds = _libcachesim_seconds(trace, blocks[0])
        if seconds:
            record("lru", "libCacheSim", 1, seconds)
    for policy in policies:
        if kernels.available() is None and policy in kernels.KERNEL_POLICIES:
            best = min(_timed(lambda: [kernels.run(policy, trace.keys, parents, trace.n_keys, b) for b in blocks])
                       for _ in range(repeat))
            record(policy, "kernel", len(blocks), best)
        few = blocks[:reference_points]
        seconds = _timed(lambda: [policy_hits(policy, trace.keys, parents, b) for b in few])
        record(policy, "policy", len(few), seconds)
    return results


def _libcachesim_seconds(trace: Trace, capacity: int) -> Optional[float]:
    """Seconds libCacheSim's C LRU takes over the flattened accesses (None when it is not installed)."""
    try:
        import libcachesim
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "blocks.txt")
        with open(path, "w", encoding="ascii") as handle:
            handle.write("\n".join(str(k + 1) for k in trace.keys.tolist()) + "\n")
        reader = libcachesim.TraceReader(path, trace_type=libcachesim.TraceType.PLAIN_TXT_TRACE)
        cache = libcachesim.LRU(max(capacity, 1))
        return _timed(lambda: cache.process_trace(reader))


def _timed(work: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
