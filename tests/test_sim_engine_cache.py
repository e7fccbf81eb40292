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

from tests.support.sim import conversation_slice, shared_prefix_trace
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


# ------------------------------------------------------- the host pool (HiCache)
# SGLang's HiCache tree core (UnifiedTreeCore with a FullComponent) builds on CPU the way SGLang's own
# CPU tests build it (test/registered/unit/mem_cache: a SimpleNamespace cache, no pools). It decides
# every eviction, demotion, duplicate reclaim and write-policy backup; SGLangHiCache below makes the
# calls UnifiedRadixCache makes around it (its _evict_components, _execute_kv_backup, load_back and
# the write-through acks), with host indices that are only counted.
unified = pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_tree_core")
full_component = pytest.importorskip("sglang.srt.mem_cache.unified_cache.components.full")
cache_action = pytest.importorskip("sglang.srt.mem_cache.unified_cache.cache_action")
components = pytest.importorskip("sglang.srt.mem_cache.unified_cache.component_type")
init_params = pytest.importorskip("sglang.srt.mem_cache.cache_init_params")


class SGLangHiCache:
    """SGLang's HiCache tree core with a GPU pool of device_cap and a host pool of host_cap tokens."""

    def __init__(self, device_cap, host_cap, write_policy):
        from types import SimpleNamespace
        self.full = components.ComponentType.FULL
        params = init_params.CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                             page_size=1)
        self.core = unified.UnifiedTreeCore(params, {self.full: full_component.FullComponent(
            SimpleNamespace(enable_session_radix_cache=False), params)})
        self.core.enable_hicache = True
        self.core.is_write_back = write_policy == "write_back"
        self.core.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.device_cap, self.host_cap, self.host_used = device_cap, host_cap, 0
        self.backed = []

    def _drain(self, result, tracker=None):
        """Consume a tree step: count the host slots it freed (the pools are not real)."""
        self.host_used -= sum(len(t) for t in result.host_frees.get(self.full, []))
        if tracker is not None:
            for component, n in result.tracker.items():
                tracker[component] = tracker.get(component, 0) + n
        actions = list(result.cache_actions)
        result.device_frees.clear()
        result.host_frees.clear()
        result.cache_actions.clear()
        return actions

    def _device_used(self):
        return self.core.full_evictable_size() + self.core.full_protected_size()

    def _evict_device(self, need):
        """UnifiedRadixCache._evict_components for the Full component."""
        core, tracker = self.core, {self.full: 0}
        core.evict_device_start(self.full, need)
        try:
            while tracker[self.full] < need:
                step = core.evict_device_next_node(self.full, tracker)
                self._drain(step, tracker)
                if step.node_id is None:
                    if not step.made_progress:
                        break
                    continue
                leaf = core.evict_device_leaf(step.node_id, core.is_write_back)
                self._drain(leaf, tracker)
                if leaf.backup_kv is not None:  # write_back: back up, then demote, or drop
                    after = (core.demote(step.node_id) if self._backup(leaf.backup_kv.node_ids)
                             else core.drop_subtree_no_host(step.node_id))
                    self._drain(after, tracker)
        finally:
            core.evict_device_end(self.full)

    def _backup(self, node_ids):
        """_execute_kv_backup: room on host (evict_host), then the copy, acknowledged at once."""
        for node_id in node_ids:
            node = self.core.node_by_id(node_id)
            size = len(node.key)
            if self.host_used + size > self.host_cap:
                self._drain(self.core.drive_host_eviction(self.full, self.host_used + size - self.host_cap))
                if self.host_used + size > self.host_cap:
                    return False
            self.core.commit_backup(node_id, torch.arange(size, dtype=torch.int64), {})
            self.host_used += size
            self.backed.append(tuple(node.key.token_ids))
        return True

    def request(self, blocks):
        """match_prefix, load_back of the host part, evict for the rest, insert, backups: (device, host)."""
        core = self.core
        match = core.match_prefix(base.MatchPrefixParams(key=radix_cache.RadixKey(token_ids=array("q", blocks))))
        anchor, node, matched = match.last_host_node, core.node_by_id(match.last_host_node), 0
        while node is not core.root_node:
            matched += len(node.key)
            node = node.parent
        device, host = match.device_prefix_len, matched - match.device_prefix_len
        if host:
            kv_xfer, aux = core.build_load_back_spec(anchor)
            host_lock = core.inc_host_lock_ref(anchor)
            lock = core.inc_lock_ref(anchor)
            short = self._device_used() + len(kv_xfer.host_indices) - self.device_cap
            if short > 0:
                self._evict_device(short)
            loaded = torch.arange(len(kv_xfer.host_indices), dtype=torch.int64)
            self._apply(core.commit_load_back(anchor, loaded, kv_xfer, aux))
            core.dec_lock_ref(anchor, lock.to_dec_params())
            core.dec_host_lock_ref(anchor, host_lock.to_dec_params())
            core.finish_load_back(anchor)
        lock = core.inc_lock_ref(anchor)
        short = self._device_used() + len(blocks) - matched - self.device_cap
        if short > 0:
            self._evict_device(short)
        step = core.begin_insert(base.InsertParams(key=radix_cache.RadixKey(token_ids=array("q", blocks)),
                                                   value=torch.arange(1, len(blocks) + 1, dtype=torch.int64)))
        actions = list(step.actions)
        while core.has_ongoing_insert():
            actions += list(core.resume_insert().actions)
        actions += list(core.end_insert())
        core.dec_lock_ref(anchor, lock.to_dec_params())
        self._apply(actions)
        return device, host

    def _apply(self, actions):
        for action in actions:
            if isinstance(action, cache_action.BackupKV):
                self._backup(action.node_ids)


def sglang_hierarchy(requests, device_cap, host_cap, write_policy):
    """Per request: (device hit, host hit, runs backed up to host) from SGLang's tree core."""
    cache = SGLangHiCache(device_cap, host_cap, write_policy)
    out = []
    for blocks in requests:
        device, host = cache.request(blocks)
        out.append((device, host, sorted(cache.backed)))
        cache.backed.clear()
    return out


def simulated_hierarchy(requests, device_cap, host_cap, write_policy):
    """The same from the simulator's tree, driven as tiers/sim/hierarchy.py drives it (no L3)."""
    backed = []
    tree = BlockRadixTree(device_cap, host_cap, write_policy, on_backup=lambda blocks, parent: backed.append(tuple(blocks)))
    out = []
    for blocks in requests:
        path, on_device = tree.match(blocks)
        device = sum(node.size for node in path[:on_device])
        host = sum(node.size for node in path[on_device:])
        last = path[-1] if path else tree.root
        tree.lock(last)
        if host:
            tree.pin_host(last)
            assert tree.load_back(path[on_device:])
            tree.unpin_host(last)
        tree.count_walk(path)
        matched = sum(len(node.blocks) for node in path)
        tree.insert(last, blocks[matched:], [1] * (len(blocks) - matched))
        tree.unlock(last)
        out.append((device, host, sorted(backed)))
        backed.clear()
    return out


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("source,device_cap,host_cap", [("shared-prefix", 40, 80), ("shared-prefix", 40, 200),
                                                        ("shared-prefix", 80, 120), ("conversation", 300, 600),
                                                        ("conversation", 300, 1500)])
def test_gpu_and_host_pools_equal_sglang_hicache_tree(write_policy, source, device_cap, host_cap):
    requests = _requests(shared_prefix_trace() if source == "shared-prefix" else conversation_slice())
    sglang = sglang_hierarchy(requests, device_cap, host_cap, write_policy)
    simulated = simulated_hierarchy(requests, device_cap, host_cap, write_policy)
    if write_policy != "write_through_selective":  # (selective backs up little of the conversation slice)
        assert sum(r[1] for r in sglang) > 0  # host hits: demoted nodes were found again
        assert sum(len(r[2]) for r in sglang) > 20
    mismatched = [i for i, (a, b) in enumerate(zip(simulated, sglang)) if a != b]
    assert not mismatched, (f"{len(mismatched)} requests differ; request {mismatched[0]}: "
                            f"simulated {simulated[mismatched[0]]}, SGLang {sglang[mismatched[0]]}")
