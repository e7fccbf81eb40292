"""Builds the page store and daemon of one configured tier (kinds come from tiers/plugins.py)."""
from __future__ import annotations

import os
from typing import Optional

from tiers.ops.config import NodeConfig, TierConfig
from tiers.ops.tenants import TenantTable
from tiers.node.daemon import TierDaemon
from tiers.node.demotion import Demoter, DemotionLink
from tiers.node.faults import CorruptReads
from tiers.plugins import store_kind
from tiers.stores.base import EvictionListener, PageStore


def build_store(tier: TierConfig, quotas=None, evictions: Optional[EvictionListener] = None) -> PageStore:
    """The store for a tier's kind, built by the kind's declaration (tiers/plugins.py).

    evictions hears of every page the store evicts (the daemon's Demoter when a tier is below).
    """
    if tier.kind == "pool":
        raise ValueError("a pool runs as a daemon of its own, not as a store of a tier daemon")
    store = store_kind(tier.kind).build(tier, quotas, evictions)
    if not isinstance(store, PageStore):
        raise TypeError(f"tier kind {tier.kind} built a {type(store).__name__}, not a tiers.stores.base.PageStore")
    return store


def build_daemon(node: NodeConfig, tier: TierConfig) -> TierDaemon:
    """A daemon serving tier on its endpoint (and its fd socket for ipc endpoints)."""
    if tier.kind == "pool":  # a remote memory pool: no tier below, no host pool of its own
        from tiers.stores.remote.pool_daemon import build_pool_daemon
        return build_pool_daemon(node, tier)
    position = [t.name for t in node.tiers].index(tier.name)
    below = node.tiers[position + 1] if position + 1 < len(node.tiers) else None
    demoter = None
    if below is not None:
        demoter = Demoter(DemotionLink(below.name, below.endpoint, curve=below.curve), node.max_dirty_pages,
                          node.demotion_queue_bytes)
    try:
        store = build_store(tier, node.quotas, demoter)
    except BaseException:
        if demoter is not None:
            demoter.discard()
        raise
    arena = store.export_arena()
    if demoter is not None and arena is not None and below.endpoint.startswith("ipc://"):
        demoter.share_arena(arena)  # pages go down through shared memory, aligned (tiers/node/demotion.py)
    fd_socket = tier.fd_socket(node.runtime_dir) if tier.endpoint.startswith("ipc://") else None
    io_threads = int(tier.options.get("io_threads", 1)) if store.parallel_io else 1
    return TierDaemon(tier.name, store, tier.endpoint, fd_socket=fd_socket, max_page_bytes=tier.max_page_bytes,
                      io_threads=io_threads, demoter=demoter, staging_bytes=tier.staging_bytes,
                      max_region_bytes=tier.max_region_bytes, max_inflight_bytes=tier.max_inflight_bytes,
                      curve=tier.curve, corrupt_reads=CorruptReads.from_environ(tier.name, os.environ),
                      tenants=TenantTable(node.tenants), socket_gid=node.socket_gid,
                      connection_idle_s=node.connection_idle_s)
