"""replay --live: requests through the real SGLang backend against real DRAM daemons hit exactly as simulated."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.sim import (HAND_REQUESTS, conversation_slice, hand_trace, run_experiments as run_cli,  # noqa: F401
                               shared_prefix_trace)  # (hand_trace is a fixture)
from hicache_ext.lab import live
from tiers.sim.capacity import Capacity
from tiers.sim.simulate import leading_run, policy_hits, score
from tiers.sim.trace import from_requests

# SGLang's import and 22 daemon processes: about 60 s of CPU, a minute or two of wall time on 2 loaded cores.
pytestmark = pytest.mark.slow

POLICIES = ("lru", "fifo", "lfu", "s3fifo", "radix-lru")
SMALL_CAPACITIES = (40, 150)  # blocks; the trace has 895 distinct blocks in 4,062 accesses
CONVERSATION_CAPACITIES = (300, 1000)


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
