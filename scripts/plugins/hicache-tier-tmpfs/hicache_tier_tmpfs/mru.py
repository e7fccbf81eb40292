"""MRU eviction: the most recently used page goes first."""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

from tiers.policies import EvictionPolicy, register_policy


@register_policy
class MRUPolicy(EvictionPolicy):
    """Most recently used first: a cyclic scan larger than the cache keeps a part of it resident."""

    name = "mru"

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()  # most recent at the back

    def insert(self, key, parent=None) -> None:
        if key in self._order:
            raise ValueError(f"key already present: {key!r}")
        self._order[key] = None

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Optional[Hashable]:
        return self._order.popitem(last=True)[0] if self._order else None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key) -> bool:
        return key in self._order
