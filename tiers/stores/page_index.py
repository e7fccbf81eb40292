"""The page index of a tier: a fixed 48-byte row a page and a 4-byte slot, in C (tiers/_pageindex.c).

A tier of tens of millions of pages cannot keep a Python dict entry, an
entry object and a policy node a page.  ``PageIndex`` maps a page's 128-bit
digest to a row (the version ``gen``, a tenant number, the bytes it holds,
the page's own size, its reads, a time stamp in seconds) and keeps each
tenant's eviction order in the rows themselves for the built-in LRU and
FIFO; any other policy (a plug-in among them) orders the digests itself
through the EvictionPolicy interface and the index keeps no list
(``ORDER_NONE``).  Every call runs under the GIL, which is the index's lock.

Rows: ``(gen, tenant, size, raw, reads, stamp, file, block)``; file and block say where a page of a
batch chunk lies (tiers/stores/nvme/batch.py), 0 and 0 for a page in a file of its own.  To keep a row
at 48 bytes with its location, ``raw`` is not kept (always 0: the page's size is in its header, read with
it) and ``reads`` saturates at 255.  ``gen`` tells versions of
one digest apart: a caller that read a row can later remove or touch exactly
that version (a newer write of the same page is left alone).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

try:
    from tiers._pageindex import (MAX_TENANTS, ORDER_FIFO, ORDER_LRU, ORDER_NONE, ROW_BYTES, SAVED_ROW_BYTES,
                                  PageIndex)
except ImportError as exc:  # pragma: no cover - a source tree used without pip install
    raise ImportError(f"tiers._pageindex is not built ({exc}); install the package with pip "
                      "(scripts/install.sh), which compiles it") from None

# The policies whose order the index keeps in its rows; any other runs as a Python policy.
NATIVE_ORDERS = {"lru": ORDER_LRU, "fifo": ORDER_FIFO}


class Row(NamedTuple):
    """One page as the index holds it."""

    gen: int
    tenant: int
    size: int  # bytes the page takes in the tier (on disk: header and stored payload)
    raw: int  # 0: the page's own size is not kept in the row (its header has it)
    reads: int  # saturating at 255
    stamp: int  # seconds: a restart scan's mtime until placed, then the caller's last refresh (0: never)
    file: int = 0  # the batch chunk holding the page (0: a chunk file of its own)
    block: int = 0  # its record's first 4 KiB block in that file


def order_for(policy: str) -> int:
    """The native order of a policy name, ORDER_NONE when a Python policy orders the pages."""
    return NATIVE_ORDERS.get(policy, ORDER_NONE)


def row(values: Optional[tuple]) -> Optional[Row]:
    return None if values is None else Row(*values)


__all__ = ["MAX_TENANTS", "NATIVE_ORDERS", "ORDER_FIFO", "ORDER_LRU", "ORDER_NONE", "PageIndex", "ROW_BYTES",
           "Row", "SAVED_ROW_BYTES", "order_for", "row"]
