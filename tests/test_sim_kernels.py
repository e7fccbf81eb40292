"""The compiled kernels against the daemon's policy classes, access by access, on the Mooncake traces."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.sim import conversation_like, mooncake_trace
from tiers.sim import kernels, simulate, sweep
from tiers.sim.trace import read_traces

pytestmark = pytest.mark.skipif(kernels.available() is not None,
                                reason=f"compiled kernels unavailable: {kernels.available()}")

# capacities in blocks: deep eviction, the knee, and near the working set
CASES = [("conversation", 1953), ("conversation", 19531), ("synthetic", 5000)]


@pytest.fixture(scope="module")
def traces():
    """Both Mooncake traces (skips when absent)."""
    return {name: read_traces([mooncake_trace(name)]) for name in ("conversation", "synthetic")}


@pytest.mark.parametrize("policy", kernels.KERNEL_POLICIES)
def test_kernel_equals_policy_class_on_mooncake_traces(traces, policy):
    for name, capacity in CASES:
        trace = traces[name]
        parents = trace.parents()
        compiled = simulate.access_hits(trace, policy, capacity, engine="kernel", parents=parents)
        reference = simulate.access_hits(trace, policy, capacity, engine="policy", parents=parents)
        mismatch = np.flatnonzero(compiled != reference)
        assert mismatch.size == 0, f"{policy} on {name} at {capacity}: first differing access {mismatch[:1]}"


@pytest.mark.parametrize("policy", kernels.KERNEL_POLICIES)
def test_kernel_equals_policy_class_at_every_small_capacity(policy):
    trace = conversation_like(seed=99, requests=200)
    parents = trace.parents()
    for capacity in range(0, trace.n_keys + 2, 5):
        assert np.array_equal(simulate.access_hits(trace, policy, capacity, engine="kernel", parents=parents),
                              simulate.access_hits(trace, policy, capacity, engine="policy", parents=parents))


def test_s3fifo_options_reach_the_kernel():
    trace = conversation_like()
    for options in ({"small_ratio": 0.25}, {"ghost_ratio": 0.0}, {"move_threshold": 2}):
        assert np.array_equal(simulate.access_hits(trace, "s3fifo", 40, engine="kernel", **options),
                              simulate.access_hits(trace, "s3fifo", 40, engine="policy", **options))


def test_auto_engine_without_a_compiler_runs_the_classes(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: "no compiler")
    assert sweep.engine_for("lfu", "auto") == "policy"
    assert sweep.engine_for("lru", "auto") == "stack"
    trace = conversation_like()
    assert simulate.access_hits(trace, "lfu", 16).sum() == 1978
