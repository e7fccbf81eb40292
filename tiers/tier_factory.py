"""Builds the page store and daemon of one configured tier."""
from __future__ import annotations

from tiers.config import NodeConfig, TierConfig
from tiers.daemon import TierDaemon
from tiers.demotion import DemotionLink
from tiers.store import PageStore


def build_store(tier: TierConfig, quotas=None) -> PageStore:
    """The store for a tier's kind, from its configuration."""
    if tier.kind == "dram":
        from tiers.dram import DramStore
        return DramStore(tier.capacity, tier.policy, block_size=tier.options["block_size"],
                         max_page_bytes=tier.max_page_bytes, name=tier.name, prefault=tier.options["prefault"],
                         quotas=quotas)
    if tier.kind == "nvme":
        from tiers.nvme import NvmeStore
        return NvmeStore.from_config(tier, quotas)
    if tier.kind == "remote":
        from tiers.remote.store import RemoteStore
        return RemoteStore.from_config(tier)
    if tier.kind == "mooncake_store":
        from tiers.remote.mooncake_store import MooncakeStoreTier
        return MooncakeStoreTier.from_config(tier)
    raise ValueError(f"tier kind {tier.kind!r} has no store of its own (a pool runs as its daemon)")


def build_daemon(node: NodeConfig, tier: TierConfig) -> TierDaemon:
    """A daemon serving tier on its endpoint (and its fd socket for ipc endpoints)."""
    if tier.kind == "pool":  # a remote memory pool: no tier below, no host pool of its own
        from tiers.remote.pool_daemon import build_pool_daemon
        return build_pool_daemon(node, tier)
    store = build_store(tier, node.quotas)
    fd_socket = tier.fd_socket(node.runtime_dir) if tier.endpoint.startswith("ipc://") else None
    io_threads = int(tier.options.get("io_threads", 1)) if store.parallel_io else 1
    position = [t.name for t in node.tiers].index(tier.name)
    below = node.tiers[position + 1] if position + 1 < len(node.tiers) else None
    lower = DemotionLink(below.name, below.endpoint, curve=below.curve) if below is not None else None
    return TierDaemon(tier.name, store, tier.endpoint, fd_socket=fd_socket, max_page_bytes=tier.max_page_bytes,
                      io_threads=io_threads, lower=lower, max_dirty_pages=node.max_dirty_pages,
                      staging_bytes=tier.staging_bytes, max_region_bytes=tier.max_region_bytes,
                      max_inflight_bytes=tier.max_inflight_bytes, demotion_queue_bytes=node.demotion_queue_bytes,
                      curve=tier.curve)
