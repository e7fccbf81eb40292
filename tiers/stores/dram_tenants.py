"""The DRAM tier's namespaces: each one's policy and figures, the fair share and quotas they evict by.

Which namespace gives up a page when the arena is full is
tiers/stores/fairness.py's choice, from the bytes kept here; the plan it
answers by is kept for the last writer while the usage changes only as the
plan knows.  No lock of its own: the store (tiers/stores/dram.py) calls it
under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tiers.plugins import make_policy
from tiers.policies import EvictionPolicy
from tiers.stores.base import PageKey
from tiers.stores.fairness import FairShare, GroupUsage, VictimPlan


@dataclass
class Tenant:
    """One namespace's policy and figures."""

    policy: EvictionPolicy
    bytes: int = 0
    hits: int = 0
    evictions: int = 0


class Tenants:
    """The namespaces by name, and the fair share and quotas they evict by."""

    def __init__(self, capacity: int, quotas: Optional[Mapping[str, int]], policy: str):
        self._policy_name = policy
        self.by_name: Dict[str, Tenant] = {}
        self.fair = FairShare(capacity, quotas)
        # Fairness's plan of victims for the last writer (tiers/stores/fairness.py VictimPlan), good while the
        # usage changed only by its victims and the writer's own batch: (usage version, writer, over quota,
        # plan, the writer's pending bytes it knows of).  Evicting page after page walks the namespaces once.
        self._victim_plan = None
        self._usage_version = 0
        self.groups = GroupUsage()  # each quota'd group's bytes and its namespaces by bytes, kept current

    def tenant(self, namespace: str) -> Tenant:
        tenant = self.by_name.get(namespace)
        if tenant is None:
            tenant = self.by_name[namespace] = Tenant(make_policy(self._policy_name))
        return tenant

    def get(self, namespace: Optional[str]) -> Optional[Tenant]:
        return self.by_name.get(namespace)

    def assign(self, namespace: str, tenant: str, quota: Optional[int] = None) -> None:
        self.fair.assign(namespace, ("tenant", tenant), quota)
        self.regrouped()

    def regrouped(self) -> None:
        """The namespaces or their groups changed wholesale: the kept plan and group sums no longer hold."""
        self._usage_version += 1
        self.groups.clear()

    def prune(self) -> int:
        """Forget the namespaces that hold nothing; how many."""
        empty = [ns for ns, t in self.by_name.items() if not t.bytes and not len(t.policy)]
        for ns in empty:
            del self.by_name[ns]
        self.regrouped()
        return len(empty)

    def clear(self) -> None:
        self.by_name.clear()
        self.regrouped()

    # ------------------------------------------------------ victim choice
    def plan_for(self, writer: Optional[str], over: bool, grown: int) -> VictimPlan:
        """Fairness's plan of the namespaces that give way to writer (over its quota or not), counting grown
        bytes of its batch as its own: the plan kept for it while the usage changed only as that plan knows,
        else a new one."""
        kept = self._victim_plan
        if kept is not None and kept[:3] == (self._usage_version, writer, over):
            plan = kept[3]
            if grown != kept[4]:
                plan.grew(writer, grown - kept[4])
            return plan
        held = {ns: t.bytes for ns, t in self.by_name.items()}
        if grown:
            held[writer] += grown
        return VictimPlan(self.fair, writer, held, over)

    def keep_plan(self, writer: Optional[str], over: bool, plan: VictimPlan, grown: int) -> None:
        """plan gave the writer a victim: kept for its next, as of the usage now."""
        self._victim_plan = (self._usage_version, writer, over, plan, grown)

    # ---------------------------------------------------------- usage
    def committed(self, namespace: str, tenant: Tenant, added: int) -> None:
        """namespace's pages of a batch, added bytes, are committed."""
        tenant.bytes += added
        self._bytes_changed(namespace, tenant, added)
        kept = self._victim_plan
        if kept is not None and kept[:2] == (self._usage_version, namespace):
            # The writer's batch, counted by its plan as pending, is its own now: the plan stays good.
            self._victim_plan = kept[:4] + (kept[4] - added,)
        else:
            self._usage_version += 1

    def released_many(self, namespace: str, keys: Sequence[PageKey], size: int, planned: bool = False) -> None:
        """namespace's pages keys, size bytes in all, left the tier (victims its policy popped are told too:
        a plug-in may keep more of a page than its place in the order); planned: victims the kept plan chose
        (it counted what they gave, so it stays good)."""
        tenant = self.by_name[namespace]
        tenant.bytes -= size
        remove = tenant.policy.remove
        for key in keys:
            remove(key)
        kept = self._victim_plan
        current = planned and kept is not None and kept[0] == self._usage_version
        self._usage_version += 1
        if current:
            self._victim_plan = (self._usage_version,) + kept[1:]
        self._bytes_changed(namespace, tenant, -size)

    def quota_room(self, namespace: str) -> Optional[Tuple[int, str, int]]:
        """(bytes namespace may still add, the namespace that gives way when it adds more, what that quota's
        holder holds) under the tighter of its [quotas] entry and its tenant's quota; None: no quota."""
        room = None
        tenant = self.by_name.get(namespace)
        own = tenant.bytes if tenant is not None else 0
        limit = self.fair.quota(namespace)
        if limit is not None:
            room = (limit - own, namespace, own)
        group_limit, members = self.fair.group_quota(namespace)
        if group_limit is not None:
            group = self.fair.group(namespace)
            total = self.groups.total(group, members, self.bytes_of)
            if room is None or group_limit - total < room[0]:
                # The tenant's largest namespace gives way (of equals, the smallest name): a tenant's newest
                # namespace does not evict its own pages while older ones hold more.
                giver = self.groups.largest(group, members, self.bytes_of) or namespace
                room = (group_limit - total, giver, total)
        return room

    def bytes_of(self, namespace: str) -> int:
        tenant = self.by_name.get(namespace)
        return tenant.bytes if tenant is not None else 0

    def _bytes_changed(self, namespace: str, tenant: Tenant, delta: int) -> None:
        if self.groups:
            self.groups.changed(self.fair.group(namespace), delta, namespace, tenant.bytes, len(self.by_name))

    def figures(self, namespace: str) -> Optional[dict]:
        """One namespace's figures for a tenant's stats (no fair share: that walks every namespace)."""
        t = self.by_name.get(namespace)
        if t is None or not (t.bytes or t.hits or t.evictions):
            return None
        return {"bytes": t.bytes, "pages": len(t.policy), "hits": t.hits, "evictions": t.evictions,
                "quota": self.fair.quota(namespace) or 0}

    def per_namespace(self) -> Dict[str, dict]:
        """Each namespace's figures for stats (those that hold, were read or gave way)."""
        # Counted once, not once a namespace: with thousands of namespaces that sum made stats quadratic
        # (seconds under the store lock).
        fair_share = int(self.fair.share(len(self.fair.groups_held({ns: t.bytes for ns, t in self.by_name.items()}))))
        return {ns: {"bytes": t.bytes, "pages": len(t.policy), "hits": t.hits, "evictions": t.evictions,
                     "fair_share": fair_share, "quota": self.fair.quota(ns) or 0}
                for ns, t in self.by_name.items() if t.bytes or t.hits or t.evictions}
