"""The backend's settings: SGLang's extra-config keys that are ours, with defaults.

Precedence: the extra-config object, then the node configuration it names
(``tiers_config``), then the defaults here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional

from tiers.config import WRITE_POLICIES

# Keys SGLang itself reads from the same object; never ours to reject.
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size"}


# One line per key, for the README's reference (scripts/readme_reference.py).
SETTINGS_HELP = {
    "tiers_config": "node configuration file the daemons run with; default: the embedded default",
    "runtime_dir": "directory of the daemons' sockets; default: the node configuration's",
    "write_policy": "write_through, write_back or selective; default: the node's write_policy",
    "namespace": "use this namespace instead of the derived one (deployments that share daemons on purpose)",
    "deadline_base_s": "seconds any call may take, plus its bytes at deadline_min_gbps",
    "deadline_min_gbps": "bandwidth (GB/s) below which a transfer is given up",
    "lookup_timeout_s": "seconds a prefix lookup may take",
    "promote": "copy pages served by a lower tier into the top tier",
    "selective_min_reads": "selective policy: reads before a page is written below",
}


@dataclass
class BackendSettings:
    tiers_config: Optional[str] = None  # node TOML; None: the embedded default
    runtime_dir: Optional[str] = None  # where the node's sockets are
    write_policy: Optional[str] = None  # None: the node's default
    namespace: Optional[str] = None  # override the derived namespace (deployments sharing daemons)
    deadline_base_s: float = 1.0  # any call may take this long, plus bytes / deadline_min_gbps
    deadline_min_gbps: float = 0.1
    lookup_timeout_s: float = 0.5
    promote: bool = True  # copy pages read from a lower tier into the top tier
    selective_min_reads: int = 2  # selective: reads before a page is written below

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "BackendSettings":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        values = {}
        for key, value in extra.items():
            if key in SGLANG_KEYS:
                continue
            if key not in known:
                raise ValueError(f"unknown hicache-tiers extra-config key {key!r}; known: {', '.join(sorted(known))}")
            values[key] = value
        settings = cls(**values)
        if settings.write_policy is not None and settings.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {settings.write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        for name in ("deadline_base_s", "deadline_min_gbps", "lookup_timeout_s"):
            if not isinstance(getattr(settings, name), (int, float)) or getattr(settings, name) <= 0:
                raise ValueError(f"{name} must be a positive number")
        return settings


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def derive_namespace(storage_config, pool, shared: Optional[bool] = None) -> str:
    """Model, shard and page format: pages under one namespace are interchangeable.

    MHA ranks each hold their own shard (tp rank and size in the name); MLA
    pages are the same on every rank, so the name leaves the TP rank out.
    ``shared`` overrides that for pools sharded differently from the KV pool
    (a Mamba state is per TP rank even in an MLA model).
    """
    model = _clean(storage_config.model_name or "model")
    parts = [model]
    if shared is None:
        shared = storage_config.is_mla_model
    if shared:
        parts.append("mla")
        if getattr(storage_config, "dcp_size", 1) > 1:
            parts.append(f"dcp{storage_config.dcp_rank}-{storage_config.dcp_size}")
    else:
        parts.append(f"tp{storage_config.tp_rank}-{storage_config.tp_size}")
    if storage_config.pp_size > 1:
        parts.append(f"pp{storage_config.pp_rank}-{storage_config.pp_size}")
    if getattr(storage_config, "attn_cp_size", 1) > 1:
        parts.append(f"cp{storage_config.attn_cp_rank}-{storage_config.attn_cp_size}")
    if pool is not None:
        dtype = str(getattr(pool, "dtype", "")).replace("torch.", "")
        parts += [f"pg{pool.page_size}", _clean(dtype), _clean(getattr(pool, "layout", "layout"))]
    if not (storage_config.extra_config or {}).get("interface_v1"):
        # The legacy path stores SGLang's flat page (all K layers, then all V), a
        # different byte order from v1's regions for layer_first: never mix them.
        parts.append("flat")
    return ".".join(parts)[:400]
