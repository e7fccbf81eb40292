"""Routes the backend's page batches to the node's chain of tiers.

The chain is ordered fastest first (as the node configuration lists it).
- lookup: the hit is the longest run of leading keys each held by some tier.
- read: every page comes from the fastest tier holding it (ask the top tier
  for all, the next for what is still missing, ...); a page found below the
  top tier is written back up when ``promote`` is on.
- write: write_through stores into every tier and acknowledges a page only
  when all have it; write_back and selective acknowledge once the top tier
  has it (the daemons move pages down on eviction).
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence

from hicache_ext.host_pool import PageBatch
from tiers import protocol as P
from tiers.buffers import scatter_copy
from tiers.client import TierClient, lookup_all

log = logging.getLogger("hicache.backend")


class TierRouter:
    def __init__(self, clients: List[TierClient], write_policy: str = "write_through", promote: bool = True,
                 selective_min_reads: int = 2):
        if not clients:
            raise ValueError("the tier chain is empty")
        self.clients = clients
        self.write_policy = write_policy
        self.promote = promote
        self.selective_min_reads = selective_min_reads
        self.promotions = 0
        # What the top tier is told about each page: demote it later or not.
        self._mode = {"write_through": "through", "write_back": "back", "selective": "selective"}[write_policy]

    # ---------------------------------------------------------------- lookup
    def held(self, keys: List[str]) -> bytes:
        """One byte per key: held by some tier (every tier asked at once)."""
        if not keys:
            return b""
        if len(self.clients) == 1:
            return self.clients[0].lookup(keys) or bytes(len(keys))
        held = bytearray(len(keys))
        for flags in lookup_all(self.clients, keys):
            if flags is not None:
                for i, flag in enumerate(flags):
                    if flag:
                        held[i] = 1
        return bytes(held)

    def lookup(self, keys: List[str]) -> int:
        """Leading keys held by some tier (0 when no tier answers)."""
        return P.leading_run(self.held(keys))

    # --------------------------------------------------------------- writes
    def _write_targets(self) -> List[TierClient]:
        """write_through: every tier; otherwise the fastest tier that is up."""
        if self.write_policy == "write_through":
            return self.clients
        for client in self.clients:
            if not client.is_down():
                return [client]
        return self.clients[:1]

    def write(self, batch: PageBatch, parents: Optional[List[Optional[str]]] = None) -> List[bool]:
        result = [True] * len(batch.keys)
        for client in self._write_targets():
            stored = self._put(client, batch, parents, mode=self._mode)
            result = [a and b for a, b in zip(result, stored)]
        return result

    def _put(self, client: TierClient, batch: PageBatch, parents, mode: str = "through",
             promote: bool = False) -> List[bool]:
        extra = {"mode": mode}
        if mode == "selective":
            extra["min_reads"] = self.selective_min_reads
        if promote:
            extra["promote"] = True
        if batch.offsets is not None and client.region_id is not None:
            desc, counts = batch.descriptors()
            return client.put_region(batch.keys, desc, counts, batch.nbytes, parents, **extra)
        return client.put_frames(batch.keys, batch.views(), batch.nbytes, parents, **extra)

    def write_buffers(self, keys: List[str], pages: Sequence[Sequence[memoryview]]) -> List[bool]:
        """Legacy path: pages given as buffers of this process."""
        nbytes = sum(v.nbytes for page in pages for v in page)
        result = [True] * len(keys)
        for client in self._write_targets():
            stored = client.put_frames(keys, pages, nbytes, mode=self._mode)
            result = [a and b for a, b in zip(result, stored)]
        return result

    # ---------------------------------------------------------------- reads
    def read(self, batch: PageBatch) -> List[bool]:
        found = [False] * len(batch.keys)
        missing = list(range(len(batch.keys)))
        for depth, client in enumerate(self.clients):
            if not missing:
                break
            sub = batch if len(missing) == len(batch.keys) else batch.subset(missing)
            got = self._get(client, sub)
            hits = [i for i, ok in zip(missing, got) if ok]
            for i in hits:
                found[i] = True
            if depth > 0 and hits and self.promote and not self.clients[0].is_down():
                # A promoted page is already below, so the top tier holds it clean.
                promoted = self._put(self.clients[0], batch.subset(hits), None, promote=True)
                self.promotions += sum(promoted)
            missing = [i for i, ok in zip(missing, got) if not ok]
        return found

    def _get(self, client: TierClient, batch: PageBatch) -> List[bool]:
        if batch.offsets is not None and client.region_id is not None:
            desc, counts = batch.descriptors()
            return client.get_region(batch.keys, desc, counts, batch.nbytes)
        found, frames = client.get_frames(batch.keys, batch.nbytes)
        if not any(found):
            return found
        views = batch.views()
        frame_iter = iter(frames)
        for i, ok in enumerate(found):
            if ok:
                frame = next(frame_iter)
                try:
                    scatter_copy(views[i], [frame.buffer])
                except ValueError:  # a page of another size under this key
                    found[i] = False
        return found

    def read_buffers(self, keys: List[str], pages: Sequence[Sequence[memoryview]]) -> List[bool]:
        """Legacy path: fill buffers of this process from the fastest tier."""
        found = [False] * len(keys)
        missing = list(range(len(keys)))
        for client in self.clients:
            if not missing:
                break
            nbytes = sum(v.nbytes for i in missing for v in pages[i])
            got, frames = client.get_frames([keys[i] for i in missing], nbytes)
            frame_iter = iter(frames)
            still = []
            for i, ok in zip(missing, got):
                if ok:
                    try:
                        scatter_copy(pages[i], [next(frame_iter).buffer])
                        found[i] = True
                        continue
                    except ValueError:
                        pass
                still.append(i)
            missing = still
        return found

    def close(self) -> None:
        for client in self.clients:
            client.close()
