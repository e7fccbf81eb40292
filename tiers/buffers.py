"""Copying pages between lists of byte buffers (the scatter/gather of every tier)."""
from __future__ import annotations

from typing import List, Sequence


def as_bytes_view(buf) -> memoryview:
    """A flat, byte-addressed memoryview of any contiguous buffer."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def scatter_copy(dst: Sequence[memoryview], src: Sequence[memoryview]) -> int:
    """Copy the concatenation of src into the concatenation of dst.

    Both sides must hold the same number of bytes (ValueError otherwise).
    Each step is one memcpy of the largest run both current views allow.
    """
    total = sum(v.nbytes for v in src)
    if total != sum(v.nbytes for v in dst):
        raise ValueError("page size mismatch")
    di = si = doff = soff = 0
    copied = 0
    while copied < total:
        d, s = dst[di], src[si]
        n = min(d.nbytes - doff, s.nbytes - soff)
        d[doff:doff + n] = s[soff:soff + n]
        copied += n
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0
    return copied


def split_extents(views: Sequence[memoryview]) -> List[memoryview]:
    """Drop empty views (they would stall the copy loop)."""
    return [v for v in views if v.nbytes]
