"""Hit results for hybrid models (KV plus side pools), SGLang's batch_exists_v2 semantics.

Each side pool states how much of the KV prefix it must cover:
- ALL_PAGES: every page of the prefix (e.g. a DSA indexer);
- TRAILING_PAGES: only the last len(transfer.keys) pages before the cut
  (Mamba / SWA states are checkpoints, so 5 pages can be restorable while 4
  are not); the result lists every restorable prefix length;
- BLOCK_GROUPS: the pool reports the pages its leading complete groups cover
  as its own verdict and never gates the KV hit.
This follows SGLang's own file backend (HiCacheFile.batch_exists_v2), the
reference the controller was written against.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from tiers.wire import protocol as P


def pool_hit_result(kv_held: bytes, transfers: Sequence[PoolTransfer],
                    pool_held: Dict[str, bytes]) -> PoolTransferResult:
    """Fold the KV flags and each side pool's flags (over the same keys) into one result."""
    kv_pages = P.leading_run(kv_held)
    hit_count: Dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable: List[int] = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        held = pool_held.get(transfer.name, b"")
        has = lambda i: i < len(held) and held[i] != 0  # noqa: E731
        name = transfer.name
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not has(i)), kv_pages)
            pool_restorable = set(range(1, boundary + 1))
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(transfer.keys) if transfer.keys else 1)
            pool_restorable = {n for n in range(1, kv_pages + 1)
                               if all(has(i) for i in range(max(0, n - window), n))}
            boundary = max(pool_restorable, default=0)
        elif transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
            group = max(1, transfer.group_pages or 1)
            groups = 0
            while (groups + 1) * group <= kv_pages and all(has(i) for i in range(groups * group, (groups + 1) * group)):
                groups += 1
            if groups:
                hit_count[name] = groups * group
            continue  # a verdict of its own; the KV cut stands
        else:
            continue  # a policy this SGLang does not define: no verdict, no gate
        if boundary:
            hit_count[name] = boundary
        restorable = [n for n in restorable if n in pool_restorable]
    final = restorable[-1] if restorable else 0
    return PoolTransferResult(final, hit_count, restorable)


def empty_result() -> PoolTransferResult:
    return PoolTransferResult(0, {}, [])
