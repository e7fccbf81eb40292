"""LRU, FIFO and LFU: the classic policies, each O(1) per operation."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Optional

from tiers.policies.base import EvictionPolicy, register_policy


class _OrderedPolicy(EvictionPolicy):
    """Keys in an OrderedDict, victim at the front."""

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key, parent=None) -> None:
        if key in self._order:
            raise ValueError(f"key already present: {key!r}")
        self._order[key] = None

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Optional[Hashable]:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key) -> bool:
        return key in self._order


@register_policy
class LRUPolicy(_OrderedPolicy):
    """Least recently used: a hit moves the key to the back."""

    name = "lru"

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)


@register_policy
class FIFOPolicy(_OrderedPolicy):
    """First in, first out: hits change nothing."""

    name = "fifo"

    def touch(self, key) -> None:
        pass


@register_policy
class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by least recent (O(1) frequency buckets).

    Counts start at 1 on insert and grow by one per hit; a key's count is
    forgotten when it leaves (no ghost history).
    """

    name = "lfu"

    def __init__(self) -> None:
        self._count: Dict[Hashable, int] = {}
        # count -> keys at that count, oldest first; dicts keep insertion order.
        self._buckets: Dict[int, Dict[Hashable, None]] = {}
        self._min = 0

    def insert(self, key, parent=None) -> None:
        if key in self._count:
            raise ValueError(f"key already present: {key!r}")
        self._count[key] = 1
        self._buckets.setdefault(1, {})[key] = None
        self._min = 1

    def touch(self, key) -> None:
        count = self._count.get(key)
        if count is None:
            return
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if self._min == count:
                self._min = count + 1
        self._count[key] = count + 1
        self._buckets.setdefault(count + 1, {})[key] = None

    def remove(self, key) -> None:
        count = self._count.pop(key, None)
        if count is None:
            return
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if self._min == count:
                self._min = min(self._buckets, default=0)  # rare: O(distinct counts)

    def pop_victim(self) -> Optional[Hashable]:
        if not self._count:
            return None
        bucket = self._buckets[self._min]
        key = next(iter(bucket))
        self.remove(key)
        return key

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key) -> bool:
        return key in self._count
