"""Which pool holds a key: rendezvous (highest random weight) hashing.

Every pool scores every key and the highest score wins, so adding a pool
moves exactly the keys it now wins (about 1/N of them) and removing one moves
only its own; nothing needs a ring or virtual nodes.  ``weight`` scales a
pool's share (logarithmic method of Schindelhauer and Schomaker), so a pool
twice the size can take twice the keys.
"""
from __future__ import annotations

import math
from typing import AbstractSet, Dict, Iterable, List, Sequence

import xxhash

_SCALE = float(1 << 64)


class Rendezvous:
    """Maps keys onto a fixed list of pools."""

    def __init__(self, pools: Sequence[str], weights: Sequence[float] = ()):
        if not pools:
            raise ValueError("at least one pool is needed")
        if len(set(pools)) != len(pools):
            raise ValueError("pools must be distinct")
        weights = list(weights) or [1.0] * len(pools)
        if len(weights) != len(pools) or min(weights) <= 0:
            raise ValueError("one positive weight a pool")
        self.pools = list(pools)
        self._seeds = [xxhash.xxh64_intdigest(p.encode()) for p in self.pools]
        self._weights = weights
        self._uniform = len(set(weights)) == 1

    def score(self, pool_index: int, key: str) -> float:
        h = xxhash.xxh64_intdigest(key.encode(), seed=self._seeds[pool_index])
        u = (h + 0.5) / _SCALE  # in (0, 1)
        return -self._weights[pool_index] / math.log(u)

    def pick(self, key: str, skip: AbstractSet[str] = frozenset()) -> str:
        """The pool that holds key: the highest score among the pools not in skip (pools down).

        Skipping a pool moves only its own keys, each to its next-highest pool, so
        every node that sees the same pools down agrees on where they went; when
        every pool is skipped the first choice is returned (it will be refused).
        """
        if len(self.pools) == 1:
            return self.pools[0]
        data = key.encode()
        if self._uniform:  # the score is monotonic in the hash: compare hashes
            scores = [xxhash.xxh64_intdigest(data, seed=s) for s in self._seeds]
        else:
            scores = [self.score(i, key) for i in range(len(self.pools))]
        if skip and len(skip.intersection(self.pools)) < len(self.pools):
            return max((p for p in zip(scores, self.pools) if p[1] not in skip))[1]
        return self.pools[scores.index(max(scores))]

    def group(self, keys: Iterable[str]) -> Dict[str, List[int]]:
        """pool -> positions of the keys it holds (in key order)."""
        out: Dict[str, List[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self.pick(key), []).append(i)
        return out
