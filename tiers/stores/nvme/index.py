"""Rebuilding the index of a chunk directory after a restart.

The rebuild trusts file names and sizes and verifies lazily: every read checks
the header and payload checksums anyway, so reading 100,000 headers at start
would buy nothing but a start-up that grows with the data (and, on a cold disk
after a reboot, one random 4 KiB read per file).  One ``os.scandir`` per
directory plus one ``stat`` per file gives name (namespace hash and digest),
on-disk size and mtime (recency).  Leftover temp files of an interrupted write
and files too short to hold a header are removed here; a file with a damaged
header or payload is found and removed on its first read.
"""
from __future__ import annotations

import os
import re
import stat
import time
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Set, Tuple

from tiers.stores.nvme.chunkfile import HEADER_SIZE, unlink_quietly
from tiers.stores.nvme.layout import is_temp, parse_name

_FANOUT_RE = re.compile(r"[0-9a-f]{2}")
SCAN_THREADS = 8


@dataclass
class ScanResult:
    # (mtime_ns, digest, ns_hash, size, path) of every chunk, oldest first
    chunks: List[Tuple[int, int, int, int, str]] = field(default_factory=list)
    dirs: Set[str] = field(default_factory=set)  # leaf directories that exist
    temps_removed: int = 0
    torn_removed: int = 0
    foreign_files: int = 0
    seconds: float = 0.0

    def merge(self, other: "ScanResult") -> None:
        self.chunks.extend(other.chunks)
        self.dirs |= other.dirs
        self.temps_removed += other.temps_removed
        self.torn_removed += other.torn_removed
        self.foreign_files += other.foreign_files


def _subdirs(path: str) -> List[os.DirEntry]:
    with os.scandir(path) as it:
        return [e for e in it if _FANOUT_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _scan_top(top: os.DirEntry) -> ScanResult:
    # The per-file loop is the whole cost of a restart: kept to plain tuples and int compares.
    out = ScanResult()
    found = []
    for leaf in _subdirs(top.path):
        out.dirs.add(leaf.path)
        home = (int(leaf.name, 16) << 8) | int(top.name, 16)  # the low 16 digest bits that select this leaf
        with os.scandir(leaf.path) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            if is_temp(name):
                out.temps_removed += unlink_quietly(entry.path)
                continue
            parsed = parse_name(name)
            if parsed is None:
                out.foreign_files += 1  # not ours: left alone
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                out.foreign_files += 1
                continue
            ns_hash, digest = parsed
            # Too short for a header, or moved out of its fan-out directory (it
            # would never be found at its computed path): never servable.
            if st.st_size < HEADER_SIZE or digest & 0xFFFF != home:
                out.torn_removed += unlink_quietly(entry.path)
                continue
            found.append((st.st_mtime_ns, digest, ns_hash, st.st_size, entry.path))
    out.chunks = found
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
    # After a reboot every stat is a random inode read: several in flight (stat
    # and scandir release the GIL) took 100,000 cold files from 27-30 s on one
    # thread to 9.4 s on 8 and 7.5 s on 16; warm, threads cost nothing (2.5-5 s).
    with ThreadPoolExecutor(max_workers=SCAN_THREADS, thread_name_prefix="nvme-scan") as pool:
        futures = [pool.submit(_scan_top, top) for top in _subdirs(root)]
        try:
            for future in as_completed(futures):
                if stop is not None and stop.is_set():
                    return
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def scan(root: str) -> ScanResult:
    """Index every chunk file under root, oldest mtime first; clean leftovers."""
    started = time.perf_counter()
    result = ScanResult()
    for part in scan_parts(root):
        result.merge(part)
    # Oldest first; ties (same mtime) broken by digest so the rebuilt order is deterministic.
    result.chunks.sort()
    result.seconds = time.perf_counter() - started
    return result
