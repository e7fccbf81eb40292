"""A chunk of the NVMe tier's index as its callers see it, and what the ledger asks of the kept dead files
(tiers/stores/nvme/ledger.py, recycle.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple


@dataclass
class Entry:
    """A chunk as its row read when asked: gen names that version (a newer write of the page is another)."""

    path: str
    ns_hash: int
    disk_size: int
    raw_size: Optional[int] = None  # None: the row keeps no page size (the chunk's header has it)
    reads: int = 0
    gen: int = 0
    stamp: int = 0  # monotonic seconds of the last mtime refresh (0: never; a scan's mtime until placed)
    file: int = 0  # the batch chunk holding the page (tiers/stores/nvme/batch.py); 0: a file of its own
    block: int = 0  # its record's first 4 KiB block there

    @property
    def record_block(self) -> Optional[int]:
        """Where the chunk's record starts in its batch chunk; None for a file of its own."""
        return self.block if self.file else None


Victim = Tuple[int, Entry]


class SpareFiles(Protocol):
    """Dead batch files kept on disk to be written over (tiers/stores/nvme/recycle.py), given up for room."""

    def give_up_locked(self) -> int:
        """Called holding the ledger's lock: one kept file given up (removed before the reserving writer
        writes), its bytes; 0 when none is kept."""
