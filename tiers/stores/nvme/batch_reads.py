"""The NVMe tier's batched reads: adjacent records of one batch chunk file read with one preadv a run.

A prefix is mostly read back in the order it was written, so the pages of a
get mostly lie one after another in one batch file (tiers/stores/nvme/batch.py).
Such runs are read with one open and one preadv straight into the caller's
buffers, each record verified as a page read alone would be; a batch is cut
into about two runs a read thread so that several are in flight.  Pages
in files of their own, and any record of a run that does not verify, go
through the store's one-page read, which says why and cleans up.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from tiers.shm.buffers import as_bytes_view
from tiers.stores.base import Buffers, OnFinal, PageKey, total_size
from tiers.stores.nvme import batch, chunkfile as cf
from tiers.stores.nvme.layout import key_digest
from tiers.stores.nvme.ledger import Ledger

# Adjacent records are read with one preadv a run.  A batch is cut into about two runs a read thread (the
# device sees several requests at once, and a thread's next run is ready when its last ends), each of
# MIN_RUN_BYTES to MAX_RUN_BYTES.  Measured here, 128-page cold leased reads, daemons paired round by round
# (python /tmp exp, 15 rounds): fixed 1 MiB runs (a page of 1 MiB and up read alone, header first) 1.07 /
# 1.29 / 1.63 GB/s at 1 / 1 / 4 MiB pages, runs of 8 MiB 2.26 GB/s at 1 MiB; at 64 KiB pages 1 MiB runs
# (8 of them) beat 4-8 MiB runs (2 or 1: fewer than the threads) 1.10 to 0.92-0.98.
MIN_RUN_BYTES = 1 << 20
MAX_RUN_BYTES = 8 << 20
TOUCH_INTERVAL = 1.0  # seconds between mtime refreshes of one chunk (recency kept across restarts)


@dataclass
class BatchReadSource:
    """What batched reads need of the store they read for."""

    ledger: Ledger
    readers: Executor  # threads that read runs and pages, several in flight
    threads: int  # how many
    direct: Callable[[], bool]  # O_DIRECT now (a device that refused it turns it off)
    read_one: Callable[[PageKey, Buffers], Optional[int]]  # the store's one-page read: its checksum or None


class BatchReads:
    def __init__(self, source: BatchReadSource):
        self.s = source

    def get_many(self, keys: Sequence[PageKey], pages: Sequence[Buffers], deadline: Optional[float],
                 on_final: Optional[OnFinal] = None) -> List[Optional[int]]:
        """Each page's checksum (0: unknown), None for a miss; nothing moves into the buffers once this
        returns (every read started is waited for).  on_final, when given, hears of each page once, as
        soon as the page or run that holds it is read (or skipped past the deadline)."""
        out: List[Optional[int]] = [None] * len(keys)
        dsts = [[v for v in (as_bytes_view(b) for b in page) if v.nbytes] for page in pages]
        work = self._plan(keys, dsts)

        def do(job) -> None:
            positions = [job[1]] if job[0] == "page" else [i for _b, i, _e in job[2]]
            try:
                if deadline is not None and time.time() > deadline:
                    return
                if job[0] == "page":
                    out[job[1]] = self.s.read_one(keys[job[1]], dsts[job[1]])
                    return
                _kind, path, run = job
                self._read_run(path, run, keys, dsts, out)  # a page alone too: header and payload in one preadv
            finally:
                if on_final is not None:
                    on_final(positions, [out[i] for i in positions])

        if len(work) > 1:
            list(self.s.readers.map(do, work))
        elif work:
            do(work[0])
        return out

    def _plan(self, keys: Sequence[PageKey], dsts: List[List[memoryview]]) -> list:
        """("page", position) for pages read alone, ("run", path, [(block, position, entry)]) for runs."""
        alone: List[int] = []
        runs: dict = {}  # path -> [(block, position, entry)]
        sizes = [total_size(dst) for dst in dsts]  # each page's once: the plan asks up to four times
        total = 0
        for i, key in enumerate(keys):
            entry = self.s.ledger.get(key_digest(*key))
            if entry is not None and entry.file and entry.disk_size == batch.record_blocks(sizes[i]) * cf.ALIGN:
                runs.setdefault(entry.path, []).append((entry.block, i, entry))
                total += sizes[i]
            else:
                alone.append(i)
        work: list = [("page", i) for i in alone]
        run_limit = min(MAX_RUN_BYTES, max(MIN_RUN_BYTES, total // (2 * self.s.threads)))
        for path, items in runs.items():
            items.sort()
            run, run_bytes = [items[0]], sizes[items[0][1]]
            for item in items[1:]:
                prev_block, prev_i, _e = run[-1]
                size = sizes[item[1]]
                if item[0] == prev_block + batch.record_blocks(sizes[prev_i]) and run_bytes + size <= run_limit:
                    run.append(item)
                    run_bytes += size
                else:
                    work.append(("run", path, run))
                    run, run_bytes = [item], size
            work.append(("run", path, run))
        return work

    def _read_run(self, path: str, run: list, keys, dsts, out: list) -> None:
        try:
            headers = batch.read_run(path, run[0][0], [(*keys[i], dsts[i], total_size(dsts[i]))
                                                      for _b, i, _e in run], self.s.direct())
        except OSError:
            headers = [None] * len(run)
        now = time.monotonic()
        refresh = False
        for (_block, i, entry), hdr in zip(run, headers):
            if hdr is None:  # compressed, corrupt, gone: the one-page path says which and cleans up
                out[i] = self.s.read_one(keys[i], dsts[i])
                continue
            refresh |= self.s.ledger.hit(key_digest(*keys[i]), entry, keys[i][0], hdr.raw_len, now, TOUCH_INTERVAL)
            out[i] = hdr.page_sum
        if refresh:  # the file's mtime is the recency of all its pages at a restart: once a run
            try:
                os.utime(path)
            except OSError:
                pass
