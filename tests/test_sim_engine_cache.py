"""The simulator's GPU pool (tiers/sim/radix_tree.py) against SGLang 0.5.23's own RadixCache, request by request.

SGLang's RadixCache builds on CPU (``create_simulated``). Both are driven the
way the scheduler drives a tree: match the request's prefix, lock its last
node, evict what the new tokens need beyond the free room, insert, unlock.
One token per block, so SGLang's tree sees the block ids as tokens. Every
request's device hit must be equal, and both trees must hold the same tokens.
"""
from __future__ import annotations

from array import array

import pytest

from test_sim_live import conversation_slice, shared_prefix_trace
from tiers.sim.radix_tree import BlockRadixTree

radix_cache = pytest.importorskip("sglang.srt.mem_cache.radix_cache")
base = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
torch = pytest.importorskip("torch")


class _Allocator:
    """What RadixCache asks of a KV allocator when it evicts: nothing to free here."""

    device = "cpu"

    def free_segment(self, *args, **kwargs):
        pass


def sglang_device_hits(requests, capacity):
    """Device prefix per request from SGLang's RadixCache holding at most capacity tokens."""
    cache = radix_cache.RadixCache.create_simulated(mock_allocator=_Allocator(), page_size=1)
    hits = []
    for blocks in requests:
        key = radix_cache.RadixKey(token_ids=array("q", blocks))
        match = cache.match_prefix(base.MatchPrefixParams(key=key))
        hits.append(match.device_prefix_len)
        node = match.last_device_node
        cache.inc_lock_ref(node)
        need = len(blocks) - match.device_prefix_len
        free = capacity - cache.evictable_size() - cache.protected_size()
        if need > free:
            cache.evict(base.EvictParams(num_tokens=need - free))
        cache.insert(base.InsertParams(key=radix_cache.RadixKey(token_ids=array("q", blocks)),
                                       value=torch.arange(len(blocks), dtype=torch.int64)))
        cache.dec_lock_ref(node)
    return hits, cache.evictable_size() + cache.protected_size()


def simulated_device_hits(requests, capacity):
    """The same with the simulator's tree (no host pool: a GPU-only engine)."""
    tree = BlockRadixTree(device_tokens=capacity, host_tokens=0)
    hits = []
    for blocks in requests:
        path, on_device = tree.match(blocks)
        hits.append(sum(node.size for node in path[:on_device]))
        matched = sum(len(node.blocks) for node in path)
        last = path[-1] if path else tree.root
        tree.insert(last, blocks[matched:], [1] * (len(blocks) - matched))
    return hits, tree.device_used


def _requests(trace):
    keys = trace.keys.tolist()
    offsets = trace.offsets.tolist()
    return [[k + 1 for k in keys[offsets[r]:offsets[r + 1]]] for r in range(trace.n_requests)]


@pytest.mark.parametrize("capacity", [40, 80, 150, 400])
def test_device_hits_equal_sglang_radix_cache_shared_prefixes(capacity):
    requests = _requests(shared_prefix_trace())
    assert max(len(r) for r in requests) <= capacity  # SGLang would retract a longer one; not modelled
    sglang, held_sglang = sglang_device_hits(requests, capacity)
    simulated, held_simulated = simulated_device_hits(requests, capacity)
    assert sum(sglang) > 0
    assert simulated == sglang
    assert held_simulated == held_sglang <= capacity


@pytest.mark.parametrize("capacity", [300, 1000])
def test_device_hits_equal_sglang_radix_cache_conversation(capacity):
    requests = _requests(conversation_slice())
    sglang, held_sglang = sglang_device_hits(requests, capacity)
    simulated, held_simulated = simulated_device_hits(requests, capacity)
    assert sum(sglang) > 0
    mismatched = [i for i, (a, b) in enumerate(zip(simulated, sglang)) if a != b]
    assert not mismatched, f"requests {mismatched[:5]} differ: simulated {[simulated[i] for i in mismatched[:5]]}, " \
                           f"SGLang {[sglang[i] for i in mismatched[:5]]}"
    assert held_simulated == held_sglang
