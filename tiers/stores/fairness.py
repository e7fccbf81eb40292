"""Which tenant gives up space when a shared tier is full.

Every engine of a node shares its tiers.  Each namespace (one model's pages of
one shard and format) has its own eviction policy; namespaces are grouped for
fairness: the namespaces of one configured tenant (tiers/node/tenants.py) are
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

import heapq
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Set, Tuple

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


class VictimPlan:
    """The namespaces that give way to one writer, by the rules of this module, asked again and again while
    they give bytes back: O(namespaces) once, then O(log namespaces) a victim.

    A full tier evicts page after page for each put; walking every namespace each time, a 128-page put of a
    full NVMe tier holding pages of 5,000 namespaces took 247 ms (3.8 with 100).  The plan keeps the
    groups' and namespaces' bytes in heaps (most bytes first, then the smallest name, the order the rules
    break ties in); gave() records what a victim gave.  It answers exactly as the rules walked in full
    would on the same usage (tests/test_fair_choice.py holds it to them); the owner makes a new plan when
    anything else changes the usage."""

    def __init__(self, fair: "FairShare", writer: Optional[Hashable], usage: Mapping[Hashable, int],
                 writer_over_quota: bool = False):
        self.fair, self.writer, self.over = fair, writer, writer_over_quota
        self.held: Dict[Hashable, int] = {ns: n for ns, n in usage.items() if n > 0}
        self.groups = fair.groups_held(self.held)
        self.own = fair.group(writer) if writer is not None else None
        self._groups_heap = _most_first(self.groups.items())
        self._members: Dict[Hashable, List[Tuple[int, str, Hashable]]] = {}  # group -> its namespaces, lazily
        self._all: Optional[List[Tuple[int, str, Hashable]]] = None  # every namespace, lazily

    def next(self) -> Optional[Hashable]:
        """The namespace that gives the next page (None: nothing held), as the rules would answer now."""
        held, writer = self.held, self.writer
        if not held:
            return None
        if writer is not None and writer in held and self.over:
            return writer
        own = self.own
        share = self.fair.share(len(self.groups) + (0 if writer is None or own in self.groups else 1))
        top = _first_current(self._groups_heap, self.groups.get)
        if top is not None and self.groups[top] - share > 0:
            worst = top
            if own is not None and own != worst and self.groups.get(own) == self.groups[top]:
                worst = own  # of groups equally far above their share, the writer's own gives
            return self._member(worst)
        if own in self.groups:
            return self._member(own)
        if self._all is None:
            self._all = _most_first(held.items())
        return _first_current(self._all, held.get)

    def grew(self, namespace: Hashable, nbytes: int) -> None:
        """namespace holds nbytes more (a writer's batch counted as its own as it reserves)."""
        self.gave(namespace, -nbytes)

    def gave(self, namespace: Hashable, nbytes: int) -> None:
        """namespace gave nbytes (a victim of it was taken)."""
        left = self.held.get(namespace, 0) - nbytes
        group = self.fair._group.get(namespace, namespace)
        in_group = self.groups.get(group, 0) - nbytes
        if left > 0:
            self.held[namespace] = left
            for heap in (self._members.get(group), self._all):
                if heap is not None:
                    heapq.heappush(heap, (-left, _name(namespace), namespace))
        else:
            self.held.pop(namespace, None)
        if in_group > 0:
            self.groups[group] = in_group
            heapq.heappush(self._groups_heap, (-in_group, _name(group), group))
        else:
            self.groups.pop(group, None)
        if len(self._groups_heap) > 2 * len(self.groups) + 64:  # a plan kept long: drop its stale entries
            self._groups_heap = _most_first(self.groups.items())
            self._members.clear()
            self._all = None

    def _member(self, group: Hashable) -> Hashable:
        """FairShare._member: the writer's own namespace, the group's namespace itself, or its largest."""
        writer = self.writer
        if writer in self.held and self.fair.group(writer) == group:
            return writer
        if group in self.held and group not in self.fair._group:
            return group
        heap = self._members.get(group)
        if heap is None:
            heap = self._members[group] = _most_first((ns, n) for ns, n in self.held.items()
                                                      if self.fair._group.get(ns, ns) == group)
        return _first_current(heap, self.held.get)


class GroupUsage:
    """Each quota'd group's usage kept current as a store reports changes, instead of summing the group's
    namespaces for every page: its total (what its quota is checked against) and its namespaces by bytes
    held, most first (which one gives way when it is over).  A tenant of 5,000 namespaces paid 84 ms a
    128-page NVMe put for the sums, and a walk of them a victim past its quota.  Both are caches: absent
    until asked, then moved by changed(); clear() when groups change shape (a tenant assigned)."""

    def __init__(self):
        self._totals: Dict[Hashable, int] = {}
        self._largest: Dict[Hashable, List[Tuple[int, str, Hashable]]] = {}

    def clear(self) -> None:
        self._totals.clear()
        self._largest.clear()

    def total(self, group: Hashable, members: Iterable[Hashable], amount_of) -> int:
        """The group's total of amount_of(namespace) over members, summed once."""
        total = self._totals.get(group)
        if total is None:
            total = self._totals[group] = sum(amount_of(ns) for ns in members)
        return total

    def known(self, group: Hashable) -> Optional[int]:
        """The group's kept total, None when it is not kept."""
        return self._totals.get(group)

    def largest(self, group: Hashable, members: Iterable[Hashable], held_of) -> Optional[Hashable]:
        """The member holding the most (of equals the smallest name); None: none holds any."""
        heap = self._largest.get(group)
        if heap is None:
            heap = self._largest[group] = _most_first((ns, held_of(ns)) for ns in members)
        return _first_current(heap, held_of)

    def changed(self, group: Hashable, delta: int, namespace: Optional[Hashable] = None, held: int = 0,
                namespaces: int = 0) -> None:
        """The group's amount moved by delta; namespace (when given) holds held bytes now.  namespaces: how
        many the store knows (a heap far larger is mostly stale and is made again when next asked)."""
        if group in self._totals:
            self._totals[group] += delta
        heap = self._largest.get(group) if namespace is not None else None
        if heap is not None and held > 0:
            if len(heap) > 2 * namespaces + 64:
                del self._largest[group]
            else:
                heapq.heappush(heap, (-held, _name(namespace), namespace))

    def __bool__(self) -> bool:
        return bool(self._totals or self._largest)


def _most_first(amounts: Iterable[Tuple[Hashable, int]]) -> List[Tuple[int, str, Hashable]]:
    """A heap of (name, bytes) pairs holding bytes: most first, of equals the smallest name (the rules' order)."""
    heap = [(-n, _name(key), key) for key, n in amounts if n > 0]
    heapq.heapify(heap)
    return heap


def _first_current(heap: List[Tuple[int, str, Hashable]], amount_of) -> Optional[Hashable]:
    """The heap's first entry still true (amount_of(key) is what it says); stale ones go: entries are pushed
    anew as amounts change, never updated in place."""
    while heap:
        n, _n, key = heap[0]
        if amount_of(key) == -n:
            return key
        heapq.heappop(heap)
    return None


def _name(namespace: Hashable) -> str:
    return str(namespace)


def bounded_top(per_namespace: Dict[str, dict], limit: int = 32, by: str = "bytes") -> Dict[str, dict]:
    """The limit largest namespaces by one figure (metrics keep their label cardinality bounded)."""
    if len(per_namespace) <= limit:
        return per_namespace
    top = sorted(per_namespace, key=lambda ns: -per_namespace[ns].get(by, 0))[:limit]
    return {ns: per_namespace[ns] for ns in top}
