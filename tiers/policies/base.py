"""The policy interface every eviction policy implements (found by name through tiers/plugins.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Optional, Type

class EvictionPolicy(ABC):
    """Decides eviction order; owns no data and no sizes."""

    name = ""
    # True when inserting keys never changes which of the keys already present goes next, and an inserted
    # key never goes while a key present before it remains (LRU, FIFO): a store may then make room for a
    # whole batch before inserting any of it and evict exactly what inserting page by page would.  Not so
    # for S3-FIFO (a new key may go first), LFU (new keys have the lowest count) or radix-LRU (a new child
    # keeps its parent).
    evicts_new_pages_last = False

    @abstractmethod
    def insert(self, key: Hashable, parent: Optional[Hashable] = None) -> None:
        """Record a new key (ValueError if it is already present)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record a hit on key; unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forget key without counting an eviction; unknown keys are ignored."""

    @abstractmethod
    def pop_victim(self) -> Optional[Hashable]:
        """Remove and return the next key to evict, or None when empty."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


def register_policy(cls: Type[EvictionPolicy]) -> Type[EvictionPolicy]:
    """Class decorator for a policy class: checks it names itself.

    Policies are found by name through tiers/plugins.py (the built-ins in
    BUILTIN_POLICIES, others by entry point), never by import side effects.
    """
    if not cls.name or cls.name != cls.name.lower():
        raise ValueError(f"policy class {cls.__name__} needs a lower-case name, got {cls.name!r}")
    return cls
