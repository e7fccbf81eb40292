"""Trace reader, simulation loop, stack-distance sweep, capacities and the replay command."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.sim import HAND_REQUESTS, conversation_like, write_jsonl
from tiers.plugins import policy_names
from tiers.sim import simulate
from tiers.sim.capacity import parse_capacities, parse_capacity
from tiers.sim.trace import from_requests, read_traces


# ------------------------------------------------------------------ trace
def test_reader_flattens_and_numbers_keys_by_first_appearance(tmp_path):
    trace = read_traces([write_jsonl(tmp_path / "t.jsonl", HAND_REQUESTS)])
    assert trace.n_requests == 5 and trace.n_accesses == 12 and trace.n_keys == 6
    assert trace.offsets.tolist() == [0, 3, 6, 8, 11, 12]
    assert trace.keys.tolist() == [0, 1, 2, 0, 1, 3, 4, 5, 0, 1, 2, 4]
    assert trace.parents().tolist() == [-1, 0, 1, -1, 0, 1, -1, 4, -1, 0, 1, -1]
    assert trace.block_tokens_per_access().tolist() == [512, 512, 176, 512, 512, 76, 512, 88, 512, 512, 476, 512]


def test_two_files_are_namespaced_and_merged_by_timestamp(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [(0, 512, [0]), (20, 1024, [0, 1])])
    second = write_jsonl(tmp_path / "b.jsonl", [(10, 512, [0]), (20, 512, [0])])
    trace = read_traces([first, second])
    assert trace.timestamps.tolist() == [0, 10, 20, 20]  # ties: the earlier file first
    assert trace.keys.tolist() == [0, 1, 0, 2, 1]  # id 0 of file b is not id 0 of file a
    assert simulate.score(trace, simulate.infinite_hits(trace)).hit_blocks == 2


def test_reader_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_traces([str(path)])


# ------------------------------------------------------------- capacities
def test_capacity_syntax():
    assert parse_capacity("3Mt", 512).blocks == 5859
    assert parse_capacity("50M tokens", 512).blocks == 97656
    assert parse_capacity("100kb", 512).blocks == 100_000
    assert parse_capacity("1.5k blocks", 512).blocks == 1500
    assert parse_capacity("1024t", 256).blocks == 4
    assert [c.blocks for c in parse_capacities("1Mt, 2b", 512)] == [1953, 2]
    for bad in ("3M", "3", "3Mx", "t", "-1b"):
        with pytest.raises(ValueError, match="t/tokens or b/blocks"):
            parse_capacity(bad, 512)


# ------------------------------------------------------------- replay loop
def test_hand_worked_lru_replay():
    """LRU, 4 blocks: r1 hits 1,2 (1024 tokens); r2 and r3 push everything else out; nothing else hits."""
    trace = from_requests(HAND_REQUESTS)
    hits = simulate.access_hits(trace, "lru", 4, engine="policy")
    assert hits.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    result = simulate.score(trace, hits)
    assert (result.hit_blocks, result.hit_tokens, result.blocks, result.tokens) == (2, 1024, 12, 4912)
    best = simulate.score(trace, simulate.infinite_hits(trace))
    # r1: 2 blocks = 1024 tokens; r3: 3 blocks, min(1536, 1500); r4: 1 block = 512
    assert (best.hit_blocks, best.hit_tokens) == (6, 3036)


def test_prefix_rule_counts_only_the_leading_run():
    trace = from_requests([(0, 1536, [1, 2, 3]), (1, 512, [9]), (2, 1536, [7, 2, 3])])
    hits = simulate.access_hits(trace, "lru", 10)
    assert hits.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert simulate.score(trace, hits).hit_blocks == 0
    assert simulate.score(trace, hits, flat=True).hit_blocks == 2


# pinned: conversation_like() (seed 2024: 300 requests, 9,465 accesses, 217 blocks), Python policy classes
PINNED = {  # policy: {capacity: (flat hits, leading-run hit blocks, leading-run hit tokens)}
    "fifo": {16: (47, 41, 20992), 64: (4910, 4684, 2375626)},
    "lfu": {16: (1978, 1978, 1012736), 64: (7274, 7274, 3689876)},
    "lru": {16: (53, 53, 27136), 64: (4860, 4860, 2463996)},
    "radix-lru": {16: (126, 126, 64512), 64: (6402, 6402, 3253500)},
    "s3fifo": {16: (1287, 96, 49152), 64: (6824, 6248, 3167614)},
}


@pytest.mark.parametrize("policy", sorted(PINNED))
@pytest.mark.parametrize("engine", ["policy", "auto"])
def test_pinned_replay(policy, engine):
    trace = conversation_like()
    assert (trace.n_requests, trace.n_accesses, trace.n_keys) == (300, 9465, 217)
    for capacity, expected in PINNED[policy].items():
        hits = simulate.access_hits(trace, policy, capacity, engine=engine)
        result = simulate.score(trace, hits)
        assert (int(hits.sum()), result.hit_blocks, result.hit_tokens) == expected


def test_pinned_covers_every_registered_policy():
    assert sorted(PINNED) == policy_names()


def test_infinite_ceiling_of_the_synthetic_trace():
    best = simulate.score(conversation_like(), simulate.infinite_hits(conversation_like()))
    assert (best.hit_blocks, best.hit_tokens, best.tokens) == (9248, 4689264, 4771936)


def test_zero_capacity_never_hits():
    assert not simulate.access_hits(conversation_like(), "s3fifo", 0, engine="policy").any()


# ------------------------------------------------------------- stack sweep
@pytest.mark.parametrize("flat", [False, True])
def test_stack_sweep_equals_per_capacity_simulation(flat):
    trace = conversation_like()
    capacities = list(range(0, trace.n_keys + 3))
    swept = simulate.stack_sweep(trace, capacities, flat=flat)
    for capacity in capacities:
        hits = simulate.access_hits(trace, "lru", capacity, engine="kernel")
        direct = simulate.score(trace, hits, flat=flat)
        assert (swept[capacity].hit_blocks, swept[capacity].hit_tokens) == (direct.hit_blocks, direct.hit_tokens)
    for capacity in (1, 7, 30, 100):  # and against the Python class itself
        direct = simulate.score(trace, simulate.access_hits(trace, "lru", capacity, engine="policy"), flat=flat)
        assert swept[capacity].hit_tokens == direct.hit_tokens


def test_compiled_and_python_stack_distances_agree():
    trace = conversation_like(seed=5, requests=500)
    compiled = simulate.stack_distances(trace)
    assert np.array_equal(compiled, simulate.python_stack_distances(trace.keys.tolist(), trace.n_keys))
    assert simulate.python_stack_distances([7, 8, 7, 9, 8, 8], 3).tolist() == [3, 3, 1, 3, 2, 0]


# --------------------------------------------------- the daemon's own store
@pytest.mark.parametrize("policy", policy_names())
def test_dram_store_hits_equal_the_simulation(policy):
    """DramStore (the DRAM daemon's store) driven by the trace hits exactly where the simulator says."""
    from tiers.stores.dram import DramStore

    trace = conversation_like(requests=120)
    capacity, page = 24, 4096
    store = DramStore(capacity=capacity * page, policy=policy, block_size=page)
    payload = memoryview(bytearray(page))
    try:
        store_hits = []
        keys, parents = trace.keys.tolist(), trace.parents().tolist()
        for key, parent in zip(keys, parents):
            name = ("trace", str(key))
            hit = store.get_bytes(name) is not None
            if not hit:
                store.put(name, [payload], parent=None if parent < 0 else str(parent))
            store_hits.append(hit)
    finally:
        store.close()
    simulated = simulate.access_hits(trace, policy, capacity, engine="policy")
    assert store_hits == simulated.tolist()
    assert np.array_equal(simulated, simulate.access_hits(trace, policy, capacity))  # and the fast engine
