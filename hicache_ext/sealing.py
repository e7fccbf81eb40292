"""Pages sealed with AES-256-GCM in the engine's process: no tier, and no node a tier reaches, sees plaintext.

A sealed page is ``nonce (12 bytes) || ciphertext || tag (16 bytes)``; the
associated data is the page's namespace and key, so a page put under another
key or namespace (a tier mixing them up, or a tenant with write access to a
shared namespace replaying one) fails to open, and a changed byte anywhere
fails too: either is a miss, never a page served.  Nonces are random (96 bits):
rotate the key well before 2^32 pages have been sealed with it (NIST SP
800-38D), e.g. at each deployment.  The namespace carries a fingerprint of the
key, so engines with different keys (or none) never read each other's pages.

What stays visible to the tiers: page keys (hashes of token prefixes), sizes,
and access patterns.  The host pool is not shared with the daemons while pages
are sealed (they would read plaintext there): pages are sealed into a staging
memfd that holds only ciphertext, which the daemons map instead, and leased
reads are copied out of a daemon's arena into private scratch before they are
opened into the host pool (hicache_ext/sealed_transfers.py; bench: ``sealed``).
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
import threading
from typing import List, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG  # bytes a sealed page has beyond its plaintext
KEY_BYTES = 32
GATHER_BYTES = 256 << 10  # a page in runs up to this size is gathered into one buffer, not streamed run by run


class KeyFileError(ValueError):
    """A page key file that is missing, readable by others, or not 32 bytes."""


def read_key_file(path: str) -> bytes:
    """The 32-byte key in path (raw, or 64 hex digits); the file must be its owner's alone (mode 0600 or
    stricter, owned by this process's user): a key others can read protects nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise KeyFileError(f"page key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"page key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(f"page key file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                               f"chmod 600 it")
        if st.st_uid != os.geteuid():
            raise KeyFileError(f"page key file {path} belongs to uid {st.st_uid}, not to this process's {os.geteuid()}")
        raw = os.read(fd, 256)
    finally:
        os.close(fd)
    if len(raw) == KEY_BYTES:
        return raw
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"page key file {path} holds neither 32 bytes nor 64 hex digits "
                           f"(hicache-tiers keys page-key {path} writes one)")
    return key


def key_fingerprint(key: bytes) -> str:
    """8 hex digits naming the key in namespaces (a hash of it: says nothing about the key itself)."""
    return hashlib.sha256(b"hicache-tiers page key\0" + key).hexdigest()[:8]


class PageSealer:
    """Seals and opens the pages of one namespace (thread-safe: the engine's threads share it)."""

    def __init__(self, key: bytes, namespace: str):
        if len(key) != KEY_BYTES:
            raise KeyFileError("a page key is 32 bytes")
        self._key = key
        self._aead = AESGCM(key)
        self._prefix = namespace.encode() + b"\0"
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's gather buffer
        self.refused = 0  # pages that failed to open: tampered, or sealed under another key or name

    def _aad(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def seal(self, key: str, views: Sequence[memoryview]) -> bytearray:
        """The sealed page of the plaintext that views concatenate to."""
        out = bytearray(sum(v.nbytes for v in views) + OVERHEAD)
        self.seal_into(key, views, memoryview(out))
        return out

    def seal_into(self, key: str, views: Sequence[memoryview], out: memoryview) -> None:
        """Seal the plaintext that views concatenate to into out (exactly its size + OVERHEAD bytes)."""
        size = sum(v.nbytes for v in views)
        if out.nbytes != size + OVERHEAD:
            raise ValueError(f"a sealed page of {size} bytes takes {size + OVERHEAD}, not {out.nbytes}")
        nonce = secrets.token_bytes(NONCE)
        out[:NONCE] = nonce
        body = out[NONCE:]
        if len(views) == 1:
            self._aead.encrypt_into(nonce, views[0].cast("B"), self._aad(key), body)
            return
        if size <= GATHER_BYTES:  # a small page in runs: one copy beats a streaming context's set-up
            self._aead.encrypt_into(nonce, self._gathered(views, size), self._aad(key), body)
            return
        # A large page in several runs (K and V, or layer-first layouts): streamed run by run, no join copy.
        sealer = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
        sealer.authenticate_additional_data(self._aad(key))
        at = 0
        for view in views:
            at += sealer.update_into(view.cast("B"), body[at:at + view.nbytes + 15])
        sealer.finalize()
        body[at:at + TAG] = sealer.tag

    def open_into(self, key: str, sealed: memoryview, targets: Sequence[memoryview]) -> bool:
        """Open a sealed page into targets (the runs its plaintext goes to); False, and the page is a miss,
        when it is not the page sealed under this key and namespace. Plaintext may have been written into
        targets before the tag was checked: the caller reports such a page as a miss, never as served."""
        size = sum(t.nbytes for t in targets)
        if sealed.nbytes != NONCE + size + TAG:
            return self._refuse()
        nonce, body = sealed[:NONCE], sealed[NONCE:]
        try:
            if len(targets) == 1:
                self._aead.decrypt_into(bytes(nonce), body, self._aad(key), targets[0].cast("B"))
                return True
            # A page in runs: opened whole into this thread's buffer, then copied run by run (a streaming
            # context cannot write a run in place: it wants a block of room past each).
            plain = self._scratch(size)
            self._aead.decrypt_into(bytes(nonce), body, self._aad(key), plain)
            at = 0
            for target in targets:
                target.cast("B")[:] = plain[at:at + target.nbytes]
                at += target.nbytes
            return True
        except InvalidTag:
            return self._refuse()

    def _scratch(self, size: int) -> memoryview:
        """This thread's buffer of at least size bytes (pages of one route have one size)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = bytearray(size)
        return memoryview(buf)[:size]

    def _gathered(self, views: Sequence[memoryview], size: int) -> memoryview:
        plain, at = self._scratch(size), 0
        for view in views:
            plain[at:at + view.nbytes] = view.cast("B")
            at += view.nbytes
        return plain

    def _refuse(self) -> bool:
        with self._lock:
            self.refused += 1
        return False

    def seal_all(self, keys: List[str], pages: Sequence[Sequence[memoryview]]) -> List[List[bytearray]]:
        return [[self.seal(k, views)] for k, views in zip(keys, pages)]
