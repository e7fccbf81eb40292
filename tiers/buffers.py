"""Copying pages between lists of byte buffers (the scatter/gather of every tier)."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import List, Sequence, Tuple

import numpy as np

# Runs at least this long are copied by numpy, which releases the GIL while it copies (a
# memoryview assignment holds it: a lookup arriving during an 8 MiB copy would wait ~3 ms);
# below it the fixed cost of two array views outweighs that.
NUMPY_COPY_MIN = 256 << 10

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise.restype = ctypes.c_int
except OSError:  # no libc by that name: populate by touching pages
    _libc = None


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
        if n >= NUMPY_COPY_MIN:
            np.copyto(np.frombuffer(d, np.uint8, n, doff), np.frombuffer(s, np.uint8, n, soff))
        else:
            d[doff:doff + n] = s[soff:soff + n]
        copied += n
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0
    return copied


def block_extents(blocks: Sequence[int], block_size: int, size: int) -> List[Tuple[int, int]]:
    """(offset, length) runs of an arena that size bytes take in these blocks, in order.

    Adjacent blocks merge into one run, so a page in consecutive blocks is one memcpy.
    """
    extents: List[Tuple[int, int]] = []
    remaining = size
    for block in blocks:
        length = min(block_size, remaining)
        offset = block * block_size
        if extents and extents[-1][0] + extents[-1][1] == offset:
            extents[-1] = (extents[-1][0], extents[-1][1] + length)
        else:
            extents.append((offset, length))
        remaining -= length
    return extents


def split_extents(views: Sequence[memoryview]) -> List[memoryview]:
    """Drop empty views (they would stall the copy loop)."""
    return [v for v in views if v.nbytes]


def populate(mapping: mmap.mmap) -> bool:
    """Fault a whole shared mapping in for writing, without holding the GIL.

    mmap.madvise keeps the GIL for the whole call (seconds for a large pool),
    which would freeze a daemon's loop; a ctypes call releases it.  Returns
    False when the kernel cannot (pages then fault in on first use).
    """
    if _libc is None or len(mapping) == 0:
        return False
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # release the buffer export at once; the address stays valid while mapped
    return _libc.madvise(address, len(mapping), MADV_POPULATE_WRITE) == 0
