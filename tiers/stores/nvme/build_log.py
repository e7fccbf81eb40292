"""What the serving NVMe store did while its index was being rebuilt behind it (tiers/stores/nvme/rebuild.py).

A page written since is not replaced by its older file, nor is one deleted,
evicted or cleared since brought back (tiers/stores/nvme/ledger_rebuild.py
asks ``stale``); a Python policy's eviction order, built outside the ledger's
lock, is brought up to date from the journal.  The ledger records into it
under its lock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple


@dataclass
class BuildLog:
    """What changed while the index was being rebuilt in the background."""

    fresh: List[int] = field(default_factory=list)  # digests committed meanwhile, in order (Python policies)
    gone: Set[int] = field(default_factory=set)  # digests deleted, evicted or dropped meanwhile
    cleared: Set[Optional[int]] = field(default_factory=set)  # namespace hashes cleared (None: all)
    # Once a Python policy's eviction order is being built outside the lock: what the serving store did
    # since, in order, replayed onto it under the lock at the end ("fresh" | "gone" | "touch", digest, ns hash).
    journal: Optional[List[Tuple[str, int, int]]] = None
    # Whole seconds when the rebuild began: a file with an mtime before it was left by the last run; one from
    # this second on may be a write of this one (renamed into place, not yet indexed, when the scan met it).
    started_s: int = field(default_factory=lambda: int(time.time()))

    def committed(self, digest: int, ns_hash: int) -> None:
        self.fresh.append(digest)
        self.journaled("fresh", digest, ns_hash)

    def removed(self, digest: int, ns_hash: int) -> None:
        self.gone.add(digest)
        self.journaled("gone", digest, ns_hash)

    def journaled(self, op: str, digest: int, ns_hash: int) -> None:
        if self.journal is not None:
            self.journal.append((op, digest, ns_hash))

    def stale(self, digest: int, ns_hash: int) -> bool:
        """A scanned chunk's page was deleted, evicted or cleared meanwhile (the caller checks it was not
        written again since)."""
        return digest in self.gone or ns_hash in self.cleared or None in self.cleared

    def start_journal(self) -> List[int]:
        """Journal from now on; the digests committed so far, in order."""
        self.journal = []
        return list(self.fresh)
