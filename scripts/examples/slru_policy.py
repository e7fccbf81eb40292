"""A user's own eviction policy in a file of its own: segmented LRU (SLRU).

Run it in the simulator and in the daemons with no package and no fork:

    hicache-tiers replay TRACE --policy scripts/examples/slru_policy.py:SLRUPolicy --engine policy
    hicache-tiers plan TRACE --bench docs/bench.json --policy scripts/examples/slru_policy.py:SLRUPolicy
    # node.toml, under [[tiers]]:  policy = "/abs/path/slru_policy.py:SLRUPolicy"

New pages enter a probation segment; a page read again moves to a protected
segment of at most 80 % of the resident pages, whose overflow goes back to the
head of probation. Victims come from probation first, least recent first: a
page read once never pushes out one read twice (Karedla et al., IEEE Computer 1994).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

from tiers.policies import EvictionPolicy

PROTECTED_SHARE = 0.8


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: probation, then protected once read again; O(1) per operation."""

    name = "slru"

    def __init__(self) -> None:
        self._probation: "OrderedDict[Hashable, None]" = OrderedDict()  # least recent first
        self._protected: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key, parent=None) -> None:
        if key in self:
            raise ValueError(f"key already present: {key!r}")
        self._probation[key] = None

    def touch(self, key) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            while len(self._protected) > PROTECTED_SHARE * len(self):
                demoted, _ = self._protected.popitem(last=False)
                self._probation[demoted] = None

    def remove(self, key) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def pop_victim(self) -> Optional[Hashable]:
        for segment in (self._probation, self._protected):
            if segment:
                return segment.popitem(last=False)[0]
        return None

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key) -> bool:
        return key in self._probation or key in self._protected
