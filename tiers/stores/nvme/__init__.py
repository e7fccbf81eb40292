"""The NVMe tier: one checksummed file per chunk under a hashed directory fan-out.

Modules: layout (names and paths), chunkfile (on-disk format and blocking
I/O), codec (optional zstd), index (rebuild from the directory), store
(NvmeStore, the PageStore).  See docs/NVME.md.
"""
from tiers.stores.nvme.store import NvmeStore

__all__ = ["NvmeStore"]
