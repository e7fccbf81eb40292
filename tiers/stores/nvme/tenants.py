"""The NVMe ledger's namespaces: their numbers in the index, bytes held and reserved, quotas and fair share.

Each namespace is a tenant of the native index (tiers/stores/page_index.py
numbers up to MAX_TENANTS of them) and evicts by its own order; which of
them gives up a chunk when space is needed is tiers/stores/fairness.py's
choice, from the bytes kept here.  No lock and no I/O of its own: the ledger
(tiers/stores/nvme/ledger.py) calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from tiers.plugins import make_policy
from tiers.policies import EvictionPolicy
from tiers.stores.base import StoreFull
from tiers.stores.fairness import FairShare, GroupUsage, VictimPlan
from tiers.stores.page_index import MAX_TENANTS, PageIndex


@dataclass
class Tenant:
    """One namespace (known by its hash; by name once a page of it was written or read) and its policy."""

    number: int  # the tenant of its rows in the index
    ns_hash: int
    policy: Optional[EvictionPolicy]  # None: the index keeps the order (LRU, FIFO)
    name: Optional[str] = None
    bytes: int = 0
    reserved: int = 0  # writes in flight: a quota counts them too
    hits: int = 0
    evictions: int = 0


class Tenants:
    """The namespaces by hash and by their number in the index, and the fair share and quotas they evict by."""

    def __init__(self, capacity: int, quotas: Optional[Dict[str, int]], policy: str, native_order: bool):
        self._policy_name = policy
        self._native_order = native_order
        self.by_hash: Dict[int, Tenant] = {}  # by namespace hash: each namespace evicts by its own order
        self.numbered: Dict[int, Tenant] = {}  # the same, by their number in the index
        self.fair = FairShare(capacity, quotas)
        # Fairness's plan of victims for the last writer (tiers/stores/fairness.py VictimPlan), good while the
        # usage changed only by its own victims: (usage version, writer, over quota, plan).  A put that evicts
        # page after page walks the namespaces once, not once a page.
        self._victim_plan: Optional[Tuple[int, Optional[int], bool, VictimPlan]] = None
        self._usage_version = 0
        # Each quota'd group's bytes held and reserved, and its namespaces by bytes held, kept current.
        self.groups = GroupUsage()

    def new_policy(self) -> EvictionPolicy:
        return make_policy(self._policy_name)

    def assign(self, ns_hash: int, tenant: str, quota: Optional[int] = None) -> None:
        """The namespace of ns_hash counts toward tenant's fair share, and toward its quota when one is given."""
        self.fair.assign(ns_hash, ("tenant", tenant), quota)
        self.regrouped()

    def regrouped(self) -> None:
        """The namespaces' bytes or groups changed wholesale (a tenant assigned, rows loaded or scanned): the
        kept plan and group sums no longer hold."""
        self._usage_version += 1
        self.groups.clear()

    def usage_changed(self) -> None:
        """Bytes held moved other than as the kept plan knows: the next victim needs a new plan."""
        self._usage_version += 1

    def get(self, ns_hash: int) -> Optional[Tenant]:
        return self.by_hash.get(ns_hash)

    def tenant(self, ns_hash: int, index: PageIndex, name: Optional[str] = None) -> Tenant:
        """ns_hash's tenant, numbered in index when it is new; named name when one is given."""
        tenant = self.by_hash.get(ns_hash)
        if tenant is None:
            number = len(self.numbered)
            if number >= MAX_TENANTS:  # reuse the number of a namespace that holds nothing
                number = next((t.number for t in self.numbered.values() if not t.bytes and not t.reserved
                               and not self.pages(t, index)), None)
                if number is None:
                    raise StoreFull(f"{MAX_TENANTS} namespaces hold chunks here; no room for another")
                del self.by_hash[self.numbered[number].ns_hash]
            tenant = Tenant(number, ns_hash, None if self._native_order else self.new_policy())
            self.by_hash[ns_hash] = self.numbered[number] = tenant
        if name is not None:
            tenant.name = name
        return tenant

    @staticmethod
    def pages(tenant: Tenant, index: PageIndex) -> int:
        return index.count(tenant.number) if tenant.policy is None else len(tenant.policy)

    def table(self) -> List[Tuple[int, Optional[str]]]:
        """(namespace hash, name) of each tenant number, in number order (tiers/stores/nvme/snapshot.py)."""
        return [(self.numbered[n].ns_hash, self.numbered[n].name) for n in range(len(self.numbered))]

    def install_orders(self, policies: Dict[int, EvictionPolicy]) -> None:
        """Each namespace's eviction order from policies (by hash; an empty one where it has none)."""
        for ns_hash, tenant in self.by_hash.items():
            tenant.policy = policies.get(ns_hash) or self.new_policy()

    def clear(self) -> None:
        self.by_hash.clear()
        self.numbered.clear()
        self.groups.clear()

    # ------------------------------------------------------ victim choice
    def plan_for(self, writer: Optional[int], need: int) -> VictimPlan:
        """Fairness's plan of the namespaces that give way to writer, which needs need bytes more: the plan
        kept for it while the usage changed only as that plan knows, else a new one (kept from now on)."""
        own = self.by_hash.get(writer) if writer is not None else None
        over = own is not None and own.name is not None and self.fair.over_quota(own.name, own.bytes + need)
        kept = self._victim_plan
        if kept is not None and kept[:3] == (self._usage_version, writer, over):
            return kept[3]
        plan = VictimPlan(self.fair, writer, {h: t.bytes for h, t in self.by_hash.items()}, over)
        self._victim_plan = (self._usage_version, writer, over, plan)
        return plan

    def grew(self, ns_hash: int, nbytes: int) -> None:
        """ns_hash holds nbytes more, committed."""
        kept = self._victim_plan
        if kept is not None and kept[:2] == (self._usage_version, ns_hash):
            kept[3].grew(ns_hash, nbytes)  # the writer's own pages: its plan stays good
        else:
            self._usage_version += 1

    # ------------------------------------------------------------- quotas
    def quota(self, namespace: str) -> Optional[int]:
        return self.fair.quota(namespace)

    def group_givers(self, ns_hash: int, nbytes: int) -> Iterator[Optional[int]]:
        """While the quota of ns_hash's tenant cannot take nbytes more: the namespace of it that gives way next,
        its largest (None: none holds anything); asked again once that one gave."""
        limit, members = self.fair.group_quota(ns_hash)
        while limit is not None:
            group = self.fair.group(ns_hash)
            if self.groups.total(group, members, self._held_and_reserved) + nbytes <= limit:
                return
            yield self.groups.largest(group, members, self._held)

    def held_changed(self, ns_hash: int, delta: int, tenant: Optional[Tenant] = None) -> None:
        """A namespace's bytes held plus reserved moved by delta (tenant, when its bytes held changed)."""
        if self.groups:
            self.groups.changed(self.fair.group(ns_hash), delta, None if tenant is None else ns_hash,
                                0 if tenant is None else tenant.bytes, len(self.by_hash))

    def _held(self, ns_hash: int) -> int:
        tenant = self.by_hash.get(ns_hash)
        return tenant.bytes if tenant is not None else 0

    def _held_and_reserved(self, ns_hash: int) -> int:
        tenant = self.by_hash.get(ns_hash)
        return tenant.bytes + tenant.reserved if tenant is not None else 0

    def figures(self, ns_hash: int, index: PageIndex) -> Optional[dict]:
        """One namespace's figures for a tenant's stats (no fair share: that counts every namespace)."""
        t = self.by_hash.get(ns_hash)
        if t is None or not (t.bytes or t.hits or t.evictions):
            return None
        return {"bytes": t.bytes, "pages": self.pages(t, index), "hits": t.hits, "evictions": t.evictions,
                "quota": (self.fair.quota(t.name) or 0) if t.name else 0}

    def per_namespace(self, index: PageIndex) -> Dict[str, dict]:
        """Each namespace's figures for stats (those that hold, were read or gave way)."""
        active = sum(1 for t in self.by_hash.values() if t.bytes)
        return {(t.name or f"#{h:x}"): {"bytes": t.bytes, "pages": self.pages(t, index), "hits": t.hits,
                                        "evictions": t.evictions, "fair_share": int(self.fair.share(active)),
                                        "quota": (self.fair.quota(t.name) or 0) if t.name else 0}
                for h, t in self.by_hash.items() if t.bytes or t.hits or t.evictions}
