"""Expected numbers on the Mooncake FAST'25 traces (README of shared/data/traces, the paper's Figure 9)."""
from __future__ import annotations

import pytest

from tests.support.sim import mooncake_trace
from tiers.sim import simulate
from tiers.sim.capacity import parse_capacity
from tiers.sim.trace import read_traces


@pytest.fixture(scope="module")
def conversation():
    """The conversation trace (skips when absent)."""
    return read_traces([mooncake_trace("conversation")])


def test_conversation_shape_and_ceiling(conversation):
    assert (conversation.n_requests, conversation.n_accesses, conversation.n_keys) == (12031, 288500, 182790)
    best = simulate.score(conversation, simulate.infinite_hits(conversation))
    assert round(best.token_hit_rate, 3) == 0.374 and round(best.block_hit_rate, 3) == 0.366
    assert (best.hit_blocks, best.hit_tokens) == (105710, 54098411)


def test_synthetic_ceiling():
    trace = read_traces([mooncake_trace("synthetic")])
    best = simulate.score(trace, simulate.infinite_hits(trace))
    assert round(best.token_hit_rate, 3) == 0.651 and round(best.block_hit_rate, 3) == 0.640


def test_figure_9_lru_3m_tokens_under_half_50m_nearly_all(conversation):
    best = simulate.score(conversation, simulate.infinite_hits(conversation)).token_hit_rate
    small, large = (parse_capacity(c, 512).blocks for c in ("3Mt", "50Mt"))
    swept = simulate.stack_sweep(conversation, [small, large])
    assert swept[small].token_hit_rate < 0.5 * best
    assert swept[large].token_hit_rate > 0.98 * best
    # pinned, and equal to the daemon's LRU class run at that one capacity
    assert (swept[small].hit_blocks, swept[small].hit_tokens) == (39101, 20006915)
    direct = simulate.score(conversation, simulate.access_hits(conversation, "lru", small, engine="policy"))
    assert (direct.hit_blocks, direct.hit_tokens) == (39101, 20006915)
