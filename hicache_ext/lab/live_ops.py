"""The L3 calls of a whole-hierarchy simulation, made for real against a fresh tier daemon.

``tiers/sim/hierarchy.py`` with ``record_ops`` logs what SGLang's controller
would ask the backend, in order: ``exists`` (the storage hit query, with the
count the simulated tiers answered), ``get`` (the prefetch read) and ``set``
(the backup of a node that reached the host pool). Here the same calls go
through the real backend (SGLang's factory, the controller's page functions)
to a one-tier DRAM node of the simulated policy and capacity, and every
``exists`` answer is compared with the simulated one. Equal answers mean the
simulator's L3 part behaves as the daemon does on the stream the engine model
produced (L1/L2 in front of it), not only on replay's plain trace order.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from hicache_ext.lab.live import LiveEngine, LiveError, dram_node_config, page_bytes, page_key


@dataclass
class OpsCheck:
    """What the daemon answered against what the simulation said."""

    lookups: int = 0
    mismatches: int = 0  # exists answers that differ
    sim_hit_blocks: int = 0  # blocks the exists answers add up to, simulated
    live_hit_blocks: int = 0  # and live
    reads: int = 0
    writes: int = 0
    seconds: float = 0.0
    first_mismatch: Optional[dict] = None
    daemon: Dict[str, int] = field(default_factory=dict)

    @property
    def matches(self) -> bool:
        return self.mismatches == 0


def _unique_runs(blocks: Sequence[int]) -> List[List[int]]:
    """blocks cut before a block repeated within the run (a batch puts each key once)."""
    runs, seen, run = [], set(), []
    for block in blocks:
        if block in seen:
            runs.append(run)
            seen, run = set(), []
        seen.add(block)
        run.append(block)
    if run:
        runs.append(run)
    return runs


def replay_ops(ops: Sequence[tuple], engine: LiveEngine, key_of: Callable[[int], str],
               progress: Optional[Callable[[int], None]] = None) -> OpsCheck:
    """Make each logged call through the backend; count the exists answers that differ."""
    check = OpsCheck()
    driver = engine.driver
    started = time.perf_counter()
    for op in ops:
        kind, blocks, prefix = op[0], op[1], op[2]
        prefix_keys = [key_of(prefix)] if prefix is not None else []
        if kind == "exists":
            got = driver.exists([key_of(b) for b in blocks], prefix_keys=prefix_keys)
            check.lookups += 1
            check.sim_hit_blocks += op[3]
            check.live_hit_blocks += got
            if got != op[3]:
                check.mismatches += 1
                if check.first_mismatch is None:
                    check.first_mismatch = {"op": check.lookups + check.reads + check.writes - 1,
                                            "simulated": op[3], "live": got}
        else:
            previous = prefix
            for run in _unique_runs(blocks):
                keys = [key_of(b) for b in run]
                call = driver.prefetch if kind == "get" else driver.backup
                done = call(keys, engine.slots(len(keys)),
                            prefix_keys=[key_of(previous)] if previous is not None else [])
                if done != len(keys):
                    engine.check_up()
                    raise LiveError(f"{kind} completed {done} of {len(keys)} pages")
                previous = run[-1]
            if kind == "get":
                check.reads += 1
            else:
                check.writes += 1
        if progress is not None:
            progress(1)
    check.seconds = time.perf_counter() - started
    return check


def check_against_dram_node(ops: Sequence[tuple], policy: str, blocks: int,
                            progress: Optional[Callable[[int], None]] = None) -> OpsCheck:
    """Start a one-tier DRAM node of policy holding blocks pages, make the calls, stop it."""
    from tiers.ops.node_runner import NodeRunner
    longest = max((len(op[1]) for op in ops), default=1)
    size = page_bytes()
    with tempfile.TemporaryDirectory(prefix="hicache-ops-") as base:
        runner = NodeRunner(dram_node_config(blocks, policy, size), os.path.join(base, "run"),
                            os.path.join(base, "data"))
        runner.start()
        try:
            engine = LiveEngine(runner.runtime_dir, runner.config_path, longest)
            try:
                check = replay_ops(ops, engine, page_key, progress)
                stats = next(iter(engine.tier_stats().values()), None) or {}
                check.daemon = {k: int(stats.get(k, 0)) for k in ("hits", "inserts", "evictions")}
            finally:
                engine.close()
        finally:
            runner.stop()
    return check
