"""Which tenant gives up space when a shared tier is full.

Every engine of a node shares its tiers; a namespace (one model's pages of one
shard and format) is a tenant.  Each namespace has its own eviction policy,
and when space is needed the victim comes from:
1. the writer's own namespace, when it is over its quota (if one is set);
2. otherwise the namespace most above its fair share, capacity divided by the
   namespaces holding pages (so no namespace pushes another below
   min(its usage, its fair share));
3. otherwise the writer's own namespace.
A quota is matched by the longest configured prefix of the namespace (a model
name matches all its shards).
"""
from __future__ import annotations

from typing import Dict, Hashable, Mapping, Optional


class FairShare:
    """Chooses the namespace to evict from; the store owns the usage figures."""

    def __init__(self, capacity: int, quotas: Optional[Mapping[str, int]] = None):
        self.capacity = capacity
        # Longest prefix first, so "llama.tp0" wins over "llama".
        self.quotas = sorted((quotas or {}).items(), key=lambda kv: -len(kv[0]))

    def quota(self, namespace: str) -> Optional[int]:
        """Bytes namespace may hold (None: no quota of its own)."""
        for prefix, limit in self.quotas:
            if namespace.startswith(prefix):
                return limit
        return None

    def share(self, active: int) -> float:
        return self.capacity / max(1, active)

    def over_quota(self, namespace: str, usage: int) -> bool:
        limit = self.quota(namespace)
        return limit is not None and usage > limit

    def victim(self, writer: Optional[Hashable], usage: Mapping[Hashable, int],
               writer_over_quota: bool = False) -> Optional[Hashable]:
        """The namespace that loses a page so writer can store more (None: nothing held).

        Namespaces are any hashable name (the NVMe tier knows some only by a hash of it).
        """
        held = {ns: n for ns, n in usage.items() if n > 0}
        if not held:
            return None
        if writer is not None and writer in held and writer_over_quota:
            return writer
        share = self.share(len(held) + (0 if writer is None or writer in held else 1))
        worst, excess = None, 0.0
        for ns, n in held.items():
            over = n - share
            if over > excess or (over == excess and ns == writer and over > 0):
                worst, excess = ns, over
        if worst is not None:
            return worst
        return writer if writer in held else max(held, key=held.get)


def bounded_top(per_namespace: Dict[str, dict], limit: int = 32, by: str = "bytes") -> Dict[str, dict]:
    """The limit largest namespaces by one figure (metrics keep their label cardinality bounded)."""
    if len(per_namespace) <= limit:
        return per_namespace
    top = sorted(per_namespace, key=lambda ns: -per_namespace[ns].get(by, 0))[:limit]
    return {ns: per_namespace[ns] for ns in top}
