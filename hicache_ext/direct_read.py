"""A read's pages from the top tier's page directory, before any daemon is asked (tiers/wire/direct_reads.py).

The DRAM tier hands its engines a page directory with its arena; the pages a
batch finds there are copied and hashed by this process, checked against
their checksums, and counted by the daemon afterwards (the client's touch).
Whatever the directory does not give goes to the daemons as before.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

from hicache_ext.break_even import BreakEven
from hicache_ext.host_pool import PageBatch
from hicache_ext.page_sums import ReadChecks
from tiers.wire.client import TierClient


def read_through_directory(top: TierClient, checks: ReadChecks, break_even: Optional[BreakEven], batch: PageBatch,
                           idx: List[int], found: List[bool], sums: List[int]) -> Tuple[List[int], int]:
    """Pages idx of batch read through top's page directory; found and sums filled for those read and checked;
    (the pages still to ask for, how many were read)."""
    part = batch if len(idx) == len(batch.keys) else batch.subset(idx)
    began = time.perf_counter()
    flags, got, copied = top.read_direct(part.keys, part.page_runs(), checks.enabled)
    if not any(flags):
        return idx, 0
    flags = checks.verify(top.name, part.keys, flags, got, lambda at: [copied[i] for i in at])
    rest, read = [], []
    for i, ok, checksum in zip(idx, flags, got):
        if ok:
            found[i], sums[i] = True, checksum
            read.append(batch.keys[i])
        else:
            rest.append(i)
    if break_even is not None:  # the top tier's read speed, kept current for the break-even rule
        break_even.speeds.observe(0, int(len(read) * batch.nbytes / len(batch.keys)), time.perf_counter() - began)
    if read:
        top.touch(read, int(part.lengths[0].sum()))
    return rest, len(read)
