"""replay --live: requests through the real SGLang backend against real DRAM daemons hit exactly as simulated."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from test_sim_cli import hand_trace, run as run_cli  # noqa: F401  (hand_trace is a fixture)
from test_sim_fixtures import HAND_REQUESTS, mooncake_trace
from hicache_ext.lab import live
from tiers.sim.capacity import Capacity
from tiers.sim.simulate import leading_run, policy_hits, score
from tiers.sim.trace import Trace, from_requests

# SGLang's import and 22 daemon processes: about 60 s of CPU, a minute or two of wall time on 2 loaded cores.
pytestmark = pytest.mark.slow

POLICIES = ("lru", "fifo", "lfu", "s3fifo", "radix-lru")
SMALL_CAPACITIES = (40, 150)  # blocks; the trace has 895 distinct blocks in 4,062 accesses
CONVERSATION_SLICE = (4100, 4300)  # requests of the conversation trace with some reuse inside the slice
CONVERSATION_CAPACITIES = (300, 1000)


def shared_prefix_trace(seed: int = 5, requests: int = 250) -> Trace:
    """System prompts, growing chats, hot blocks after fresh ones (non-leading hits), repeats (seeded)."""
    rng = random.Random(seed)
    systems = [[s * 100 + i for i in range(rng.randint(1, 4))] for s in range(6)]
    hot = [900_000 + i for i in range(8)]
    chats = {}
    fresh = iter(range(1_000_000, 2_000_000))
    rows = []
    for number in range(requests):
        chat = rng.randrange(25)
        history = chats.setdefault(chat, rng.choice(systems)[:])
        history.extend(next(fresh) for _ in range(rng.randint(1, 3)))
        del history[30:]
        blocks = history[:] + [next(fresh) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.3:  # a pasted document after new text: held, but not in the leading run
            blocks.insert(rng.randint(len(blocks) // 2, len(blocks)), rng.choice(hot))
        if rng.random() < 0.05:  # the same block twice in one request
            blocks.append(blocks[rng.randrange(len(blocks))])
        rows.append((number, len(blocks) * 16 - rng.randint(0, 15), blocks))
    return from_requests(rows, block_tokens=16, name="shared-prefix")


def conversation_slice() -> Trace:
    path = mooncake_trace("conversation")
    with open(path, encoding="utf-8") as handle:
        lines = handle.readlines()[slice(*CONVERSATION_SLICE)]
    rows = [json.loads(line) for line in lines]
    return from_requests([(r["timestamp"], r["input_length"], r["hash_ids"]) for r in rows], name="conversation")


@pytest.fixture(scope="module")
def live_rows():
    """Every (trace, policy, capacity) point on a fresh one-tier DRAM node of its own, all at once."""
    small = shared_prefix_trace()
    traces = [(small, SMALL_CAPACITIES)]
    try:
        traces.append((conversation_slice(), CONVERSATION_CAPACITIES))
    except pytest.skip.Exception:
        pass
    points = [(trace, policy, Capacity(f"{blocks}b", blocks))
              for trace, capacities in traces for policy in POLICIES for blocks in capacities]
    rows = live.replay_points(points, parallel=len(points))
    return {(trace.names[0], row.policy, row.capacity_blocks): (trace, row) for (trace, _, _), row in zip(points, rows)}


CASES = [(name, policy, blocks) for name, capacities in (("shared-prefix", SMALL_CAPACITIES),
                                                         ("conversation", CONVERSATION_CAPACITIES))
         for policy in POLICIES for blocks in capacities]


@pytest.mark.parametrize("name,policy,blocks", CASES)
def test_live_hits_equal_the_policy_class_access_by_access(live_rows, name, policy, blocks):
    if (name, policy, blocks) not in live_rows:
        pytest.skip("the conversation trace is not beside this checkout")
    trace, row = live_rows[(name, policy, blocks)]
    run = row.live_run
    expected = policy_hits(policy, trace.keys, trace.parents(), blocks)  # the daemon's own policy class
    want = score(trace, expected)
    # per request: the hit driver.exists() reported on arrival is the simulated leading run
    counted = np.concatenate([[0], np.cumsum(leading_run(trace, expected))])
    assert run.exists.tolist() == (counted[trace.offsets[1:]] - counted[trace.offsets[:-1]]).tolist()
    # per access: the daemon read (touched) exactly the blocks the simulator found resident
    assert np.array_equal(run.hits, expected)
    assert (row.hit_blocks, row.hit_tokens) == (want.hit_blocks, want.hit_tokens)
    assert (row.token_hit_rate, row.block_hit_rate) == (want.token_hit_rate, want.block_hit_rate)
    # the daemon's counters: a touch per hit, an insert per miss, and evictions happened
    assert (row.daemon_hits, row.daemon_inserts) == (int(expected.sum()), int((~expected).sum()))
    assert row.daemon_evictions >= row.daemon_inserts - blocks > 0
    assert row.matches_simulation and row.engine == "live" and row.requests_per_s > 0


def test_the_small_trace_exercises_non_leading_hits_and_repeats(live_rows):
    trace, row = live_rows[("shared-prefix", "lru", SMALL_CAPACITIES[1])]
    assert row.live_run.calls["blocks_held_after_a_miss"] > 0  # read in place after a missing block
    assert any(len(set(b)) < len(b) for b in np.split(trace.keys, trace.offsets[1:-1]))


def hand_hits(policy: str, blocks: int) -> int:
    trace = from_requests(HAND_REQUESTS)
    return score(trace, policy_hits(policy, trace.keys, trace.parents(), blocks)).hit_blocks


def test_cli_live_start_prints_the_table_and_writes_json(hand_trace, tmp_path, capsys):
    out = str(tmp_path / "live.json")
    assert run_cli(["replay", hand_trace, "--policy", "lru", "--capacity", "3b", "--live", "--start", "--quiet",
                    "--json", out]) == 0
    text = capsys.readouterr().out
    assert "requests/s" in text and "yes" in text and "token hit rate" in text
    (row,) = json.load(open(out))["rows"]
    assert row["engine"] == "live" and row["matches_simulation"]
    assert row["hit_blocks"] == row["sim_hit_blocks"] == hand_hits("lru", 3) > 0


def test_cli_live_uses_running_daemons_at_their_policy_and_capacity(hand_trace, tmp_path, capsys):
    from tiers.ops.node_runner import NodeRunner
    runner = NodeRunner(live.dram_node_config(3, "fifo", live.page_bytes()), str(tmp_path / "run"),
                        str(tmp_path / "data"))
    runner.start()
    try:
        out = str(tmp_path / "running.json")
        assert run_cli(["replay", hand_trace, "--live", "--config", runner.config_path, "--runtime-dir",
                        runner.runtime_dir, "--quiet", "--json", out]) == 0
    finally:
        runner.stop()
    (row,) = json.load(open(out))["rows"]
    assert (row["policy"], row["capacity_blocks"], row["matches_simulation"]) == ("fifo", 3, True)
    assert row["hit_blocks"] == hand_hits("fifo", 3)


def test_cli_live_rejects_bad_combinations(hand_trace, capsys):
    assert run_cli(["replay", hand_trace, "--live", "--start", "--runtime-dir", "/tmp/x", "--quiet"]) == 2
    assert run_cli(["replay", hand_trace, "--live", "--start", "--capacity", "0b", "--quiet"]) == 2
