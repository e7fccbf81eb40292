"""Tier sizing: sweep the node's capacities under a cost per GB, find the Pareto front, and
show which SGLang settings move the result. The scripting API of docs/EXPERIMENTS.md.

    from tiers.sim import plan
    trace = plan.load_trace(["conversation_trace.jsonl"])
    setup = plan.Setup(bench=plan.load_bench("docs/bench.json"), model="llama-3-8b", gpu="h100-sxm")
    rows = plan.sweep(trace, setup, plan.grid(dram_gb=[0, 512], nvme_gb=[0, 8000]))
    front = plan.pareto(rows, "ttft_p90_s")  # rows no cheaper point beats on p90 TTFT
    plan.dataframe(rows)                    # a pandas DataFrame, when pandas is installed
"""
from __future__ import annotations

import itertools
import os
import time as clock
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from tiers.sim.hierarchy import EngineSettings, NodeSettings, Result, SGLangFlags, simulate
from tiers.sim.node_tiers import TierSpec
from tiers.sim.prefill import PRESETS, ModelShape
from tiers.sim.profile import Profile
from tiers.sim.timing import BenchFigures, TimeModel, time_model
from tiers.sim.trace import DEFAULT_BLOCK_TOKENS, Trace, read_traces

TIER_KINDS = ("dram", "nvme", "remote")
# Dollars per GB of capacity; rough street prices to be replaced by the buyer's own (--cost).
DEFAULT_COSTS = {"dram": 3.0, "nvme": 0.08, "remote": 4.0}
# Each front: cost against one objective, minimised ("-" flips a maximum).
FRONTS = {"mean": "ttft_mean_s", "p90": "ttft_p90_s", "hit": "-hit_rate"}
# What the settings table varies (SGLang's flags), each against the base setting.
SETTING_VALUES = {"prefetch_threshold": (64, 256, 1024, 4096),
                  "prefetch_policy": ("best_effort", "wait_complete", "timeout"),
                  "hicache_ratio": (1.0, 1.5, 2.0, 4.0),
                  "write_policy": ("write_through", "write_through_selective", "write_back")}


def load_trace(paths: Sequence[str], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    """Mooncake JSONL traces as one trace (tiers/sim/trace.py)."""
    return read_traces(list(paths), block_tokens=block_tokens)


def load_bench(path: str) -> BenchFigures:
    """A ``hicache-tiers bench --json`` file."""
    return BenchFigures.load(path)


@dataclass(frozen=True)
class Setup:
    """Everything but the tier capacities: hardware, SGLang's settings, the node's policies."""

    bench: Optional[BenchFigures] = None
    model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    gpus: int = 1  # tensor parallel: T and the host-to-GPU time divide by it
    mfu: float = 0.5
    compute_s: Optional[float] = None  # a measured T overrides the GPU preset's
    device_gb: float = 40.0  # the GPU's KV pool
    hicache_ratio: float = 2.0  # host pool = ratio x device pool (SGLang's --hicache-ratio)
    host_gb: Optional[float] = None  # SGLang's --hicache-size; overrides the ratio
    flags: SGLangFlags = SGLangFlags()
    tier_policy: str = "lru"  # every tier's, unless tier_policies names its kind
    tier_policies: Tuple[Tuple[str, str], ...] = ()  # (kind, policy) overrides, e.g. (("dram", "s3fifo"),)
    tier_write_policy: str = "write_back"
    promote: bool = True
    promote_min_reads: int = 2  # reads from below before a page is promoted (the backend's setting)
    queue: bool = False
    time_scale: float = 1.0
    costs: Dict[str, float] = field(default_factory=lambda: dict(DEFAULT_COSTS))
    profile: Optional[Profile] = None  # a measured engine (bench --ttft-profile): replaces model and GPU

    @property
    def shape(self) -> ModelShape:
        if self.profile is not None:
            return self.profile.shape
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[self.model]

    def engine(self) -> EngineSettings:
        """SGLang's pools in tokens of this model."""
        per_token = self.shape.kv_bytes_per_token
        device = int(self.device_gb * 1e9 / per_token)
        host = int(self.host_gb * 1e9 / per_token) if self.host_gb is not None else int(device * self.hicache_ratio)
        return EngineSettings(device_tokens=device, host_tokens=host, flags=self.flags)

    def node(self, point: "Point", block_tokens: int) -> NodeSettings:
        """The node's chain at point: tiers of zero capacity left out."""
        block_bytes = self.shape.kv_bytes_per_token * block_tokens
        specs = [TierSpec(kind, int(gb * 1e9 // block_bytes), self.policy_of(kind)) for kind, gb in point.tiers()]
        return NodeSettings(tiers=tuple(s for s in specs if s.blocks > 0), write_policy=self.tier_write_policy,
                            promote=self.promote, promote_min_reads=self.promote_min_reads)

    def policy_of(self, kind: str) -> str:
        """The eviction policy of the tier of kind."""
        return dict(self.tier_policies).get(kind, self.tier_policy)

    def time(self, node: NodeSettings) -> TimeModel:
        return time_model(self.bench, [s.kind for s in node.tiers], self.tier_write_policy, model=self.model,
                          gpu=self.gpu, mfu=self.mfu, page_tokens=self.flags.page_size, compute_s=self.compute_s,
                          gpus=self.gpus, profile=self.profile)

    def cost(self, point: "Point") -> float:
        return sum(gb * self.costs.get(kind, 0.0) for kind, gb in point.tiers())


@dataclass(frozen=True)
class Point:
    """One deployment: GB of each tier on the node."""

    dram_gb: float = 0.0
    nvme_gb: float = 0.0
    remote_gb: float = 0.0

    def tiers(self) -> List[Tuple[str, float]]:
        return [("dram", self.dram_gb), ("nvme", self.nvme_gb), ("remote", self.remote_gb)]


def grid(dram_gb: Iterable[float] = (0,), nvme_gb: Iterable[float] = (0,), remote_gb: Iterable[float] = (0,)) -> List[Point]:
    """Every combination of the capacities given."""
    return [Point(d, n, r) for d, n, r in itertools.product(dram_gb, nvme_gb, remote_gb)]


def run_point(trace: Trace, setup: Setup, point: Point, record_ops: bool = False) -> Tuple[dict, Result]:
    """Simulate one deployment; (its row, the full result)."""
    started = clock.perf_counter()
    node = setup.node(point, trace.block_tokens)
    result = simulate(trace, setup.engine(), node, setup.time(node), queue=setup.queue,
                      time_scale=setup.time_scale, record_ops=record_ops)
    row = {"dram_gb": point.dram_gb, "nvme_gb": point.nvme_gb, "remote_gb": point.remote_gb,
           "cost": setup.cost(point), **result.summary(), "seconds": clock.perf_counter() - started}
    return row, result


def _row_of(job: tuple) -> dict:
    trace, setup, point = job
    return run_point(trace, setup, point)[0]


def _rows(jobs: List[tuple], parallel: int, progress: Optional[Callable[[int], None]]) -> List[dict]:
    """_row_of each job, on up to parallel processes, in order."""
    rows: List[Optional[dict]] = [None] * len(jobs)
    if parallel <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            rows[i] = _row_of(job)
            if progress:
                progress(1)
        return rows
    with ProcessPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(_row_of, job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            rows[futures[future]] = future.result()
            if progress:
                progress(1)
    return rows


def default_parallel() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def sweep(trace: Trace, setup: Setup, points: Sequence[Point], parallel: int = 1,
          progress: Optional[Callable[[int], None]] = None) -> List[dict]:
    """One row per point (dicts: capacities, cost, hit rates per level, TTFT, lost L3 tokens by reason)."""
    rows = _rows([(trace, setup, p) for p in points], parallel, progress)
    for name, objective in FRONTS.items():
        on_front = {id(r) for r in pareto(rows, objective)}
        for row in rows:
            row[f"front_{name}"] = id(row) in on_front
    return rows


def _value(row: dict, name: str) -> float:
    return -row[name[1:]] if name.startswith("-") else row[name]


def _dominates(a: dict, b: dict, objectives: Sequence[str]) -> bool:
    names = ["cost", *objectives]
    return (all(_value(a, n) <= _value(b, n) for n in names)
            and any(_value(a, n) < _value(b, n) for n in names))


def pareto(rows: Sequence[dict], objective: str = "ttft_mean_s") -> List[dict]:
    """Rows no other row beats on both cost and objective (one front), cheapest first.

    objective is a row key, minimised; "-hit_rate" maximises hit_rate.
    """
    objectives = [objective]
    front = [r for r in rows if not any(_dominates(o, r, objectives) for o in rows if o is not r)]
    return sorted(front, key=lambda r: (r["cost"], _value(r, objective)))


def settings_rows(trace: Trace, setup: Setup, point: Point, values: Optional[Dict[str, Sequence]] = None,
                  parallel: int = 1, progress: Optional[Callable[[int], None]] = None) -> List[dict]:
    """At point: the base setup, then one SGLang setting changed at a time; deltas against the base."""
    values = SETTING_VALUES if values is None else values
    variants: List[Tuple[str, object, Setup]] = [("base", "", setup)]
    for name, choices in values.items():
        for choice in choices:
            variant = with_setting(setup, name, choice)
            if variant != setup:
                variants.append((name, choice, variant))
    rows = _rows([(trace, s, point) for _, _, s in variants], parallel, progress)
    base = rows[0]
    out = []
    for (name, choice, _), row in zip(variants, rows):
        row = dict(row, setting=name, value=choice)
        for key in ("hit_rate", "storage_hit_rate", "ttft_mean_s", "ttft_p90_s"):
            row[f"delta_{key}"] = row[key] - base[key]
        out.append(row)
    return out


def with_setting(setup: Setup, name: str, value) -> Setup:
    """setup with one SGLang flag (SGLangFlags) or one of its own fields (hicache_ratio, ...) changed."""
    if name in SGLangFlags.__dataclass_fields__:
        return replace(setup, flags=replace(setup.flags, **{name: value}))
    if name not in Setup.__dataclass_fields__:
        raise ValueError(f"unknown setting {name!r}")
    return replace(setup, **{name: value})


def dataframe(rows: Sequence[dict]):
    """rows as a pandas DataFrame (ImportError naming pandas when it is not installed)."""
    try:
        import pandas
    except ImportError:
        raise ImportError("plan.dataframe needs pandas (pip install pandas); the rows are plain dicts") from None
    return pandas.DataFrame(list(rows))
