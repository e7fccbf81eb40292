"""Whole-hierarchy simulation: SGLang's GPU and host caches and prefetch rules in front of the node's tiers.

Per request, in trace order (SGLang 0.5.23, ``managers/scheduler.py`` and
``mem_cache/unified_radix_cache.py``):
1. ``match_prefix``: the device prefix (L1), then host-only nodes (L2), touched.
2. ``_prefetch_kvcache`` at arrival: only when the match ends at the root or
   at a node with a host copy (``is_backuped``: under write_back an L1-only
   prefix blocks it); ``prefetch_from_storage`` declines fewer new tokens than
   ``prefetch_threshold`` (page-aligned) and declines while the tokens of
   prefetches in flight reach half the host pool (``prefetch_rate_limited``);
   the storage hit query asks 128-page batches until one is short and is
   revoked under the threshold; the host room is made for the hit
   (``_try_alloc_storage_hit``, shrunk down to the threshold).
3. The read goes in 128-page batches (``_page_transfer``); the scheduler polls
   the request (``check_prefetch_progress``) once the GPU takes it: best_effort
   stops there, wait_complete waits for the end, timeout waits at most
   ``prefetch_timeout_base + pages * page_size / 1024 * prefetch_timeout_per_ki_token``
   from that poll (``_start_storage_prefetch_wait``); only whole batches count.
   What came in is a host-only node under the match (``insert_host``).
4. Admission: the host part and the prefetched node are loaded to the GPU
   (``load_back``), the rest is computed and inserted; the write policy backs
   nodes up to host and from there to the node's tiers.
Time: per request TTFT = (admission - arrival) + max((L2 + L3 tokens) x host-to-GPU,
computed x W, computed x T): the seeds' model per stage (the L3 read happens
before admission in SGLang; the load to the GPU overlaps compute layer by layer).
A measured profile adds a per-request cost, a quadratic prefill term and a cost
per cached token, and may add the load to compute instead of overlapping it
(``TimeModel.service_s``). Without ``queue`` the GPU is free at every arrival;
with it, one FCFS GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from tiers.sim.node_tiers import NodeTiers, TierSpec
from tiers.sim.radix_tree import BlockRadixTree
from tiers.sim.timing import TimeModel
from tiers.sim.trace import Trace

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE
LOST_REASONS = ("anchor_not_backed", "below_threshold", "rate_limited", "hit_below_threshold", "host_full",
                "cut_short", "load_back_failed")


@dataclass(frozen=True)
class SGLangFlags:
    """SGLang's HiCache flags besides the pool sizes, with SGLang 0.5.23's defaults."""

    write_policy: str = "write_through"  # --hicache-write-policy
    page_size: int = 64  # --page-size, tokens
    prefetch_threshold: int = 256  # extra config prefetch_threshold, tokens
    prefetch_policy: str = "timeout"  # --hicache-storage-prefetch-policy
    prefetch_timeout_base: float = 1.0  # extra config, seconds
    prefetch_timeout_per_ki_token: float = 0.25  # extra config, seconds
    scheduler_step_s: float = 0.0  # arrival to the scheduler's first admission poll (not a flag)

    def __post_init__(self):
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {self.prefetch_policy!r}; "
                             f"choose one of {', '.join(PREFETCH_POLICIES)}")
        if self.page_size <= 0:
            raise ValueError("page_size must be positive")


@dataclass(frozen=True)
class EngineSettings:
    """One SGLang engine: its GPU and host pools in tokens, and its flags."""

    device_tokens: int
    host_tokens: int
    flags: SGLangFlags = SGLangFlags()
    storage: bool = True


@dataclass(frozen=True)
class NodeSettings:
    """The node's tiers, fastest first, and the router's write policy."""

    tiers: Tuple[TierSpec, ...]
    write_policy: str = "write_through"
    promote: bool = True
    min_reads: int = 2
    promote_min_reads: int = 2  # reads from below before a page is promoted (tiers/policies/admission.py)


@dataclass
class Result:
    """Per-request tokens by level and TTFT, and totals."""

    tokens: np.ndarray
    device: np.ndarray
    host: np.ndarray
    storage: np.ndarray
    storage_available: np.ndarray  # what the tiers held of the rest at arrival (leading run)
    ttft_s: np.ndarray
    wait_s: np.ndarray
    lost: dict  # reason -> tokens the tiers held but the request did not get
    counters: dict
    ops: Optional[list] = None

    @property
    def computed(self) -> np.ndarray:
        return self.tokens - self.device - self.host - self.storage

    def summary(self) -> dict:
        """Hit rates per level, TTFT statistics, and where L3 hits were lost."""
        total = max(int(self.tokens.sum()), 1)
        ttft = self.ttft_s
        return {"requests": len(self.tokens), "tokens": int(self.tokens.sum()),
                "device_hit_rate": float(self.device.sum() / total), "host_hit_rate": float(self.host.sum() / total),
                "storage_hit_rate": float(self.storage.sum() / total),
                "hit_rate": float((self.device.sum() + self.host.sum() + self.storage.sum()) / total),
                "storage_available_rate": float(self.storage_available.sum() / total),
                "ttft_mean_s": float(ttft.mean()) if len(ttft) else 0.0,
                "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
                "ttft_p90_s": float(np.percentile(ttft, 90)) if len(ttft) else 0.0,
                "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
                **{f"lost_{reason}": int(self.lost.get(reason, 0)) for reason in LOST_REASONS}}

    def request_rows(self) -> List[dict]:
        """One dict per request: tokens by level, what L3 held, TTFT."""
        return [{"request": i, "tokens": int(self.tokens[i]), "device": int(self.device[i]),
                 "host": int(self.host[i]), "storage": int(self.storage[i]),
                 "computed": int(self.tokens[i] - self.device[i] - self.host[i] - self.storage[i]),
                 "storage_available": int(self.storage_available[i]), "ttft_s": float(self.ttft_s[i]),
                 "wait_s": float(self.wait_s[i])} for i in range(len(self.tokens))]


def simulate(trace: Trace, engine: EngineSettings, node: NodeSettings, time: TimeModel, queue: bool = False,
             time_scale: float = 1.0, record_ops: bool = False,
             progress: Optional[Callable[[int], None]] = None) -> Result:
    """Run every request of trace through the engine's caches and the node's tiers."""
    return _Run(trace, engine, node, time, queue, time_scale, record_ops).run(progress)


class _Run:
    def __init__(self, trace, engine, node, time, queue, time_scale, record_ops):
        self.trace, self.engine, self.time = trace, engine, time
        self.queue, self.time_scale = queue, time_scale
        self.tiers = NodeTiers(node.tiers, node.write_policy, node.promote, node.min_reads, node.promote_min_reads)
        self.tree = BlockRadixTree(engine.device_tokens, engine.host_tokens, engine.flags.write_policy,
                                   on_backup=self._backed_up)
        self.ops: Optional[list] = [] if record_ops else None
        self.in_flight: List[Tuple[float, int]] = []  # (admission time, tokens) of prefetches holding host room
        self.capacity_limit = int(0.5 * engine.host_tokens)  # SGLang's prefetch_capacity_limit
        self.threshold = max(engine.flags.prefetch_threshold, engine.flags.page_size)
        self.lost = dict.fromkeys(LOST_REASONS, 0)
        self.gpu_free = 0.0

    def _backed_up(self, blocks: List[int], parent: Optional[int]) -> None:
        """A node reached the host pool: SGLang writes it to storage (write_backup_storage)."""
        if not self.engine.storage:
            return
        parents = [parent] + blocks[:-1]
        self.tiers.write(blocks, parents)
        if self.ops is not None:
            self.ops.append(("set", list(blocks), parent))

    def run(self, progress) -> Result:
        trace, page = self.trace, self.engine.flags.page_size
        block_tokens = trace.block_tokens_per_access()
        aligned = (block_tokens // page) * page
        n = trace.n_requests
        out = {name: np.zeros(n, dtype=np.int64) for name in ("device", "host", "storage", "available")}
        ttft = np.zeros(n)
        wait = np.zeros(n)
        keys = trace.keys.tolist()
        aligned_list = aligned.tolist()
        offsets = trace.offsets.tolist()
        step = max(n // 100, 1)
        for r in range(n):
            lo, hi = offsets[r], offsets[r + 1]
            blocks, toks = keys[lo:hi], aligned_list[lo:hi]
            while toks and toks[-1] == 0:  # a last block shorter than a page is not cached
                blocks, toks = blocks[:-1], toks[:-1]
            arrival = float(trace.timestamps[r]) / 1000.0 * self.time_scale
            levels, admitted, service = self._request(blocks, toks, int(trace.input_lengths[r]), arrival)
            out["device"][r], out["host"][r], out["storage"][r], out["available"][r] = levels
            wait[r] = admitted - arrival
            ttft[r] = wait[r] + service
            if progress is not None and (r + 1) % step == 0:
                progress(step)
        if progress is not None and n % step:
            progress(n % step)
        counters = {"l3": self.tiers.counters(), "host_backup_failures": self.tree.backup_failures}
        return Result(tokens=trace.input_lengths.astype(np.int64).copy(), device=out["device"], host=out["host"],
                      storage=out["storage"], storage_available=out["available"], ttft_s=ttft, wait_s=wait,
                      lost=dict(self.lost), counters=counters, ops=self.ops)

    def _request(self, blocks: List[int], toks: List[int], length: int, arrival: float):
        tree, engine = self.tree, self.engine
        path, on_device = tree.match(blocks)
        device_tok = sum(node.size for node in path[:on_device])
        host_nodes = path[on_device:]
        host_tok = sum(node.size for node in host_nodes)
        matched = sum(len(node.blocks) for node in path)
        last = path[-1] if path else tree.root
        tree.lock(last)
        rest, rest_toks = blocks[matched:], toks[matched:]
        poll = arrival + engine.flags.scheduler_step_s
        if self.queue:
            poll = max(poll, self.gpu_free)
        self.in_flight = [(t, k) for t, k in self.in_flight if t > arrival]
        fetched, fetched_tok, available, admitted = None, 0, 0, poll
        if engine.storage and rest:
            held = self.tiers.lookup(rest)  # touches nothing: the prefetch's hit query gets the same answer
            available = sum(rest_toks[:held])
            fetched, fetched_tok, admitted = self._prefetch(last, rest, rest_toks, held, available, arrival, poll)
        if fetched is not None:
            tree.lock(fetched)
        loads = host_nodes + ([fetched] if fetched is not None else [])
        if loads and not self._load_back(loads):
            self.lost["load_back_failed"] += fetched_tok
            host_tok, fetched_tok = 0, 0
            computed_from = len(rest)  # the prefix stays on host; nothing below it is cached this time
        else:
            computed_from = len(fetched.blocks) if fetched is not None else 0
            tree.count_walk(path + ([fetched] if fetched is not None else []))  # the insert walks them
            parent = fetched if fetched is not None else last
            tree.insert(parent, rest[computed_from:], rest_toks[computed_from:])
        tree.unlock(last)
        if fetched is not None:
            tree.unlock(fetched)
        computed = length - device_tok - host_tok - fetched_tok
        service = self.time.service_s(device_tok + host_tok + fetched_tok, host_tok + fetched_tok, computed)
        if self.queue:
            self.gpu_free = admitted + service
        return (device_tok, host_tok, fetched_tok, available), admitted, service

    def _load_back(self, nodes) -> bool:
        """SGLang's load_back: the anchor (deepest node) keeps its host copy while the device makes room
        (under write_back that room comes from backups, which may evict host memory)."""
        self.tree.pin_host(nodes[-1])
        try:
            return self.tree.load_back(nodes)
        finally:
            self.tree.unpin_host(nodes[-1])

    def _prefetch(self, anchor, rest, rest_toks, held, available, arrival, poll):
        """SGLang's prefetch of rest from the node's tiers: (host node, tokens, admission time)."""
        tree = self.tree
        none = (None, 0, poll)
        if anchor is not tree.root and not anchor.host:
            self.lost["anchor_not_backed"] += available
            return none
        if sum(rest_toks) < self.threshold:
            self.lost["below_threshold"] += available
            return none
        if sum(k for _, k in self.in_flight) >= self.capacity_limit:
            self.lost["rate_limited"] += available
            return none
        tree.pin_host(anchor)  # prefetch_from_storage's inc_host_lock_ref, until the result is taken
        try:
            return self._issue(anchor, rest, rest_toks, held, available, arrival, poll)
        finally:
            tree.unpin_host(anchor)

    def _issue(self, anchor, rest, rest_toks, hit_blocks, available, arrival, poll):
        """An issued prefetch: hit query (hit_blocks held), host room, batches cut by the policy, the host node."""
        tree, none = self.tree, (None, 0, poll)
        prefix = anchor.blocks[-1] if anchor.blocks else None
        if self.ops is not None:
            self.ops.append(("exists", list(rest), prefix, hit_blocks))
        hit_tok = sum(rest_toks[:hit_blocks])
        query_s = self._query_s(rest_toks, hit_tok)
        if hit_tok < self.threshold:
            self.lost["hit_below_threshold"] += available
            return none
        if not tree.host_room(hit_tok):
            room = max(tree.host_capacity - tree.host_used, 0)
            while hit_blocks and hit_tok > room:
                hit_blocks -= 1
                hit_tok -= rest_toks[hit_blocks]
            if hit_tok < self.threshold:
                self.lost["host_full"] += available
                return none
            self.lost["host_full"] += available - hit_tok
        requested = sum(rest_toks)
        done_at = self._batch_ends(rest[:hit_blocks], rest_toks[:hit_blocks],
                                   arrival + query_s + self.time.hit_handoff_s)
        admitted = self._admission(poll, done_at[-1], requested)
        self.in_flight.append((admitted, requested))  # host room held until the result is taken
        loaded = sum(1 for end in done_at if end <= admitted)  # done_at is per block, ends of its batch
        loaded_tok = sum(rest_toks[:loaded])
        self.lost["cut_short"] += hit_tok - loaded_tok
        if loaded == 0:
            return None, 0, admitted
        got = self.tiers.read(rest[:loaded], [prefix] + rest[:loaded - 1])
        if self.ops is not None:
            self.ops.append(("get", list(rest[:loaded]), prefix))
        node = tree.insert_host(anchor, rest[:loaded], rest_toks[:loaded]) if min(got) >= 0 else None
        if node is None:
            self.lost["host_full"] += loaded_tok
            return None, 0, admitted
        return node, loaded_tok, admitted

    def _query_s(self, rest_toks: Sequence[int], hit_tok: int) -> float:
        page = self.engine.flags.page_size
        return storage_query_s(self.time, sum(rest_toks) // page, hit_tok // page)

    def _batch_ends(self, blocks: Sequence[int], toks: Sequence[int], start: float) -> List[float]:
        """Per block, when the 128-page batch that completes it ends (tiers read at once, slowest sets it)."""
        page, t = self.engine.flags.page_size, self.time
        ends: List[float] = []
        batch_tokens = STORAGE_BATCH_PAGES * page
        clock, filled, per_depth = start, 0, {}
        pending = 0
        for block, tok in zip(blocks, toks):
            depth = self.tiers.depth(block)
            per_depth[depth] = per_depth.get(depth, 0) + tok
            filled += tok
            pending += 1
            if filled >= batch_tokens:
                clock += t.batch_read_s(per_depth)
                ends.extend([clock] * pending)
                filled, per_depth, pending = 0, {}, 0
        if pending:
            clock += t.batch_read_s(per_depth)
            ends.extend([clock] * pending)
        return ends

    def _admission(self, poll: float, done: float, requested_tok: int) -> float:
        return admission(self.engine.flags, poll, done, requested_tok)


def storage_query_s(time: TimeModel, pages: int, hit_pages: int) -> float:
    """The storage hit query: one lookup per 128-page batch of pages until a batch comes back short, and the
    engine's own time around it (a measured profile's prefetch_s; 0 for a GPU preset)."""
    batches = min(-(-pages // STORAGE_BATCH_PAGES), hit_pages // STORAGE_BATCH_PAGES + 1)
    return batches * time.lookup_s(min(pages, STORAGE_BATCH_PAGES)) + time.prefetch_s


def admission(flags: SGLangFlags, poll: float, done: float, requested_tok: int) -> float:
    """When the scheduler admits a request whose prefetch ends at done (timeout: on the requested span)."""
    if flags.prefetch_policy == "best_effort" or done <= poll:
        return poll
    if flags.prefetch_policy == "wait_complete":
        return done
    pages = requested_tok // flags.page_size
    budget = flags.prefetch_timeout_base + pages * flags.page_size / 1024 * flags.prefetch_timeout_per_ki_token
    return min(done, poll + budget)


def node_settings(tiers: Sequence[TierSpec], write_policy: str = "write_through", promote: bool = True,
                  min_reads: int = 2, promote_min_reads: int = 2) -> NodeSettings:
    """NodeSettings from a list of TierSpec (a tuple kept, so settings hash and compare)."""
    return NodeSettings(tiers=tuple(tiers), write_policy=write_policy, promote=promote, min_reads=min_reads,
                        promote_min_reads=promote_min_reads)


