"""The backend's settings: SGLang's extra-config keys that are ours, with defaults.

Precedence: the extra-config object, then the node configuration it names
(``tiers_config``), then the defaults here.
"""
from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, fields
from typing import Optional

from tiers.ops.config import WRITE_POLICIES
from tiers.wire.held_wait import DEFAULT_REPLY_SPIN_S

log = logging.getLogger("hicache.backend")

# Keys SGLang itself reads from the same object (some it pops before we see
# them, some it leaves); never ours to warn about.
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
               "hicache_storage_pass_prefix_keys", "tp_lcm_size"}


# One line per key, for the README's reference (scripts/readme_reference.py).
SETTINGS_HELP = {
    "tiers_config": "node configuration file the daemons run with; default: the embedded default",
    "runtime_dir": "directory of the daemons' sockets; default: the node configuration's",
    "write_policy": "write_through, write_back or selective; default: the node's write_policy",
    "namespace": "use this namespace instead of the derived one (deployments that share daemons on purpose)",
    "deadline_base_s": "seconds any call may take, plus its bytes at deadline_min_gbps",
    "deadline_min_gbps": "bandwidth (GB/s) below which a transfer is given up",
    "lookup_timeout_s": "seconds a prefix lookup may take",
    "reply_spin_us": "microseconds a lookup or leased read waits for its daemon's reply holding the GIL before it "
                     "waits without it (a busy engine takes the GIL at every release; 0: never hold it); not "
                     "spun for a daemon whose last two replies came later (a disk or remote tier), but for a "
                     "probe one call in 32",
    "promote": "copy pages served by a lower tier into the top tier (after the read returned)",
    "promote_max_mib": "MiB of page copies waiting to be promoted; promotions past it are dropped and counted",
    "promote_min_reads": "reads of a page from a lower tier before it is promoted into the top tier (2: on its "
                         "second, one-hit wonders never are; 1: on every read)",
    "selective_min_reads": "selective policy: reads before a page is written below",
    "recompute_us_per_token": "prefill microseconds of one token on this server (hicache-tiers bench --only ttft "
                              "measures it); above 0, a lookup reports only the leading pages whose read, at each "
                              "tier's measured speed, beats recomputing them (0: every held page is a hit)",
    "recompute_growth_us_per_ki_token": "how much a token's prefill grows per 1,024 tokens of context before it "
                                        "(attention), with recompute_us_per_token",
    "page_checksums": "hash each page written (xxh3_64, kept by every tier) and check every page read against it: a "
                      "wrong byte is a miss, never a page served; costs ~15-28% of DRAM-tier throughput on a 2-core "
                      "machine (docs/PERFORMANCE.md)",
    "page_key_file": "seal every page with AES-256-GCM in the engine's process under the 32-byte key in this file "
                     "(mode 0600, the engine's own; hicache-tiers keys page-key FILE writes one): no tier sees "
                     "plaintext, a tampered page is a miss; the host pool is then not shared with the daemons "
                     "(docs/RELIABILITY.md)",
    "sealed_staging_mib": "with page_key_file: MiB of shared memory pages are sealed into for the tiers to copy "
                          "(ciphertext only; a larger batch goes in parts)",
    "read_speed_stale_s": "seconds a tier's measured read speed is trusted by the break-even rule; after that "
                          "its pages count as hits until a read measures it again",
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
    reply_spin_us: float = DEFAULT_REPLY_SPIN_S * 1e6  # tiers/wire/held_wait.py; at most 5,000 (CPython's switch interval)
    promote: bool = True  # copy pages read from a lower tier into the top tier
    promote_max_mib: int = 256  # copies waiting for the top tier; past it a promotion is dropped (counted)
    promote_min_reads: int = 2  # tiers/policies/admission.py: promoted on the second read from below
    selective_min_reads: int = 2  # selective: reads before a page is written below
    recompute_us_per_token: float = 0.0  # the break-even rule (hicache_ext/break_even.py); 0: off
    recompute_growth_us_per_ki_token: float = 0.0
    read_speed_stale_s: float = 30.0
    page_checksums: bool = True  # end-to-end page checksums (hicache_ext/page_sums.py)
    page_key_file: Optional[str] = None  # AES-256-GCM sealing of every page (hicache_ext/sealing.py); None: off
    sealed_staging_mib: int = 128  # the ciphertext staging the tiers map (hicache_ext/sealed_transfers.py)

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "BackendSettings":
        """Our keys from SGLang's extra config.

        A key nobody knows is logged once and ignored: refusing it would take
        L3 away from the whole server for a key a newer SGLang (or a typo in
        an unrelated tool) put there.  A known key with a malformed value is
        refused, since silently running with another value would surprise.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        values = {}
        for key, value in extra.items():
            if key in SGLANG_KEYS:
                continue
            if key not in known:
                log.warning("hicache-tiers: ignoring unknown extra-config key %r%s", key, _nearest(key, known))
                continue
            values[key] = value
        settings = cls(**values)
        settings._check()
        return settings

    def _check(self) -> None:
        for name in ("tiers_config", "runtime_dir", "write_policy", "namespace", "page_key_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"extra-config {name} must be a non-empty string, got {value!r}")
        if self.write_policy is not None and self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"extra-config write_policy {self.write_policy!r} is not one of "
                             f"{', '.join(WRITE_POLICIES)}")
        for name in ("deadline_base_s", "deadline_min_gbps", "lookup_timeout_s", "read_speed_stale_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"extra-config {name} must be a positive number, got {value!r}")
        for name in ("promote", "page_checksums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"extra-config {name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.promote_max_mib, bool) or not isinstance(self.promote_max_mib, int) \
                or self.promote_max_mib < 0:
            raise ValueError(f"extra-config promote_max_mib must be an integer >= 0, got {self.promote_max_mib!r}")
        if isinstance(self.sealed_staging_mib, bool) or not isinstance(self.sealed_staging_mib, int) \
                or self.sealed_staging_mib < 1:
            raise ValueError(f"extra-config sealed_staging_mib must be an integer >= 1, got {self.sealed_staging_mib!r}")
        if isinstance(self.reply_spin_us, bool) or not isinstance(self.reply_spin_us, (int, float)) \
                or not 0 <= self.reply_spin_us <= 5000:
            raise ValueError(f"extra-config reply_spin_us must be a number from 0 to 5000, got {self.reply_spin_us!r}")
        for name in ("recompute_us_per_token", "recompute_growth_us_per_ki_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"extra-config {name} must be a number >= 0, got {value!r}")
        for name in ("selective_min_reads", "promote_min_reads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"extra-config {name} must be an integer >= 1, got {value!r}")


def _nearest(key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(set(known) | SGLANG_KEYS), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _clean(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def derive_namespace(storage_config, pool, shared: Optional[bool] = None, head_shards_of: int = 0) -> str:
    """Model, shard and page format: pages under one namespace are interchangeable.

    MHA ranks each hold their own shard (tp rank and size in the name); MLA
    pages are the same on every rank, so the name leaves the TP rank out.
    ``shared`` overrides that for pools sharded differently from the KV pool
    (a Mamba state is per TP rank even in an MLA model).  ``head_shards_of``
    (tp_lcm_size) names pages split by heads: the shard is in each key, so the
    namespace leaves the TP rank and size out and engines of any TP size
    dividing it share.
    """
    model = _clean(storage_config.model_name or "model")
    parts = [model]
    if shared is None:
        shared = storage_config.is_mla_model
    if shared:
        parts.append("mla")
        if getattr(storage_config, "dcp_size", 1) > 1:
            parts.append(f"dcp{storage_config.dcp_rank}-{storage_config.dcp_size}")
    elif head_shards_of:
        parts.append(f"heads-of-{head_shards_of}")
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
