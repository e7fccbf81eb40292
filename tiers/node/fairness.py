"""Which tenant gives up space when a shared tier is full.

Every engine of a node shares its tiers.  Each namespace (one model's pages of
one shard and format) has its own eviction policy; namespaces are grouped for
fairness: the namespaces of one configured tenant (tiers/ops/tenants.py) are
one group, so spreading pages over many namespaces gains a tenant nothing; the
operator's namespaces are a group each (the daemon says which is which:
``assign``).  When space is needed the victim comes from:
1. the writer's own namespace, when it is over its quota (if one is set);
2. otherwise the group most above its fair share, capacity divided by the
   groups holding pages (so no group pushes another below min(its usage, its
   fair share)); within that group the writer's own namespace, else the
   group's largest;
3. otherwise the writer's own group (its own namespace first).
A quota is matched by the longest configured prefix of the namespace (a model
name matches all its shards).
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, Mapping, Optional, Set, Tuple

MAX_ASSIGNED = 65536  # namespaces whose group is remembered (past it the oldest is forgotten: its own group)


class FairShare:
    """Chooses the namespace to evict from; the store owns the usage figures."""

    def __init__(self, capacity: int, quotas: Optional[Mapping[str, int]] = None):
        self.capacity = capacity
        # Longest prefix first, so "llama.tp0" wins over "llama".
        self.quotas = sorted((quotas or {}).items(), key=lambda kv: -len(kv[0]))
        self._group: Dict[Hashable, Hashable] = {}  # namespace -> its tenant's group (absent: itself)
        self._members: Dict[Hashable, Set[Hashable]] = {}  # group -> its namespaces
        self._group_quota: Dict[Hashable, int] = {}  # group -> bytes its namespaces may hold together

    def assign(self, namespace: Hashable, group: Hashable, quota: Optional[int] = None) -> None:
        """namespace's pages count toward group's share (and toward its quota, bytes, when one is given)."""
        self._forget(namespace)  # re-inserted last: the most recently assigned are kept
        if len(self._group) >= MAX_ASSIGNED:
            self._forget(next(iter(self._group)))
        self._group[namespace] = group
        self._members.setdefault(group, set()).add(namespace)
        if quota:
            self._group_quota[group] = quota
        else:
            self._group_quota.pop(group, None)

    def _forget(self, namespace: Hashable) -> None:
        group = self._group.pop(namespace, None)
        members = self._members.get(group)
        if members is not None:
            members.discard(namespace)
            if not members:
                del self._members[group]
                self._group_quota.pop(group, None)

    def group_quota(self, namespace: Hashable) -> Tuple[Optional[int], Iterable[Hashable]]:
        """The quota of namespace's group (None: none) and the group's namespaces."""
        group = self._group.get(namespace)
        if group is None:
            return None, ()
        return self._group_quota.get(group), self._members.get(group, ())

    def group(self, namespace: Hashable) -> Hashable:
        return self._group.get(namespace, namespace)

    def groups_held(self, usage: Mapping[Hashable, int]) -> Dict[Hashable, int]:
        """Bytes each group holds, from each namespace's."""
        out: Dict[Hashable, int] = {}
        group_of = self._group.get
        for ns, n in usage.items():
            if n > 0:
                g = group_of(ns, ns)
                out[g] = out.get(g, 0) + n
        return out

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
        groups = self.groups_held(held)
        own = self.group(writer) if writer is not None else None
        share = self.share(len(groups) + (0 if writer is None or own in groups else 1))
        worst, excess = None, 0.0
        for g, n in groups.items():
            over = n - share
            # Ties go to the writer's own group, then to the smallest name: never to whichever namespace
            # happens to come first (forgetting an emptied namespace and meeting it again reorders them).
            if over > excess or (over == excess and over > 0 and worst != own
                                 and (g == own or _name(g) < _name(worst))):
                worst, excess = g, over
        if worst is not None:
            return self._member(worst, writer, held)
        # Nobody above the share: the writer's own group gives (its namespace first), else the largest.
        return self._member(own, writer, held) if own in groups else largest(held, held)

    def _member(self, group: Hashable, writer: Optional[Hashable], held: Mapping[Hashable, int]) -> Hashable:
        """The namespace of group (which holds pages) that gives one: the writer's own if it is one of them
        and holds pages, else the group's largest."""
        if writer in held and self.group(writer) == group:
            return writer
        if group in held and group not in self._group:  # a namespace that is its own group
            return group
        return largest((ns for ns in held if self._group.get(ns, ns) == group), held)


def _name(namespace: Hashable) -> str:
    return str(namespace)


def largest(namespaces: Iterable[Hashable], held: Mapping[Hashable, int]) -> Optional[Hashable]:
    """The namespace holding the most; of equals, the smallest name (an order every process agrees on)."""
    best, most = None, -1
    for ns in namespaces:
        n = held[ns]
        if n > most or (n == most and _name(ns) < _name(best)):
            best, most = ns, n
    return best


def bounded_top(per_namespace: Dict[str, dict], limit: int = 32, by: str = "bytes") -> Dict[str, dict]:
    """The limit largest namespaces by one figure (metrics keep their label cardinality bounded)."""
    if len(per_namespace) <= limit:
        return per_namespace
    top = sorted(per_namespace, key=lambda ns: -per_namespace[ns].get(by, 0))[:limit]
    return {ns: per_namespace[ns] for ns in top}
