"""Builds the page store and daemon of one configured tier (kinds come from tiers/plugins.py)."""
from __future__ import annotations

import os
from typing import Optional

from tiers.ops.config import NodeConfig, TierConfig
from tiers.node.tenants import TenantTable
from tiers.node.daemon import TierDaemon
from tiers.node.demotion import Demoter, DemotionLink
from tiers.node.faults import CorruptReads
from tiers.node.pool_daemon import PoolDaemon
from tiers.plugins import store_kind
from tiers.stores.base import EvictionListener, PageStore
from tiers.stores.remote.engine import Engine, EngineConfig
from tiers.stores.remote.pool import PoolStore


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


def endpoint_host(endpoint: str) -> str:
    """The host of a tcp:// endpoint ('' for ipc:// or a wildcard)."""
    if not endpoint.startswith("tcp://"):
        return ""
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return "" if host in ("*", "0.0.0.0", "::") else host


def build_pool_daemon(node: NodeConfig, tier: TierConfig) -> PoolDaemon:
    """A pool daemon for a tier of kind pool: arena, engine, registration (EngineError when it cannot start)."""
    options = tier.options
    host = options.get("te_hostname") or endpoint_host(tier.endpoint)
    if not host:
        raise ValueError(f"tier {tier.name}: te_hostname is needed when the endpoint {tier.endpoint} names no host")
    engine = Engine(EngineConfig.from_options(options, default_host=host))
    store = PoolStore(tier.capacity, tier.policy, block_size=options["block_size"],
                      max_page_bytes=tier.max_page_bytes, max_lease=options["max_lease_ms"] / 1000.0,
                      prefault=options["prefault"])
    return PoolDaemon(tier.name, store, tier.endpoint, engine, max_page_bytes=tier.max_page_bytes, curve=tier.curve)
