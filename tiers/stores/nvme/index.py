"""Rebuilding the index of a chunk directory after a restart.

The rebuild trusts file names and sizes and verifies lazily: every read checks
the header and payload checksums anyway, so reading 100,000 headers at start
would buy nothing but a start-up that grows with the data (and, on a cold disk
after a reboot, one random 4 KiB read per file).  One directory read per
directory plus one ``stat`` per file gives name (namespace hash and digest),
on-disk size and mtime (recency), walked in C (tiers/_chunkscan.c) into packed
records: nothing a chunk is a Python object.  Leftover temp files of an interrupted write
and files too short to hold a header are removed here; a file with a damaged
header or payload is found and removed on its first read.
"""
from __future__ import annotations

import os
import re
import time
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import numpy as np

from tiers.stores.nvme.chunkfile import HEADER_SIZE, unlink_quietly
from tiers.stores.nvme.layout import is_temp

try:
    from tiers._chunkscan import RECORD_BYTES, scan_top, trim
except ImportError as exc:  # pragma: no cover - a source tree used without pip install
    raise ImportError(f"tiers._chunkscan is not built ({exc}); install the package with pip "
                      "(scripts/install.sh), which compiles it") from None

_FANOUT_RE = re.compile(r"[0-9a-f]{2}")
SCAN_THREADS = 8
# The scan's threads run at a lower CPU priority (nice is a thread's own on Linux): eight of them walking a warm
# directory kept both cores of this machine busy and a restarting daemon took 0.35-0.5 s longer to bind and
# answer its first lookup; serving threads come first, the scan takes what they leave.
SCAN_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SCAN_NICE)
    except OSError:  # not permitted somewhere: a scan at the daemon's priority is only slower to leave room
        pass


# One chunk the scan found (tiers/_chunkscan.c): its digest's low and high 64 bits, namespace hash, on-disk
# bytes, mtime in seconds.
# file, block: where a page of a batch chunk lies (0, 0: a chunk of its own, named by its digest)
RECORD = np.dtype([("lo", "<u8"), ("hi", "<u8"), ("ns", "<u8"), ("size", "<u4"), ("mtime", "<u4"),
                   ("file", "<u4"), ("block", "<u4")])
assert RECORD.itemsize == RECORD_BYTES


def digests_of(records: np.ndarray) -> List[int]:
    """The 128-bit digests of records, as ints."""
    return [(hi << 64) | lo for lo, hi in zip(records["lo"].tolist(), records["hi"].tolist())]


@dataclass
class ScanResult:
    records: bytes = b""  # RECORD each
    leaves: List[int] = field(default_factory=list)  # numbers (low 16 digest bits) of the leaf directories found
    temps_removed: int = 0
    torn_removed: int = 0
    foreign_files: int = 0
    seconds: float = 0.0
    parts: int = 0  # how many parts the scan yields in all (top-level directories), for an early size estimate

    def merge(self, other: "ScanResult") -> None:
        self.records += other.records
        self.leaves += other.leaves
        self.temps_removed += other.temps_removed
        self.torn_removed += other.torn_removed
        self.foreign_files += other.foreign_files

    def array(self) -> np.ndarray:
        return np.frombuffer(self.records, dtype=RECORD)


def _subdirs(path: str) -> List[os.DirEntry]:
    with os.scandir(path) as it:
        return [e for e in it if _FANOUT_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _scan_top(top: os.DirEntry) -> ScanResult:
    # The walk of the top directory's leaves runs in C without the GIL (tiers/_chunkscan.c); what is left
    # here is per part, not per chunk.
    records, leaves, temps, torn, foreign = scan_top(top.path, int(top.name, 16), HEADER_SIZE)
    out = ScanResult(records, np.frombuffer(leaves, dtype="<u2").tolist(), foreign_files=foreign)
    out.temps_removed = sum(unlink_quietly(path) for path in temps)
    out.torn_removed = sum(unlink_quietly(path) for path in torn)
    return out


def scan_parts(root: str, stop: Optional[threading.Event] = None) -> Iterator[ScanResult]:
    """Scan root one top-level fan-out directory at a time (each part as soon as it is done); clean leftovers.

    The first part is the top level itself (leftover probe files)."""
    first = ScanResult()
    with os.scandir(root) as it:
        for entry in it:
            if is_temp(entry.name):
                first.temps_removed += unlink_quietly(entry.path)
    yield first
    # After a reboot every stat is a random inode read: several in flight took 100,000 cold files from
    # 27-30 s on one thread to 9.4 s on 8 and 7.5 s on 16; warm, threads cost nothing (2.5-5 s).
    with ThreadPoolExecutor(max_workers=SCAN_THREADS, thread_name_prefix="nvme-scan",
                            initializer=_lower_priority) as pool:
        futures = {pool.submit(_scan_top, top) for top in _subdirs(root)}
        total = len(futures)
        try:
            for future in as_completed(futures):
                if stop is not None and stop.is_set():
                    return
                part = future.result()
                futures.discard(future)  # a done future keeps its part alive: 32 bytes a chunk by the end
                del future
                part.parts = total
                yield part
        finally:
            for future in futures:
                future.cancel()
    trim()  # what the scan's threads freed goes back to the system, not into their arenas' keeping


def oldest_first(records: np.ndarray) -> np.ndarray:
    """Records oldest mtime first, ties broken by the digest's low 64 bits (a deterministic order)."""
    return records[np.lexsort((records["lo"], records["mtime"]))]


def scan(root: str) -> ScanResult:
    """Index every chunk file under root, oldest mtime first; clean leftovers."""
    started = time.perf_counter()
    result = ScanResult()
    for part in scan_parts(root):
        result.merge(part)
    result.records = oldest_first(result.array()).tobytes()
    result.seconds = time.perf_counter() - started
    return result
