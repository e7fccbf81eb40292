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


# ---------------------------------------------------------------- host backups
# SGLang's HiCache tree core (UnifiedTreeCore, FullComponent) builds on CPU the way SGLang's own CPU
# tests build it (test/registered/unit/mem_cache: a SimpleNamespace cache, no pools). It decides which
# nodes a write policy backs up (BackupKV actions); the cache would then copy them to host. Here the
# copy is marked done at once (a host value on the node), as a finished write-through ack leaves it.
unified = pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_tree_core")
full_component = pytest.importorskip("sglang.srt.mem_cache.unified_cache.components.full")
cache_action = pytest.importorskip("sglang.srt.mem_cache.unified_cache.cache_action")
components = pytest.importorskip("sglang.srt.mem_cache.unified_cache.component_type")
init_params = pytest.importorskip("sglang.srt.mem_cache.cache_init_params")


def sglang_backups(requests, write_policy):
    """Per request, the token runs SGLang's tree core backs up to host (no eviction: ample pools)."""
    from types import SimpleNamespace
    params = init_params.CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                         page_size=1)
    full = components.ComponentType.FULL
    core = unified.UnifiedTreeCore(params, {full: full_component.FullComponent(
        SimpleNamespace(enable_session_radix_cache=False), params)})
    core.enable_hicache = True
    core.enable_storage = True
    core.is_write_back = write_policy == "write_back"
    core.write_through_threshold = 1 if write_policy == "write_through" else 2
    out = []
    for blocks in requests:
        key = radix_cache.RadixKey(token_ids=array("q", blocks))
        core.match_prefix(base.MatchPrefixParams(key=key))
        step = core.begin_insert(base.InsertParams(key=radix_cache.RadixKey(token_ids=array("q", blocks)),
                                                   value=torch.arange(1, len(blocks) + 1, dtype=torch.int64)))
        actions = list(step.actions)
        while core.has_ongoing_insert():
            actions += list(core.resume_insert().actions)
        actions += list(core.end_insert())
        backed = []
        for action in actions:
            if isinstance(action, cache_action.BackupKV):
                for node_id in action.node_ids:
                    node = core.node_by_id(node_id)
                    node.component_data[full].host_value = torch.arange(len(node.key), dtype=torch.int64)
                    backed.append(tuple(node.key.token_ids))
        out.append(sorted(backed))
    return out


def simulated_backups(requests, write_policy):
    """The same from the simulator's tree (its on_backup reports)."""
    backed = []
    tree = BlockRadixTree(device_tokens=10**9, host_tokens=10**9, write_policy=write_policy,
                          on_backup=lambda blocks, parent: backed.append(tuple(blocks)))
    out = []
    for blocks in requests:
        path, _ = tree.match(blocks)
        matched = sum(len(node.blocks) for node in path)
        tree.count_walk(path)
        tree.insert(path[-1] if path else tree.root, blocks[matched:], [1] * (len(blocks) - matched))
        out.append(sorted(backed))
        backed.clear()
    return out


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("source", ["shared-prefix", "conversation"])
def test_host_backups_equal_sglang_tree_core(write_policy, source):
    requests = _requests(shared_prefix_trace() if source == "shared-prefix" else conversation_slice())
    sglang = sglang_backups(requests, write_policy)
    simulated = simulated_backups(requests, write_policy)
    if write_policy == "write_back":
        assert not any(sglang)  # nothing at insert: write_back backs up at eviction
    else:  # selective backs up only what a second request walked: fewer
        assert sum(map(len, sglang)) > (20 if write_policy == "write_through" else 5)
    mismatched = [i for i, (a, b) in enumerate(zip(simulated, sglang)) if a != b]
    assert not mismatched, f"request {mismatched[0]}: simulated {simulated[mismatched[0]]}, SGLang {sglang[mismatched[0]]}"
