"""Prefix-aware eviction: only leaves of the prefix tree go, least recently used first."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Optional, Set

from tiers.policies.base import EvictionPolicy, register_policy


@register_policy
class RadixLRUPolicy(EvictionPolicy):
    """LRU among leaves of the prefix tree, as a radix-tree KV cache evicts.

    A block is useless once an earlier block of its prefix is gone, so a key
    that still has resident children (keys inserted with it as ``parent``) is
    never the victim.  Keys sit in one recency list; when a key with children
    reaches the old end it is parked, and when its last child leaves it comes
    back at the old end (it was older than every listed key when parked): a
    cold branch is then evicted from its tail inward, block after block.  Each key is parked
    at most once per read, so pop_victim is O(1) amortised.  A key whose
    parent is not resident is a root.
    """

    name = "radix-lru"

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()  # listed keys, least recent first
        self._parked: Set[Hashable] = set()  # keys with children that reached the old end
        self._parent: Dict[Hashable, Hashable] = {}
        self._children: Dict[Hashable, Set[Hashable]] = {}

    def insert(self, key, parent=None) -> None:
        if key in self._order or key in self._parked:
            raise ValueError(f"key already present: {key!r}")
        self._order[key] = None
        if parent is not None and parent != key and (parent in self._order or parent in self._parked):
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        elif key in self._parked:
            self._parked.discard(key)
            self._order[key] = None

    def remove(self, key) -> None:
        if key in self._order:
            del self._order[key]
        elif key in self._parked:
            self._parked.discard(key)
        else:
            return
        for child in self._children.pop(key, ()):
            del self._parent[child]  # the children become roots
        self._detach(key)

    def pop_victim(self) -> Optional[Hashable]:
        order = self._order
        while order:
            key = next(iter(order))
            del order[key]
            if key in self._children:
                self._parked.add(key)
                continue
            self._detach(key)
            return key
        return None

    def _detach(self, key: Hashable) -> None:
        """Drop key from its parent's children; a parked parent left childless returns at the old end."""
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        siblings = self._children[parent]
        siblings.discard(key)
        if siblings:
            return
        del self._children[parent]
        if parent in self._parked:
            self._parked.discard(parent)
            self._order[parent] = None
            self._order.move_to_end(parent, last=False)

    def __len__(self) -> int:
        return len(self._order) + len(self._parked)

    def __contains__(self, key) -> bool:
        return key in self._order or key in self._parked
