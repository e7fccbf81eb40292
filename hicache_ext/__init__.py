"""The engine side of hicache-tiers: the HiCache L3 backend SGLang loads.

Launch SGLang with ``--hicache-storage-backend dynamic`` and an extra-config of
``{"backend_name": "hicache_tiers", "module_path": "hicache_ext",
"class_name": "TieredHiCacheStorage", ...}`` (``hicache-tiers sglang-args``
prints it).

The backend (and with it torch and SGLang) is imported on first use of the
name: SGLang's loader does ``getattr(import_module("hicache_ext"),
"TieredHiCacheStorage")``, while the CLI's command registrations in
``hicache_ext.lab`` must stay cheap to import (every daemon builds the CLI).
"""

__all__ = ["TieredHiCacheStorage"]


def __getattr__(name: str):
    if name == "TieredHiCacheStorage":
        from hicache_ext.backend import TieredHiCacheStorage
        return TieredHiCacheStorage
    raise AttributeError(f"module 'hicache_ext' has no attribute {name!r}")
