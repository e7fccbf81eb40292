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
    evicts_new_pages_last = True

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)


@register_policy
class FIFOPolicy(_OrderedPolicy):
    """First in, first out: hits change nothing."""

    name = "fifo"
    evicts_new_pages_last = True

    def touch(self, key) -> None:
        pass


@register_policy
class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by least recent (O(1) frequency buckets).

    Counts start at 1 on insert and grow by one per hit; a key's count is
    forgotten when it leaves (no ghost history).  The non-empty counts form a
    linked list in increasing order, so finding the next minimum is O(1).
    """

    name = "lfu"

    def __init__(self) -> None:
        self._count: Dict[Hashable, int] = {}
        # count -> keys at that count, oldest first (OrderedDict: a plain dict's
        # first key costs a scan over the holes left by deletions at its front).
        self._buckets: Dict[int, "OrderedDict[Hashable, None]"] = {}
        self._higher: Dict[int, int] = {}  # non-empty count -> next larger non-empty count (0: none)
        self._lower: Dict[int, int] = {}  # non-empty count -> next smaller non-empty count (0: none)
        self._min = 0

    def _join(self, low: int, high: int) -> None:
        """Link non-empty counts low < high as neighbours (0 stands for the ends of the list)."""
        if low:
            self._higher[low] = high
        else:
            self._min = high
        if high:
            self._lower[high] = low

    def _enter(self, key: Hashable, count: int, below: int) -> None:
        """Put key in bucket count, linking a new bucket just above count below (0: at the bottom)."""
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            above = self._higher[below] if below else self._min
            self._join(below, count)
            self._join(count, above)
        bucket[key] = None
        self._count[key] = count

    def _leave(self, key: Hashable, count: int) -> int:
        """Take key out of bucket count; return the count a new bucket would link above."""
        bucket = self._buckets[count]
        del bucket[key]
        if bucket:
            return count
        del self._buckets[count]
        below, above = self._lower.pop(count), self._higher.pop(count)
        self._join(below, above)
        return below

    def insert(self, key, parent=None) -> None:
        if key in self._count:
            raise ValueError(f"key already present: {key!r}")
        self._enter(key, 1, 0)

    def touch(self, key) -> None:
        count = self._count.get(key)
        if count is not None:
            self._enter(key, count + 1, self._leave(key, count))

    def remove(self, key) -> None:
        count = self._count.pop(key, None)
        if count is not None:
            self._leave(key, count)

    def pop_victim(self) -> Optional[Hashable]:
        if not self._count:
            return None
        key = next(iter(self._buckets[self._min]))
        self.remove(key)
        return key

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key) -> bool:
        return key in self._count
