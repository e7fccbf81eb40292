"""Sealed pages through shared memory that holds only ciphertext (the route of a backend with page_key_file).

Writes: pages are sealed from the host pool straight into a staging memfd of
this process, which every tier daemon maps (read-only) instead of the host
pool; each tier then copies them as it copies a host pool's pages.  Batches
larger than the staging go in staging-sized parts; a page larger than all of
it goes as frames.  Reads: a daemon leases the sealed pages in its arena, we
copy them into private scratch (the guarded, deadline-checked copy every
leased read makes), check each against its checksum, and open it into the
host pool; tiers we cannot lease from send frames.  So sealing costs AES and
one memcpy on reads, not a ZeroMQ copy of every byte.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np

from hicache_ext.page_sums import ReadChecks
from hicache_ext.sealing import OVERHEAD, PageSealer
from tiers.shm.buffers import address_of
from tiers.shm.checksums import page_sums
from tiers.wire import protocol as P
from tiers.wire.client import TierClient
from tiers.wire.fanout import Call, FanOut

# put(client, keys, parents, pages as (offset, length) in staging or None, sealed views, nbytes, sums, on_stored):
# one tier's put, sent (tiers/wire/fanout.py); on_stored gets a flag a page
Put = Callable[[TierClient, List[str], Optional[list], Optional[list], List[List[memoryview]], int, bytes,
                Callable[[List[bool]], None]], Optional[Call]]
# acknowledged(start_put): the write policy's targets each sent start_put(client, on_stored), the flags agreed
Acknowledged = Callable[[Callable[[TierClient, Callable[[List[bool]], None]], Optional[Call]]], List[bool]]


class SealedTransfers:
    def __init__(self, sealer: PageSealer, checks: ReadChecks, staging_bytes: int):
        self.sealer = sealer
        self.checks = checks
        self.size = staging_bytes
        self._fd = os.memfd_create("hicache-sealed-staging", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, staging_bytes)
        self._map = mmap.mmap(self._fd, staging_bytes)
        self._staging = memoryview(self._map)
        self._lock = threading.Lock()  # one batch at a time in staging (SGLang backs up from one thread)
        self._scratch = threading.local()  # each reader thread's own copy-out buffer a tier (asked at once)

    def attach(self, clients: Sequence[TierClient]) -> None:
        """Offer the staging (ciphertext only) to every tier in place of the host pool."""
        for client in clients:
            client.attach_region(self._fd, self.size)

    # --------------------------------------------------------------- writes
    def write(self, keys: List[str], pages: Sequence[Sequence[memoryview]], parents: Optional[list],
              acknowledged: Acknowledged, put: Put) -> List[bool]:
        """Seal pages and store them as the write policy asks (acknowledged runs one put on each target)."""
        out: List[bool] = []
        with self._lock:
            first = 0
            while first < len(keys):
                extents, views, at, last = [], [], 0, first
                while last < len(keys):
                    size = sum(v.nbytes for v in pages[last]) + OVERHEAD
                    if at + size > self.size:
                        break
                    view = self._staging[at:at + size]
                    self.sealer.seal_into(keys[last], pages[last], view)
                    extents.append([(at, size)])
                    views.append([view])
                    at, last = at + size, last + 1
                if last == first:  # one page larger than the whole staging: sealed apart, sent as frames
                    views, extents, last = [[memoryview(self.sealer.seal(keys[first], pages[first]))]], None, first + 1
                    at = views[0][0].nbytes
                part, part_parents = keys[first:last], parents[first:last] if parents else None
                sums = self.checks.sums_of(views)
                out += acknowledged(lambda client, on_stored: put(client, part, part_parents, extents, views, at,
                                                                  sums, on_stored))
                first = last
        return out

    # ---------------------------------------------------------------- reads
    def _scratch_for(self, tier: str, nbytes: int) -> np.ndarray:
        bufs = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = self._scratch.bufs = {}
        buf = bufs.get(tier)
        if buf is None or buf.nbytes < nbytes:
            buf = bufs[tier] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return buf

    def read(self, client: TierClient, keys: List[str], targets: List[Sequence[memoryview]],
             got: List[int]) -> List[bool]:
        """Sealed pages of keys from one tier, each checked against its sum, then opened into its targets."""
        found: List[bool] = []
        fan = FanOut()
        fan.add(self.start_read(client, keys, targets, got, found.extend))
        fan.wait()
        return found

    def start_read(self, client: TierClient, keys: List[str], targets: List[Sequence[memoryview]],
                   got: List[int], on_found: Callable[[List[bool]], None]) -> Optional[Call]:
        """read, sent; on_found gets a flag a page once the reply is gathered, checked and opened."""
        sizes = [sum(t.nbytes for t in page) + OVERHEAD for page in targets]

        def opened(found: List[bool], sealed: list) -> None:
            on_found([ok and self.sealer.open_into(key, sealed[i], targets[i])
                      for i, (key, ok) in enumerate(zip(keys, found))])
        if client.can_lease():
            scratch = self._scratch_for(client.name, sum(sizes))
            base, runs, sealed, at = address_of(scratch), [], [], 0
            for size in sizes:
                runs.append([(base + at, size)])
                sealed.append(memoryview(scratch[at:at + size]))
                at += size
            copied: Optional[List[int]] = [] if self.checks.enabled else None
            return client.start_get_leased(
                keys, runs, got, copied,
                lambda found: opened(self.checks.verify(client.name, keys, found, got,
                                                        lambda idx: [copied[i] for i in idx]), sealed))

        def framed(found: List[bool], frames) -> None:
            sealed = [None] * len(keys)
            for i, frame in zip([i for i, ok in enumerate(found) if ok], frames):
                sealed[i] = frame.buffer
            opened(self.checks.verify(client.name, keys, found, got,
                                      lambda idx: page_sums([[sealed[i]] for i in idx])), sealed)
        return client.start_get_frames(keys, sum(sizes), got, framed)

    def close(self) -> None:
        self._staging.release()
        self._map.close()
        os.close(self._fd)


def put_sealed(client: TierClient, keys: List[str], parents: Optional[list], extents: Optional[list],
               views: List[List[memoryview]], nbytes: int, extra: dict,
               on_stored: Callable[[List[bool]], None]) -> Optional[Call]:
    """One tier's put of sealed pages, sent: from the staging it mapped, else as frames."""
    if extents is not None and client.region_id is not None:
        desc, counts = P.encode_descriptors(extents)
        return client.start_put_region(keys, desc, counts, nbytes, parents, on_stored, **extra)
    return client.start_put_frames(keys, views, nbytes, parents, on_stored, **extra)
