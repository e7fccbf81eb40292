"""The one simulation loop: a shared block cache driven the way tiers/stores/dram.py drives its policy.

Requests arrive in timestamp order.  Each block of a request is accessed in
order: a resident block is a hit and touches the policy; a missing block first
makes room (pop_victim while the cache holds ``capacity`` blocks) and is then
inserted with its parent, the previous block of the request.  Touches never
evict, so the blocks present when a request arrives that form its leading
run are exactly its leading run of per-access hits: the prefix rule is
applied to the per-access hit flags afterwards (``score``).

Engines giving those flags, all exact for the daemon's policy classes:
- ``policy``: the Python loop over the registered class itself (the reference);
- ``kernel``: the compiled twin in kernels.c, checked against the class access
  by access in tests/test_sim_kernels.py;
- ``stack``: LRU only, every capacity from one pass of stack distances.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import numpy as np

from tiers.plugins import make_policy
from tiers.sim import kernels
from tiers.sim.trace import Trace

ENGINES = ("auto", "kernel", "policy")


def policy_hits(policy_name: str, keys: np.ndarray, parents: np.ndarray, capacity: int, **options) -> np.ndarray:
    """Per-access hit flags from the registered policy class itself (the reference engine)."""
    policy = make_policy(policy_name, **options)
    touch, insert, pop_victim = policy.touch, policy.insert, policy.pop_victim
    resident = set()  # the store's index: the policy owns no data, the store does
    add, discard = resident.add, resident.discard
    hits = np.zeros(len(keys), dtype=bool)
    for i, (key, parent) in enumerate(zip(keys.tolist(), parents.tolist())):
        if key in resident:
            hits[i] = True
            touch(key)
            continue
        if capacity <= 0:
            continue
        while len(resident) >= capacity:
            discard(pop_victim())
        insert(key, None if parent < 0 else parent)
        add(key)
    return hits


def access_hits(trace: Trace, policy_name: str, capacity: int, engine: str = "auto",
                parents: Optional[np.ndarray] = None, **options) -> np.ndarray:
    """Per-access hit flags of policy at capacity (blocks), by the chosen engine."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    make_policy(policy_name, **options)  # ValueError for unknown names or options
    parents = trace.parents() if parents is None else parents
    if engine == "kernel" or (engine == "auto" and policy_name in kernels.KERNEL_POLICIES
                              and kernels.available() is None):
        return kernels.run(policy_name, trace.keys, parents, trace.n_keys, capacity, **options)
    return policy_hits(policy_name, trace.keys, parents, capacity, **options)


def infinite_hits(trace: Trace) -> np.ndarray:
    """Per-access hit flags of an unbounded cache: every access but a key's first."""
    hits = np.ones(trace.n_accesses, dtype=bool)
    hits[np.unique(trace.keys, return_index=True)[1]] = False
    return hits


def leading_run(trace: Trace, hits: np.ndarray) -> np.ndarray:
    """Per access, whether it lies in its request's leading run of hits."""
    misses = np.concatenate([[0], np.cumsum(~hits)])
    request = np.repeat(np.arange(trace.n_requests), np.diff(trace.offsets))
    return misses[1:] == misses[trace.offsets[:-1]][request]


@dataclass
class Score:
    """Hit counts of one run over a trace."""

    hit_blocks: int
    hit_tokens: int
    blocks: int
    tokens: int

    @property
    def block_hit_rate(self) -> float:
        """Hit blocks over accessed blocks."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Hit tokens over input tokens."""
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def score(trace: Trace, hits: np.ndarray, flat: bool = False, tokens: Optional[np.ndarray] = None) -> Score:
    """Count hits: a request's leading run of hits (prefix rule), or every hit with flat=True."""
    tokens = trace.block_tokens_per_access() if tokens is None else tokens
    counted = hits if flat else leading_run(trace, hits)
    return Score(hit_blocks=int(counted.sum()), hit_tokens=int(tokens[counted].sum()),
                 blocks=trace.n_accesses, tokens=int(trace.input_lengths.sum()))


def stack_sweep(trace: Trace, capacities: Iterable[int], flat: bool = False,
                distances: Optional[np.ndarray] = None) -> Dict[int, Score]:
    """LRU scores at every capacity from one pass: an access hits at C iff its stack distance < C.

    With the prefix rule, block i of a request is in the leading run at C iff
    the running maximum of the request's distances up to i is < C.
    """
    capacities = list(capacities)
    distances = stack_distances(trace) if distances is None else distances
    if not flat and trace.n_accesses:
        # running maximum within each request: lift request r by r * (n_keys + 1), then one global max-scan
        request = np.repeat(np.arange(trace.n_requests, dtype=np.int64), np.diff(trace.offsets))
        lift = request * (trace.n_keys + 1)
        distances = np.maximum.accumulate(distances + lift) - lift
    tokens = trace.block_tokens_per_access()
    order = np.argsort(distances, kind="stable")
    sorted_distances = distances[order]
    cumulative_tokens = np.concatenate([[0], np.cumsum(tokens[order])])
    total_tokens = int(trace.input_lengths.sum())
    scores = {}
    for capacity in capacities:
        # a first access has distance n_keys: a miss at every capacity, even one above n_keys
        count = int(np.searchsorted(sorted_distances, min(max(int(capacity), 0), trace.n_keys), side="left"))
        scores[capacity] = Score(hit_blocks=count, hit_tokens=int(cumulative_tokens[count]),
                                 blocks=trace.n_accesses, tokens=total_tokens)
    return scores


def stack_distances(trace: Trace) -> np.ndarray:
    """LRU stack distance per access (n_keys for a key's first access); compiled, or Python if no compiler."""
    if kernels.available() is None:
        return kernels.stack_distances(trace.keys, trace.n_keys)
    return python_stack_distances(trace.keys.tolist(), trace.n_keys)


def python_stack_distances(keys: List[int], n_keys: int) -> np.ndarray:
    """Stack distances with a Fenwick tree over access times, in Python (slow fallback and test oracle)."""
    n = len(keys)
    tree = [0] * (n + 1)
    last = {}
    out = np.empty(n, dtype=np.int64)
    for t, key in enumerate(keys):
        p = last.get(key)
        if p is None:
            out[t] = n_keys
        else:
            count, j = 0, t
            while j > 0:
                count += tree[j]
                j -= j & -j
            j = p + 1
            while j > 0:
                count -= tree[j]
                j -= j & -j
            out[t] = count
            j = p + 1
            while j <= n:
                tree[j] -= 1
                j += j & -j
        j = t + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
        last[key] = t
    return out
