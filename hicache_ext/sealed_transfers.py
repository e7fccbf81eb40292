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

# put(client, keys, parents, pages as (offset, length) in staging or None, sealed views, nbytes, sums) -> flags
Put = Callable[[TierClient, List[str], Optional[list], Optional[list], List[List[memoryview]], int, bytes],
               List[bool]]


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
        self._scratch = threading.local()  # each reader thread's own copy-out buffer

    def attach(self, clients: Sequence[TierClient]) -> None:
        """Offer the staging (ciphertext only) to every tier in place of the host pool."""
        for client in clients:
            client.attach_region(self._fd, self.size)

    # --------------------------------------------------------------- writes
    def write(self, keys: List[str], pages: Sequence[Sequence[memoryview]], parents: Optional[list],
              acknowledged: Callable[[Callable[[TierClient], List[bool]]], List[bool]], put: Put) -> List[bool]:
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
                out += acknowledged(lambda client: put(client, part, part_parents, extents, views, at, sums))
                first = last
        return out

    # ---------------------------------------------------------------- reads
    def _scratch_for(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return buf

    def read(self, client: TierClient, keys: List[str], targets: List[Sequence[memoryview]],
             got: List[int]) -> List[bool]:
        """Sealed pages of keys from one tier, each checked against its sum, then opened into its targets."""
        sizes = [sum(t.nbytes for t in page) + OVERHEAD for page in targets]
        if client.can_lease():
            scratch = self._scratch_for(sum(sizes))
            base, runs, sealed, at = address_of(scratch), [], [], 0
            for size in sizes:
                runs.append([(base + at, size)])
                sealed.append(memoryview(scratch[at:at + size]))
                at += size
            copied: Optional[List[int]] = [] if self.checks.enabled else None
            found = client.get_leased(keys, runs, got, copied)
            found = self.checks.verify(client.name, keys, found, got, lambda idx: [copied[i] for i in idx])
        else:
            found, frames = client.get_frames(keys, sum(sizes), got)
            hits = [i for i, ok in enumerate(found) if ok]
            sealed = [None] * len(keys)
            for i, frame in zip(hits, frames):
                sealed[i] = frame.buffer
            found = self.checks.verify(client.name, keys, found, got,
                                       lambda idx: page_sums([[sealed[i]] for i in idx]))
        return [ok and self.sealer.open_into(key, sealed[i], targets[i])
                for i, (key, ok) in enumerate(zip(keys, found))]

    def close(self) -> None:
        self._staging.release()
        self._map.close()
        os.close(self._fd)


def put_sealed(client: TierClient, keys: List[str], parents: Optional[list], extents: Optional[list],
               views: List[List[memoryview]], nbytes: int, extra: dict) -> List[bool]:
    """One tier's put of sealed pages: from the staging it mapped, else as frames."""
    if extents is not None and client.region_id is not None:
        desc, counts = P.encode_descriptors(extents)
        return client.put_region(keys, desc, counts, nbytes, parents, **extra)
    return client.put_frames(keys, views, nbytes, parents, **extra)
