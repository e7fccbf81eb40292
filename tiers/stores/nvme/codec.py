"""Per-chunk compression: none, zstd, and zstd over byte planes of bf16 data.

``zstd-shuffle`` splits each 16-bit element into a plane of low bytes and a
plane of high bytes before zstd (sign/exponent bytes of bf16 KV data repeat
far more than mantissa bytes).  The shuffle is defined on the whole page, not
per buffer, because a reader's buffer split may differ from the writer's.
zstd contexts are not thread-safe, so each thread keeps its own.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np
import zstandard

from tiers.shm.buffers import scatter_copy

CODEC_IDS = {"none": 0, "zstd": 1, "zstd-shuffle": 2}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
ELEMENT_BYTES = 2  # bf16 / fp16 KV caches


class CodecError(ValueError):
    """A payload that does not decode to the expected page."""


def _gather(views: Sequence[memoryview], size: int) -> np.ndarray:
    page = np.empty(size, dtype=np.uint8)
    scatter_copy([memoryview(page)], views)
    return page


def shuffle(page: np.ndarray) -> np.ndarray:
    """Byte planes of 2-byte elements: all low bytes, then all high bytes (odd tail kept last)."""
    even = page.size - page.size % ELEMENT_BYTES
    out = np.empty_like(page)
    out[:even].reshape(ELEMENT_BYTES, -1)[...] = page[:even].reshape(-1, ELEMENT_BYTES).T
    out[even:] = page[even:]
    return out


def unshuffle(planes: np.ndarray) -> np.ndarray:
    """Inverse of shuffle."""
    even = planes.size - planes.size % ELEMENT_BYTES
    half = even // 2
    out = np.empty_like(planes)
    # Whole-element arithmetic: the strided transpose used by shuffle is ~40x slower in this direction.
    words = out[:even].view("<u2")
    np.left_shift(planes[half:even], 8, out=words, dtype=np.uint16)
    words |= planes[:half]
    out[even:] = planes[even:]
    return out


class Codec:
    """Encodes pages for one store (codec name and zstd level fixed at start)."""

    def __init__(self, name: str = "none", level: int = 1):
        if name not in CODEC_IDS:
            raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_IDS)}")
        self.name = name
        self.codec_id = CODEC_IDS[name]
        self.level = level
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=self.level)
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def encode(self, views: Sequence[memoryview], size: int) -> Optional[bytes]:
        """The compressed payload, or None when the page is stored as is."""
        if self.codec_id == 0:
            return None
        if self.codec_id == 2:
            data = self._cctx().compress(shuffle(_gather(views, size)))
        else:
            # compressobj takes the buffers one by one: no joined copy of the page.
            cobj = self._cctx().compressobj(size=size)
            data = b"".join([cobj.compress(v) for v in views] + [cobj.flush()])
        # Incompressible pages are kept raw: reads then take the zero-copy path.
        return data if len(data) < size else None

    def decode(self, codec_id: int, payload, dst: Sequence[memoryview], size: int) -> None:
        """Decompress payload into dst (CodecError when it is not a page of size bytes)."""
        try:
            raw = self._dctx().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: {exc}") from None
        if len(raw) != size:
            raise CodecError(f"decoded {len(raw)} bytes, expected {size}")
        if codec_id == CODEC_IDS["zstd-shuffle"]:
            raw = unshuffle(np.frombuffer(raw, dtype=np.uint8))
        elif codec_id != CODEC_IDS["zstd"]:
            raise CodecError(f"unknown codec id {codec_id}")
        scatter_copy(dst, [memoryview(raw)])
