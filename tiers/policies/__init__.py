"""Eviction policies shared by the tier daemons and the experiment tools.

A policy only decides *which* key goes next; the store that owns it keeps the
bytes and the sizes (the cachetools split).  Every operation is O(1)
(amortised) so a daemon can call it per page and a simulator per block.

Contract, exercised by tests/test_policies.py for every registered policy:
- ``insert(key, parent=None)``: a new key enters; ``parent`` is the key of the
  previous block of the same prefix when the caller knows it (prefix-aware
  policies use it, the others ignore it).  Inserting a present key is an error.
- ``touch(key)``: the key was read (a hit).  Unknown keys are ignored.
- ``remove(key)``: the key left for a reason other than eviction (delete,
  overwrite, corruption).  Unknown keys are ignored.
- ``pop_victim()``: remove and return the key to evict next, or None when
  empty.  It mutates on purpose (its name says so): no query has side effects.
- ``len(policy)`` and ``key in policy``.

Policies are found and built by name in tiers/plugins.py (``make_policy``,
``policy_class``, ``policy_names``): the built-ins and those installed by
entry point; this package imports nothing of the registry.
"""
from __future__ import annotations

from tiers.policies.base import EvictionPolicy, register_policy

__all__ = ["EvictionPolicy", "register_policy"]
