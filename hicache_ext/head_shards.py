"""Pages stored per KV-head shard, so engines of different TP sizes share one copy.

SGLang's ``tp_lcm_size`` (extra config) names the least common multiple of
the TP sizes that should share an L3 copy.  With the ``page_head`` host
layout a page's K (and V) region is [heads, page_size, layers, head_dim], so
the heads of lcm-rank ``s`` are one contiguous run in every engine that holds
them, whatever its own TP size: ``pool.get_split_heads_page_buffer_meta(
indices, lcm // tp_size)`` gives them as (K, V) pairs.  Each shard is stored
under the page's key plus ``.h<s>``, in a namespace without the TP rank, so
a TP=4 rank 1 and a TP=2 rank 0 both find lcm-shard 2's bytes under the same
key.  A page counts as held, read or written only when all of this rank's
shards are (MIN over shards, as SGLang takes the MIN over ranks).

This is the scheme of SGLang's Mooncake backend (``_get_mha_split_heads_
buffer_meta``: keys suffixed with the lcm rank), keyed our way.  MLA pages are
the same on every rank and never split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class HeadShards:
    """This rank's shards of every page: lcm ranks first .. first + count - 1."""

    lcm: int
    first: int
    count: int

    @classmethod
    def for_rank(cls, tp_rank: int, tp_size: int, tp_lcm_size: int, head_num: int) -> "HeadShards":
        if tp_lcm_size % tp_size:
            raise ValueError(f"tp_lcm_size {tp_lcm_size} is not a multiple of the TP size {tp_size}")
        count = tp_lcm_size // tp_size
        if head_num % count:
            raise ValueError(f"{head_num} KV heads per rank do not split into {count} shards "
                             f"(tp_lcm_size {tp_lcm_size}, TP size {tp_size})")
        return cls(lcm=tp_lcm_size, first=tp_rank * count, count=count)

    def keys(self, keys: Sequence[str]) -> List[str]:
        """Each page's shard keys, page by page (the order of the split buffer meta)."""
        return [f"{key}.h{s}" for key in keys for s in range(self.first, self.first + self.count)]

    def parents(self, parents: Sequence[Optional[str]]) -> List[Optional[str]]:
        """A shard's parent is the same shard of the page's parent."""
        return [None if parent is None else f"{parent}.h{s}"
                for parent in parents for s in range(self.first, self.first + self.count)]

    def fold(self, flags: Sequence) -> List[bool]:
        """Per page: true when every shard is."""
        n = self.count
        return [all(flags[i:i + n]) for i in range(0, len(flags), n)]

    def fold_held(self, held: bytes) -> bytes:
        return bytes(int(ok) for ok in self.fold(held))
