"""Where a chunk lives: hashed file names under a two-level directory fan-out.

A chunk of ``(namespace, key)`` is ``DIR/ab/cd/<ns16>-<digest32>.kv``: the
128-bit xxh3 digest of the pair names the file and its low bytes pick one of
256 x 256 leaf directories, so a directory holds ~15 files at a million chunks.
The 64-bit namespace hash in the name lets ``clear(namespace)`` work on an
index rebuilt from names alone.  Key text never reaches a path (keys are
validated upstream, but a path built from a hash needs no trust).
"""
from __future__ import annotations

import itertools
import os
import re
from typing import List, Optional, Tuple

import xxhash

# The digest of (namespace, key) is the protocol's: a lookup may name keys by it (tiers/wire/protocol.py).
from tiers.wire.protocol import key_digest

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
_NAME_RE = re.compile(r"([0-9a-f]{16})-([0-9a-f]{32})\.kv")
_temp_counter = itertools.count()


def namespace_hash(namespace: str) -> int:
    """The 64-bit namespace tag carried in file names."""
    return xxhash.xxh3_64_intdigest(namespace.encode())


def leaf_dir(root: str, digest: int) -> str:
    """The fan-out directory of a digest."""
    return os.path.join(root, f"{digest & 0xFF:02x}", f"{(digest >> 8) & 0xFF:02x}")


class LeafDirs:
    """The leaf directories known to exist: one bit each of the 65,536 (8 KiB, where a set of their
    paths took ~7 MB, 7 bytes a chunk at a million chunks).  Takes the paths leaf_dir makes."""

    def __init__(self) -> None:
        self._bits = bytearray(1 << 13)

    @staticmethod
    def _number(leaf: str) -> int:
        # ".../ab/cd": ab the low digest byte, cd the next (leaf_dir)
        return int(leaf[-5:-3], 16) | (int(leaf[-2:], 16) << 8)

    def __contains__(self, leaf: str) -> bool:
        n = self._number(leaf)
        return bool(self._bits[n >> 3] & (1 << (n & 7)))

    def add(self, leaf: str) -> None:
        n = self._number(leaf)
        self._bits[n >> 3] |= 1 << (n & 7)

    def discard(self, leaf: str) -> None:
        n = self._number(leaf)
        self._bits[n >> 3] &= ~(1 << (n & 7)) & 0xFF

    def to_bytes(self) -> bytes:
        return bytes(self._bits)

    def load_bytes(self, bits: bytes) -> None:
        if len(bits) != len(self._bits):
            raise ValueError("a leaf directory table of the wrong size")
        self._bits[:] = bits

    def add_numbers(self, numbers) -> None:
        """Leaves by number (the low 16 bits of their digests), as a scan finds them."""
        for n in numbers:
            self._bits[n >> 3] |= 1 << (n & 7)


def file_name(ns_hash: int, digest: int) -> str:
    """The final file name of a chunk."""
    return f"{ns_hash:016x}-{digest:032x}{SUFFIX}"


def chunk_path(root: str, ns_hash: int, digest: int) -> str:
    """Full path of a chunk file."""
    return os.path.join(leaf_dir(root, digest), file_name(ns_hash, digest))


def temp_path(final_path: str) -> str:
    """A unique temp name next to final_path (same directory, so rename is atomic)."""
    head, tail = os.path.split(final_path)
    # A leading dot and the .tmp suffix keep temp files out of the name pattern.
    return os.path.join(head, f".{tail}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}")


def parse_name(name: str) -> Optional[Tuple[int, int]]:
    """(ns_hash, digest) of a chunk file name, or None for any other name."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1), 16), int(m.group(2), 16)


def is_temp(name: str) -> bool:
    """True for leftovers of an interrupted write."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)
