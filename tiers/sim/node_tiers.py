"""The node's tier chain (L3) driven the way the daemons and the backend's router drive it.

Each tier is a bounded set of blocks whose order is the registered policy
class the daemons run (``tiers.policies.make_policy``, a user's own file
included), kept the way tiers/stores/dram.py keeps it:
- a lookup touches nothing (SGLang's ``batch_exists``);
- a read touches the page in the fastest tier holding it (the daemon's get);
  with ``promote`` a page found below the top tier is put into the top tier
  afterwards (hicache_ext/router.py ``_promote``), as a clean copy, once it
  was read from below ``promote_min_reads`` times (tiers/policies/admission.py,
  the router's own rule);
- a put evicts one victim while the tier is full (tiers/node/transfers.py
  reserves without eviction while blocks are free and commits those first),
  then replaces a held copy (removed, inserted anew: an overwrite is not a touch).
Write policies (the router's): write_through puts into every tier;
write_back puts into the top tier and a tier's victim goes down to the next
tier (the daemon's demotion; synchronous here, bounded and asynchronous
there); selective does the same for victims read at least ``min_reads``
times and drops the others. A clean copy (promoted) is not demoted again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from tiers.plugins import make_policy
from tiers.policies.admission import ReadAdmission

ROUTER_WRITE_POLICIES = ("write_through", "write_back", "selective")


@dataclass(frozen=True)
class TierSpec:
    """One tier of the chain: its kind (for its speed), capacity in blocks and policy."""

    kind: str
    blocks: int
    policy: str = "lru"
    options: Dict[str, object] = field(default_factory=dict)


class SimTier:
    """One tier's index and policy."""

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.policy = make_policy(spec.policy, **spec.options)
        self.reads: Dict[int, int] = {}  # block -> reads since it was stored (selective demotion)
        self.clean: set = set()  # blocks held below as well (promoted): not demoted again
        self.hits = 0
        self.inserts = 0
        self.evictions = 0

    def __contains__(self, block: int) -> bool:
        return block in self.reads

    def __len__(self) -> int:
        return len(self.reads)

    def touch(self, block: int) -> None:
        self.reads[block] += 1
        self.hits += 1
        self.policy.touch(block)

    def put(self, block: int, parent: Optional[int], clean: bool = False) -> Optional[tuple]:
        """Store block; (victim, its reads, whether it was clean) when one was evicted for it."""
        if self.spec.blocks <= 0:
            return None
        evicted = None
        if len(self.reads) >= self.spec.blocks:
            victim = self.policy.pop_victim()
            if victim is not None:
                evicted = (victim, self.reads.pop(victim), victim in self.clean)
                self.clean.discard(victim)
                self.evictions += 1
        if block in self.reads:
            self.policy.remove(block)
            del self.reads[block]
        self.policy.insert(block, parent)
        self.reads[block] = 0
        if clean:
            self.clean.add(block)
        else:
            self.clean.discard(block)
        self.inserts += 1
        return evicted


class NodeTiers:
    """The chain, fastest first, and the router's write policy."""

    def __init__(self, specs: Sequence[TierSpec], write_policy: str = "write_through", promote: bool = True,
                 min_reads: int = 2, promote_min_reads: int = 2):
        if write_policy not in ROUTER_WRITE_POLICIES:
            raise ValueError(f"unknown tier write policy {write_policy!r}; "
                             f"choose one of {', '.join(ROUTER_WRITE_POLICIES)}")
        self.tiers = [SimTier(s) for s in specs if s.blocks > 0]
        self.write_policy = write_policy
        self.promote = promote
        self.admission = ReadAdmission(promote_min_reads)
        self.min_reads = min_reads
        self.demoted = 0
        self.dropped = 0
        self.promoted = 0

    def depth(self, block: int) -> int:
        """The fastest tier holding block, or -1."""
        for i, tier in enumerate(self.tiers):
            if block in tier:
                return i
        return -1

    def lookup(self, blocks: Sequence[int]) -> int:
        """How many leading blocks some tier holds (touches nothing)."""
        n = 0
        for block in blocks:
            if self.depth(block) < 0:
                break
            n += 1
        return n

    def read(self, blocks: Sequence[int], parents: Sequence[Optional[int]]) -> List[int]:
        """Read blocks: the depth each came from (-1 when none held it); promotes what came from below."""
        depths = []
        below = []
        for block, parent in zip(blocks, parents):
            d = self.depth(block)
            depths.append(d)
            if d >= 0:
                self.tiers[d].touch(block)
                if d > 0:
                    below.append((block, parent))
        if self.promote and self.tiers and below:
            admitted = self.admission.admit([block for block, _parent in below])
            for (block, parent), ok in zip(below, admitted):  # after the read returned, as the router's Promoter
                if ok:
                    self.promoted += 1
                    self._store(0, block, parent, clean=True)
        return depths

    def write(self, blocks: Sequence[int], parents: Sequence[Optional[int]]) -> None:
        """SGLang's backup of blocks (in order) under the write policy."""
        if not self.tiers:
            return
        for block, parent in zip(blocks, parents):
            if self.write_policy == "write_through":
                for i in range(len(self.tiers)):
                    self.tiers[i].put(block, parent)
            else:
                self._store(0, block, parent)

    def _store(self, depth: int, block: int, parent: Optional[int], clean: bool = False) -> None:
        """Put into tier depth; under write_back/selective its victim moves down the chain."""
        evicted = self.tiers[depth].put(block, parent, clean)
        while evicted is not None and self.write_policy != "write_through":
            victim, reads, was_clean = evicted
            depth += 1
            if was_clean or depth >= len(self.tiers):
                break
            if self.write_policy == "selective" and reads < self.min_reads:
                self.dropped += 1
                break
            self.demoted += 1
            evicted = self.tiers[depth].put(victim, None)

    def counters(self) -> dict:
        """Per tier hits, inserts, evictions; chain demotions, drops and promotions."""
        return {"tiers": [{"kind": t.spec.kind, "hits": t.hits, "inserts": t.inserts, "evictions": t.evictions,
                           "held": len(t)} for t in self.tiers],
                "demoted": self.demoted, "dropped": self.dropped, "promoted": self.promoted,
                "not_promoted": self.admission.not_admitted}
