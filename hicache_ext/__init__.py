"""The engine side of hicache-tiers: the HiCache L3 backend SGLang loads.

Launch SGLang with ``--hicache-storage-backend dynamic`` and an extra-config of
``{"backend_name": "hicache_tiers", "module_path": "hicache_ext",
"class_name": "TieredHiCacheStorage", ...}`` (``hicache-tiers sglang-args``
prints it).
"""
from hicache_ext.backend import TieredHiCacheStorage

__all__ = ["TieredHiCacheStorage"]
