"""The wire protocol between the backend, the tier daemons and the pools.

This module and its typed schema (tiers/wire/messages.py: which fields each
message has, of which type, decoded straight into a msgspec Struct) are the
only places the format is defined.  Every message is a ZeroMQ multipart
message ``[header, *payload]``: the header is a msgpack map, payload frames
are raw page bytes (only when pages do not travel through a shared host-pool
mapping).

Request header: ``v`` protocol version, ``op`` operation, ``id`` request id
(echoed in the reply), ``dl`` absolute deadline in Unix seconds (work not
started by then is refused, so a late request can never write into host
memory the engine has reused), ``s`` session id (from ``hello``), then the
operation's fields.  Reply header: ``v``, ``id``, ``ok``; on failure ``code``
(one of ``ERROR_CODES``) and ``msg``.

Operations (fields -> reply fields):
- hello    ns, client           -> session, tier, max_page_bytes, max_batch, fd_socket, digests
- lookup   keys | digests [, done]
                                -> held (one byte a key), prefix (leading run held)
- get      keys [, lease, sizes, done]
                                -> found (one byte a key), sums, and either one frame per found page or,
                                   with ``lease``: lease, arena, desc, regions_per_page
- release  lease                -> released
- put      keys [, region, desc, regions_per_page | frames_per_page, parents, sums | hash_pages, done]
                                [+ page frames]
                                -> stored (one byte a key)
- delete   keys                 -> deleted
- stats                         -> stats, tier, sessions
- clear    [all | ns]           -> cleared
- evict    bytes [, ns]         -> evicted_pages, evicted_bytes
``all`` and an ``ns`` other than the session's own need an ``_admin`` session
(the operator's CLI); a tenant can never clear or evict another's pages.

A lookup may name its keys by ``digests`` instead: one bytes field of 16 bytes a key, each the
key's digest (``key_digest``: xxh3_128 of namespace, NUL, key; low then high 64 bits,
little-endian), which every index of a tier is keyed by.  A 1,024-key lookup is then one field to
pack and one to unpack, and the tier answers it in one native call, with no Python object a key.
A daemon whose store answers digests says so in ``hello`` (``digests``: true); the others take keys.

Reads never write into the engine's memory from the daemon (the owner of a
piece of memory does the last copy into it).  A ``get`` with ``lease`` (the
engine's give-up time on CLOCK_MONOTONIC, a float) and ``sizes`` (the
expected bytes of each page, int64 array) pins the found pages in the
daemon's arena, which the engine mapped read-only when it attached, until
``release`` or that time: the reply's ``desc``/``regions_per_page`` are
(offset, length) extents into the arena of each found page, ``arena`` the id
of the arena they refer to.  The engine copies a page only before the lease
ends and keeps it only if the copy ended by then (tiers/shm/arena.py).  ``done``
(at most ``MAX_DONE_LEASES`` lease ids, on a get, put or lookup) releases the
leases of earlier reads the engine has copied out, in the same round trip.

Pool operations (served by remote memory pools, tiers/stores/remote; pages then move
one-sided through the Mooncake Transfer Engine, never through ZeroMQ):
- alloc    keys, sizes [, parents, ttl, sums]
                                -> lease, seg, granted (one byte a key), desc, regions_per_page
- commit   lease, keys          -> committed (one byte a key)
- locate   keys [, ttl, done]   -> lease, seg, found (one byte a key), sizes, sums, desc, regions_per_page
- release  lease                -> released
``sizes`` is a little-endian int64 array (one a key; in a reply, one a found key); ``desc`` and
``regions_per_page`` are encoded as below but hold absolute addresses in the
pool's registered arena and cover only granted (found) pages; ``seg`` is the
pool's Transfer Engine segment name.  An ``alloc`` reserves space invisible to
lookups until ``commit`` (keys of the lease not committed are freed); a
``locate`` pins the found pages against eviction and reuse until ``release``.
Leases end by themselves ``ttl`` seconds later (bounded by the pool), so a
crashed client pins nothing for long.  ``done`` (a list of at most
``MAX_DONE_LEASES`` lease ids) releases earlier read leases in the same round
trip, so a read costs one control round trip, not two.

``sums`` are end-to-end page checksums, a little-endian uint64 array: the
writer's xxh3_64 of each page's bytes (its regions concatenated in order),
0 for "unknown".  On a ``put`` or an ``alloc`` (optional; absent is all 0)
one a key; in a ``get`` or ``locate`` reply one a found page, in key order.
A ``put`` may instead say ``hash_pages: true``: the daemon hashes each page
as it copies it into its own memory (in the same pass, while the page is in
the cache) and keeps that sum; the writer saves its own pass over the batch
(the backend asks it of every tier it writes).  A promotion (``promote``) always carries its sums.
A store keeps each page's sum with the page (moves between tiers keep it)
and answers 0 for a page stored without one; the engine checks every page it
copied against a non-zero sum and takes a mismatch for a miss.
The ``desc`` of a shared-memory transfer is a little-endian int64 array of
(offset, length) pairs into the registered region, ``regions_per_page``
(int32, one per key) says how many pairs make each page.

Shared memory travels on a separate AF_UNIX stream socket (ZeroMQ cannot
carry file descriptors).  The client attaches with one header ``{v, s,
size}`` (``s`` a live session), with its host-pool memfd attached
(SCM_RIGHTS) when it has one, and keeps the connection open; the daemon
answers ``{"ok": True, "region": id or 0, "arena": id, "arena_size": n}``
with a read-only descriptor of its arena attached, and unmaps the region
when the connection closes, so a dead engine never pins its host pool.
"""
from __future__ import annotations

import math
import os
import re
import socket
import struct
import time
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import msgspec
import numpy as np
import xxhash

from tiers._pageindex import key_digests as native_key_digests

PROTOCOL_VERSION = 2  # 2: reads through leased, engine-copied arena pages

OPS = ("hello", "lookup", "get", "put", "delete", "stats", "clear", "evict",
       "alloc", "commit", "locate", "release", "touch")  # alloc, commit, locate: remote memory pools only
ERROR_CODES = (
    "bad_request",  # malformed header or fields
    "bad_version",  # protocol version mismatch
    "unknown_op",
    "no_session",  # session unknown (daemon restarted): say hello again
    "forbidden",  # the connection's tenant may not do this (tiers/node/tenants.py)
    "deadline",  # the deadline passed before the work was done
    "too_large",  # page or message over the configured bound
    "full",  # no room even after eviction
    "busy",  # over a bound on work or bytes in flight: try again later
    "io_error",
    "internal",
)

MAX_HEADER_BYTES = 4 << 20
MAX_KEY_CHARS = 256
MAX_NAMESPACE_CHARS = 512
MAX_BATCH = 4096
MAX_DONE_LEASES = 256  # read leases a locate may release on the way
# The longest a read lease may pin arena blocks: a reader that stops (frozen, or hostile) holds its blocks out
# of everyone's use this long at most. An engine copies a 1 GiB batch out in well under a second.
MAX_LEASE_SECONDS = 30.0
# Keys reach file names in the NVMe tier: a conservative alphabet, no separators.
_KEY_RE = re.compile(r"[A-Za-z0-9_.:=+-]+")


class ProtocolError(Exception):
    """A message that cannot be served; carries the error code for the reply."""

    def __init__(self, code: str, msg: str, req_id: int = 0):
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.req_id = req_id  # the request's id when it could be read (the reply goes to that call)


def pack(obj: Dict[str, Any]) -> bytes:
    # msgspec writes the bytes msgpack.packb(obj, use_bin_type=True) would, in a quarter of the time (0.3 vs
    # 1.3 us a header here: packb builds a Packer each call), on every request and reply.
    return msgspec.msgpack.encode(obj)


def unpack(data) -> Dict[str, Any]:
    """Decode a header; ProtocolError for anything but a msgpack map."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError("too_large", f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES,
                              max_str_len=MAX_HEADER_BYTES, max_array_len=MAX_BATCH * 4,
                              max_map_len=64)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("bad_request", f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_request", "header must be a msgpack map")
    return obj


# ---------------------------------------------------------------- requests

def request(op: str, req_id: int, deadline: Optional[float] = None, session: Optional[int] = None,
            **fields) -> bytes:
    """Encode a request header."""
    header = {"v": PROTOCOL_VERSION, "op": op, "id": req_id}
    if deadline is not None:
        header["dl"] = deadline
    if session is not None:
        header["s"] = session
    header.update(fields)
    return pack(header)


def check_key(key) -> str:
    if (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS or not _KEY_RE.fullmatch(key)
            or not key.strip(".")):  # ".", ".." and the like name directories, not pages
        raise ProtocolError("bad_request", f"invalid key {str(key)[:80]!r}: 1-{MAX_KEY_CHARS} chars of [A-Za-z0-9_.:=+-]")
    return key


def check_namespace(ns) -> str:
    if (not isinstance(ns, str) or not 0 < len(ns) <= MAX_NAMESPACE_CHARS or not _KEY_RE.fullmatch(ns)
            or not ns.strip(".")):
        raise ProtocolError("bad_request", f"invalid namespace {str(ns)[:80]!r}")
    return ns


def check_keys(keys: List[str], max_batch: int = MAX_BATCH) -> List[str]:
    """A batch's keys (a list of str, as the schema decoded it): at most max_batch, each check_key's."""
    if len(keys) > max_batch:
        raise ProtocolError("too_large", f"batch of {len(keys)} keys exceeds {max_batch}")
    if not _keys_valid(keys):
        for key in keys:  # the slow path names the first bad key
            check_key(key)
    return keys


def key_digest(namespace: str, key: str) -> int:
    """A page's 128-bit identity in every index: xxh3_128 of namespace, NUL, key (NUL cannot occur in a
    validated namespace, so the pair encoding is unambiguous)."""
    return xxhash.xxh3_128_intdigest(namespace.encode() + b"\0" + key.encode())


def pack_key_digests(namespace: str, keys: Sequence[str]) -> bytes:
    """key_digest of each key, 16 bytes each (low then high 64 bits, little-endian), in one native call.

    TypeError for a key that is not a str.  Any str hashes: a key no put
    would accept is simply never held.
    """
    return native_key_digests(namespace.encode() + b"\0", keys)


def check_digests(digests: bytes, max_batch: int = MAX_BATCH) -> bytes:
    """A lookup's packed ``digests``: bytes of 16 a key, at most max_batch keys."""
    if len(digests) % 16:
        raise ProtocolError("bad_request", f"digests must be 16 bytes a key, not {len(digests)} bytes")
    if len(digests) // 16 > max_batch:
        raise ProtocolError("too_large", f"batch of {len(digests) // 16} keys exceeds {max_batch}")
    return digests


# Every byte a key may hold, for the batch check below (the same alphabet as _KEY_RE).
_KEY_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:=+-"


def _keys_valid(keys: list) -> bool:
    """check_key's rules for a whole batch in a few C-level passes (a regex a key cost ~1 us each).

    A lookup of 1,024 keys is on the engine's prefetch path: each pass here
    walks the batch once in C, and none builds a Python object per key.
    """
    if not keys:
        return True
    try:
        joined = "\n".join(keys)  # TypeError for anything but str: the slow path names it
    except TypeError:
        return False
    if not joined.isascii():
        return False
    raw = joined.encode("ascii")
    # Deleting every allowed byte (and the separators) must leave nothing behind; a separator inside a
    # key would pass that, so the separators must be exactly the n - 1 the join put in.
    if raw.translate(None, _KEY_BYTES + b"\n") or raw.count(b"\n") != len(keys) - 1:
        return False
    width = len(keys[0])
    if len(raw) == len(keys) * (width + 1) - 1 and raw[width::width + 1] == b"\n" * (len(keys) - 1):
        # Every key as long as the first (SGLang's are 64 hex digits): the separators sit every width + 1.
        if not 0 < width <= MAX_KEY_CHARS:
            return False
    elif "" in keys or max(map(len, keys)) > MAX_KEY_CHARS:  # equality with "" fails at the length: ~10 ns a key
        return False
    # Keys of dots only are refused; SGLang's hex keys have no dot, so this pass is rare.
    return "." not in joined or all(key.strip(".") for key in keys)


# ------------------------------------------------------------------ replies

def reply_ok(req_id: int, **fields) -> bytes:
    header = {"v": PROTOCOL_VERSION, "id": req_id, "ok": True}
    header.update(fields)
    return pack(header)


def reply_error(req_id: int, code: str, msg: str) -> bytes:
    if code not in ERROR_CODES:
        code = "internal"
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": code, "msg": msg[:1000]})


# ----------------------------------------------------- transfer descriptors

def encode_descriptors(pages: Sequence[Sequence[Tuple[int, int]]]) -> Tuple[bytes, bytes]:
    """(offset, length) regions of each page -> (desc, regions_per_page) bytes."""
    counts = np.fromiter(map(len, pages), dtype="<i4", count=len(pages))
    pairs = chain.from_iterable(chain.from_iterable(pages))  # no tuple-to-array conversion a pair
    return np.fromiter(pairs, dtype="<i8", count=2 * int(counts.sum(dtype=np.int64))).tobytes(), counts.tobytes()


def encode_descriptor_arrays(offsets: np.ndarray, lengths: np.ndarray) -> Tuple[bytes, bytes]:
    """Same as encode_descriptors for [pages, regions] arrays of equal region counts."""
    pairs = np.empty(offsets.shape + (2,), dtype="<i8")
    pairs[..., 0] = offsets
    pairs[..., 1] = lengths
    counts = np.full(offsets.shape[0], offsets.shape[1], dtype="<i4")
    return pairs.tobytes(), counts.tobytes()


def decode_descriptor_arrays(desc, counts, n_pages: int,
                             region_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate descriptors; (offsets uint64, lengths uint64, runs a page int64), each region inside the mapping
    (the arrays of tiers/shm/page_runs.py PageRuns: no Python object a page)."""
    if not isinstance(desc, bytes) or not isinstance(counts, bytes):
        raise ProtocolError("bad_request", "desc and regions_per_page must be bytes")
    if len(desc) % 16 or len(counts) != 4 * n_pages:
        raise ProtocolError("bad_request", "descriptor arrays have the wrong length")
    pairs = np.frombuffer(desc, dtype="<i8").reshape(-1, 2)
    per_page = np.frombuffer(counts, dtype="<i4")
    if per_page.size and (per_page.min() < 1 or int(per_page.sum(dtype=np.int64)) != len(pairs)):
        raise ProtocolError("bad_request", "regions_per_page does not add up to the descriptors")
    offsets, lengths = pairs[:, 0], pairs[:, 1]
    # Compared without adding: offset + length may overflow int64 (an offset of 2**63-1 would pass).
    if len(pairs) and (offsets.min() < 0 or lengths.min() <= 0 or bool((offsets > region_size - lengths).any())):
        raise ProtocolError("bad_request", "a descriptor lies outside the registered region")
    return offsets.astype(np.uint64), lengths.astype(np.uint64), per_page.astype(np.int64)


def decode_descriptors(desc, counts, n_pages: int, region_size: int) -> List[List[Tuple[int, int]]]:
    """decode_descriptor_arrays as a list of (offset, length) runs a page."""
    return _runs_by_page(*decode_descriptor_arrays(desc, counts, n_pages, region_size))


def _runs_by_page(offsets: np.ndarray, lengths: np.ndarray, per_page: np.ndarray) -> List[List[Tuple[int, int]]]:
    out, start = [], 0
    plain = list(zip(offsets.tolist(), lengths.tolist()))  # (offset, length) tuples, no step a pair
    for n in per_page.tolist():
        out.append(plain[start:start + n])
        start += n
    return out


def encode_sizes(sizes: Sequence[int]) -> bytes:
    """Page sizes of an ``alloc`` as a little-endian int64 array."""
    return np.asarray(sizes, dtype="<i8").tobytes()


def decode_sizes(raw, n: int, max_size: int) -> List[int]:
    """Validate an ``alloc``'s sizes: n positive int64 values of at most max_size."""
    if not isinstance(raw, bytes) or len(raw) != 8 * n:
        raise ProtocolError("bad_request", "sizes must be one little-endian int64 a key")
    sizes = np.frombuffer(raw, dtype="<i8")
    if n and (sizes.min() <= 0 or sizes.max() > max_size):
        raise ProtocolError("too_large" if n and sizes.max() > max_size else "bad_request",
                            f"page sizes must lie in 1..{max_size}")
    return sizes.tolist()


def encode_sums(sums: Sequence[int]) -> bytes:
    """Page checksums as a little-endian uint64 array."""
    return np.asarray(sums, dtype="<u8").tobytes()


def decode_sums(raw, n: int) -> List[int]:
    """Validate ``sums``: absent is n zeros (unknown), else exactly n little-endian uint64 values."""
    if raw is None:
        return [0] * n
    if not isinstance(raw, bytes) or len(raw) != 8 * n:
        raise ProtocolError("bad_request", f"sums must be {n} little-endian uint64 values, one a page")
    return np.frombuffer(raw, dtype="<u8").tolist()


def decode_pool_extents(desc, counts, sizes: Sequence[int]) -> Optional[List[List[Tuple[int, int]]]]:
    """(address, length) extents of each page a pool granted or found, or None when malformed.

    A client's check of a pool's reply: one entry per page, lengths adding up
    to each page's size.  Never raises: a bad reply is a miss.
    """
    try:
        offsets, lengths, per_page = decode_descriptor_arrays(desc, counts, len(sizes), 1 << 62)
    except ProtocolError:
        return None
    if len(per_page):  # each page's lengths add up to its size: one numpy pass (every read's locate comes here)
        totals = np.add.reduceat(lengths, np.concatenate(([0], np.cumsum(per_page)[:-1])))
        if not np.array_equal(totals, np.asarray(sizes, dtype=np.uint64)):
            return None
    return _runs_by_page(offsets, lengths, per_page)


def flags(values: Sequence[bool]) -> bytes:
    """One byte per value; compact and cheap to pack."""
    return bytes(1 if v else 0 for v in values)


def leading_run(held: bytes) -> int:
    """Length of the leading run of non-zero bytes."""
    idx = held.find(b"\x00")
    return len(held) if idx < 0 else idx


# ---------------------------------------------- fd passing over AF_UNIX

_LEN = struct.Struct("<I")


def send_register(sock: socket.socket, fd: int, header: Dict[str, Any]) -> None:
    body = pack(header)
    socket.send_fds(sock, [_LEN.pack(len(body)) + body], [fd])


def recv_register(sock: socket.socket) -> Tuple[bytes, Optional[int]]:
    """Read one length-prefixed header (undecoded: tiers/wire/messages.py decode_attach) and at most
    one fd; ProtocolError when truncated."""
    data, fds = recv_framed_fds(sock, 1)
    return data, (fds[0] if fds else None)


def recv_framed_fds(sock: socket.socket, most: int) -> Tuple[bytes, List[int]]:
    """Read one length-prefixed header (undecoded) and at most ``most`` fds (any more are closed);
    ProtocolError when truncated."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 4)
    if not data or len(data) < 4 or _LEN.unpack_from(data)[0] != len(data) - 4:
        for fd in fds:
            os.close(fd)
        if not data:
            raise ConnectionResetError("peer closed")
        raise ProtocolError("bad_request", "register message is truncated")
    for fd in fds[most:]:
        os.close(fd)
    return data[4:], fds[:most]


def send_framed(sock: socket.socket, header: Dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One length-prefixed header, with fds attached (SCM_RIGHTS) when given."""
    body = pack(header)
    if not fds:
        sock.sendall(_LEN.pack(len(body)) + body)
    else:
        socket.send_fds(sock, [_LEN.pack(len(body)) + body], list(fds))


def check_lease_expiry(expiry: float) -> float:
    """A get's lease expiry (CLOCK_MONOTONIC): finite, in the future, at most MAX_LEASE_SECONDS away."""
    if not math.isfinite(expiry):
        raise ProtocolError("bad_request", "lease must be a finite number (CLOCK_MONOTONIC seconds)")
    now = time.monotonic()
    if expiry <= now:
        raise ProtocolError("deadline", "the lease ended before the request was served")
    if expiry > now + MAX_LEASE_SECONDS:
        raise ProtocolError("bad_request", f"a lease may last at most {MAX_LEASE_SECONDS:.0f} s")
    return float(expiry)
