"""Cross-check with libCacheSim: flat-mode hit counts on the flattened block access sequence."""
from __future__ import annotations

import pytest

from tests.support.sim import TRACE_DIR, conversation_like
from tiers.sim import simulate
from tiers.sim.trace import read_traces

lcs = pytest.importorskip("libcachesim", reason="libcachesim is not installed (pip install libcachesim)")

CACHES = {"lru": "LRU", "fifo": "FIFO", "lfu": "LFU"}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(name, trace, capacities, block-id file): the seeded synthetic chats, and the conversation trace if present."""
    found = [("synthetic-chats", conversation_like(), (16, 64, 150))]
    path = TRACE_DIR / "conversation_trace.jsonl"
    if path.exists():
        found.append(("conversation", read_traces([str(path)]), (1953, 19531)))
    out = []
    for name, trace, capacities in found:
        blocks = tmp_path_factory.mktemp("lcs") / f"{name}.txt"
        blocks.write_text("\n".join(str(k + 1) for k in trace.keys.tolist()) + "\n")  # libCacheSim ids from 1
        out.append((name, trace, capacities, str(blocks)))
    return out


def libcachesim_hits(path: str, n_accesses: int, cache_name: str, capacity: int) -> int:
    """Hits of a libCacheSim cache holding capacity unit-size objects over the block-id file."""
    reader = lcs.TraceReader(path, trace_type=lcs.TraceType.PLAIN_TXT_TRACE)
    miss_ratio = getattr(lcs, cache_name)(capacity).process_trace(reader)[0]
    return round((1.0 - miss_ratio) * n_accesses)


@pytest.mark.parametrize("policy", sorted(CACHES))
def test_flat_hits_equal_libcachesim(cases, policy):
    for name, trace, capacities, path in cases:
        swept = simulate.stack_sweep(trace, capacities, flat=True) if policy == "lru" else {}
        for capacity in capacities if policy != "lfu" else capacities[-1:]:  # lfu: a bonus, kept short
            theirs = libcachesim_hits(path, trace.n_accesses, CACHES[policy], capacity)
            ours = simulate.score(trace, simulate.access_hits(trace, policy, capacity), flat=True).hit_blocks
            assert ours == theirs, f"{policy} on {name} at {capacity} blocks"
            if swept:  # the one-pass LRU sweep too
                assert swept[capacity].hit_blocks == theirs
