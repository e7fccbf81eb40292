"""The policy interface and the one registry of policies by name."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, Hashable, Optional, Type

POLICIES: Dict[str, Type["EvictionPolicy"]] = {}


class EvictionPolicy(ABC):
    """Decides eviction order; owns no data and no sizes."""

    name = ""

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
    """Class decorator: make cls available by its ``name``."""
    if not cls.name or cls.name in POLICIES:
        raise ValueError(f"policy name {cls.name!r} is empty or taken")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list:
    """Names of every registered policy, sorted."""
    return sorted(POLICIES)


def make_policy(name: str, **options) -> EvictionPolicy:
    """Build the policy registered as name (ValueError naming the choices)."""
    try:
        factory: Callable[..., EvictionPolicy] = POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(policy_names())}") from None
    return factory(**options)
