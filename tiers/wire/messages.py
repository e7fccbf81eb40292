"""The typed message schema: one msgspec Struct a request operation, one a reply.

tiers/wire/protocol.py says what each field means and how the batch fields
(descriptors, sums, sizes, digests) are laid out; this module says which
fields each message has and of which type, and decodes a message straight
into its Struct.  A message is still a msgpack map on the wire (a Struct
encodes as a map of its field names), so the format is the one the protocol
module documents; what changed is that nothing reads a raw dict: a field of
the wrong type, a missing field, a header that is not a map, all end in one
``ProtocolError`` with msgspec's account of where (``Expected `str`, got
`int` - at `$.keys[0]```).  Unknown fields are ignored, so a newer engine may
add optional fields without breaking an older daemon.

Decoding into Structs is also faster than msgpack into dicts and checking
each field in Python (a 128-key lookup header: ~4.6 us against ~5 us for
msgpack alone, before any check).
"""
from __future__ import annotations

import math
import time
from typing import Annotated, Any, Dict, List, Optional, Type, Union

import msgspec
from msgspec import Meta, Struct, field

from tiers.wire.protocol import (MAX_BATCH, MAX_DONE_LEASES, MAX_HEADER_BYTES, OPS, PROTOCOL_VERSION,
                                 ProtocolError)

# A list longer than this is malformed whatever the daemon's own batch bound (which is checked after
# decoding, for a too_large reply): it bounds what a hostile header can make the daemon build.
MAX_LIST = MAX_BATCH * 4
Keys = Annotated[List[str], Meta(max_length=MAX_LIST)]
Leases = Annotated[List[int], Meta(max_length=MAX_LIST)]


class Request(Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """The fields every request has: version, request id (echoed), absolute deadline (Unix s), session, and
    pages the session read through the tier's page directory since its last request (counted first)."""
    v: Any = None  # checked by value (an old engine's version gets bad_version, not a type error)
    id: int = 0
    dl: Optional[float] = None
    s: Optional[int] = None
    touched: Optional[Keys] = None
    touched_sizes: Optional[bytes] = None


class Hello(Request, tag="hello"):
    ns: str
    client: str = ""


class Lookup(Request, tag="lookup"):
    keys: Optional[Keys] = None
    digests: Optional[bytes] = None  # 16 bytes a key (protocol.pack_key_digests), instead of keys
    done: Optional[Leases] = None


class Get(Request, tag="get"):
    keys: Keys
    region: Optional[int] = None  # refused: a daemon never writes into a host pool
    lease: Optional[float] = None  # the engine's give-up time on CLOCK_MONOTONIC; absent: pages as frames
    sizes: Optional[bytes] = None
    done: Optional[Leases] = None
    stream: bool = False  # with a lease: answer at once, each page marked on a board as it is read


class Put(Request, tag="put"):
    keys: Keys
    region: Optional[int] = None
    desc: Optional[bytes] = None
    regions_per_page: Optional[bytes] = None
    frames_per_page: Optional[Annotated[List[int], Meta(max_length=MAX_LIST)]] = None
    parents: Optional[Annotated[List[Optional[str]], Meta(max_length=MAX_LIST)]] = None
    sums: Optional[bytes] = None
    hash_pages: bool = False
    promote: bool = False
    mode: str = "through"
    min_reads: int = 2
    done: Optional[Leases] = None
    ns: Optional[str] = None  # another namespace than the session's: _admin sessions only (demotion links)


class Release(Request, tag="release"):
    lease: int


class Touch(Request, tag="touch"):
    """Only ``touched``: pages read through the tier's page directory that no request carried within
    a moment (tiers/wire/direct_reads.py); not waited for."""


class Delete(Request, tag="delete"):
    keys: Keys


class Stats(Request, tag="stats"):
    pass


class Clear(Request, tag="clear"):
    everything: bool = field(name="all", default=False)
    ns: Optional[str] = None


class Evict(Request, tag="evict"):
    nbytes: int = field(name="bytes")
    everything: bool = field(name="all", default=False)
    ns: Optional[str] = None


class Alloc(Request, tag="alloc"):
    keys: Keys
    sizes: bytes
    parents: Optional[Annotated[List[Optional[str]], Meta(max_length=MAX_LIST)]] = None
    ttl: Optional[float] = None
    sums: Optional[bytes] = None


class Commit(Request, tag="commit"):
    lease: int
    keys: Keys


class Locate(Request, tag="locate"):
    keys: Keys
    ttl: Optional[float] = None
    done: Optional[Annotated[List[int], Meta(max_length=MAX_DONE_LEASES)]] = None


REQUESTS: Dict[str, Type[Request]] = {cls.__struct_config__.tag: cls for cls in (
    Hello, Lookup, Get, Put, Release, Touch, Delete, Stats, Clear, Evict, Alloc, Commit, Locate)}
assert set(REQUESTS) == set(OPS), "every operation has its Struct"

_requests = msgspec.msgpack.Decoder(Union[tuple(REQUESTS.values())])


class _Envelope(Struct):
    """What a request that failed to decode is read as, to answer it with the right code and id."""
    v: Any = None
    id: Any = 0
    op: Any = None


_envelope = msgspec.msgpack.Decoder(_Envelope)


def decode_request(raw: bytes) -> Request:
    """A request header as its Struct, its version, deadline and types checked; ProtocolError otherwise,
    carrying the request's id when one could be read (the refusal goes to the right call)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("too_large", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = _requests.decode(raw)
    except msgspec.ValidationError as exc:
        raise _refusal(raw, str(exc)) from None
    except Exception as exc:  # DecodeError, and UnicodeDecodeError for a str that is not UTF-8
        raise ProtocolError("bad_request", f"header is not valid msgpack: {exc}") from None
    _check_version(msg.v, msg.id)
    if msg.dl is not None:
        if not math.isfinite(msg.dl):
            raise ProtocolError("bad_request", "dl must be a finite number", msg.id)
        if time.time() > msg.dl:
            raise ProtocolError("deadline", "deadline passed before the request was served", msg.id)
    return msg


def _check_version(version: Any, req_id: int) -> None:
    if type(version) is not int or version != PROTOCOL_VERSION:  # 2.0 and True are not 2
        raise ProtocolError("bad_version", f"protocol version {version!r} is not supported; "
                                           f"this daemon speaks {PROTOCOL_VERSION}", req_id)


def _refusal(raw: bytes, why: str) -> ProtocolError:
    """The error for a header that did not fit its Struct: a wrong version or operation first."""
    try:
        envelope = _envelope.decode(raw)
    except Exception:  # not a map, or a field the envelope reads is not UTF-8
        return ProtocolError("bad_request", "header must be a msgpack map")
    req_id = envelope.id if type(envelope.id) is int else 0
    _check_version(envelope.v, req_id)
    if not isinstance(envelope.op, str) or envelope.op not in REQUESTS:  # any msgpack value, a map too
        return ProtocolError("unknown_op", f"unknown operation {envelope.op!r}; known: {', '.join(OPS)}", req_id)
    return ProtocolError("bad_request", why, req_id)


def encode(msg: Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


# ------------------------------------------------------------------ replies
# Every reply field has a default: an error reply (ok false, code, msg) decodes into its operation's
# Struct too.  A reply that does not fit (a buggy or hostile daemon) is a failed call, never a crash.

class Reply(Struct, kw_only=True):
    v: Any = None
    id: Any = 0
    ok: bool = False
    code: str = ""
    msg: str = ""

    def flags(self) -> bytes:
        """The reply's one byte a key (stored, found, granted, committed); empty for other replies."""
        return b""


class HelloReply(Reply):
    session: int = 0
    tier: str = ""
    max_page_bytes: int = 0
    max_batch: int = 0
    fd_socket: str = ""
    digests: bool = False
    dir_ns: int = 0  # the session's namespace number in the tier's page directory (0: none)


class LookupReply(Reply):
    held: bytes = b""
    prefix: int = 0


class GetReply(Reply):
    found: bytes = b""
    sums: Optional[bytes] = None
    lease: Optional[int] = None  # with a lease: the arena's extents of the found pages
    arena: Optional[int] = None
    dir_ns: Optional[int] = None  # with a lease: the namespace's number in the page directory now
    desc: Optional[bytes] = None
    regions_per_page: Optional[bytes] = None
    board: Optional[int] = None  # streamed: the arena offset of the read's progress board (no sums here)

    def flags(self) -> bytes:
        return self.found


class PutReply(Reply):
    stored: bytes = b""
    refusal: Optional[List[str]] = None  # the first page refused: (code, message)

    def flags(self) -> bytes:
        return self.stored


class ReleaseReply(Reply):
    released: Union[bool, int] = False


class TouchReply(Reply):
    """Answered as any request; the client's touch thread reads its replies only to drop them."""


class DeleteReply(Reply):
    deleted: int = 0


class StatsReply(Reply):
    tier: str = ""
    stats: Optional[Dict[str, Any]] = None


class ClearReply(Reply):
    cleared: Optional[int] = None


class EvictReply(Reply):
    evicted_pages: int = 0
    evicted_bytes: int = 0


class AllocReply(Reply):
    lease: int = 0
    seg: str = ""
    granted: bytes = b""
    desc: Optional[bytes] = None
    regions_per_page: Optional[bytes] = None
    refusal: Optional[List[str]] = None

    def flags(self) -> bytes:
        return self.granted


class CommitReply(Reply):
    committed: bytes = b""

    def flags(self) -> bytes:
        return self.committed


class LocateReply(Reply):
    lease: int = 0
    seg: str = ""
    found: bytes = b""
    sizes: Optional[bytes] = None
    sums: Optional[bytes] = None
    desc: Optional[bytes] = None
    regions_per_page: Optional[bytes] = None
    board: Optional[int] = None  # streamed: the arena offset of the read's progress board (no sums here)

    def flags(self) -> bytes:
        return self.found


REPLIES: Dict[str, Type[Reply]] = {
    "hello": HelloReply, "lookup": LookupReply, "get": GetReply, "put": PutReply, "release": ReleaseReply,
    "touch": TouchReply, "delete": DeleteReply, "stats": StatsReply, "clear": ClearReply, "evict": EvictReply,
    "alloc": AllocReply, "commit": CommitReply, "locate": LocateReply}
assert set(REPLIES) == set(OPS), "every operation has its reply Struct"
_replies = {op: msgspec.msgpack.Decoder(cls) for op, cls in REPLIES.items()}
_any_reply = msgspec.msgpack.Decoder(Reply)


def decode_reply(op: str, raw) -> Reply:
    """A reply to op as its Struct.  A reply that is not a map at all raises ProtocolError; one whose
    fields do not fit comes back as a failure (ok false, code internal) with the id it carried, so the
    call it answers ends at once instead of waiting out its deadline."""
    try:
        return _replies[op].decode(raw)
    except msgspec.ValidationError as exc:
        try:
            envelope = _any_reply.decode(raw)  # the common fields alone: the id, to match the call
        except Exception:
            raise ProtocolError("bad_request", f"reply does not fit: {exc}") from None
        return REPLIES[op](v=envelope.v, id=envelope.id, ok=False, code="internal", msg=f"reply does not fit: {exc}")
    except Exception as exc:  # DecodeError, UnicodeDecodeError
        raise ProtocolError("bad_request", f"reply is not valid msgpack: {exc}") from None


# ------------------------------------------------------- attaching a host pool

class Attach(Struct):
    """The one header a client sends on the fd socket: version, live session, size of its memfd."""
    v: Any = None
    s: Optional[int] = None
    size: Optional[int] = None


class AttachReply(Struct, kw_only=True):
    """The daemon's answer on the fd socket (its arena's descriptor attached when ok)."""
    v: Any = None
    ok: bool = False
    code: str = ""
    msg: str = ""
    region: int = 0  # 0: the arena only (no memfd was sent, or the store refused it)
    arena: Optional[int] = None
    arena_size: Optional[int] = None
    directory: Optional[int] = None  # the page directory's size; its descriptor follows the arena's


_attach = msgspec.msgpack.Decoder(Attach)
_attach_reply = msgspec.msgpack.Decoder(AttachReply)


def decode_attach(raw: bytes) -> Attach:
    try:
        return _attach.decode(raw)
    except msgspec.ValidationError as exc:
        raise ProtocolError("bad_request", f"attach header: {exc}") from None
    except Exception as exc:  # DecodeError, UnicodeDecodeError
        raise ProtocolError("bad_request", f"attach header is not valid msgpack: {exc}") from None


def decode_attach_reply(raw: bytes) -> AttachReply:
    """The daemon's attach reply; a reply that does not fit is a refusal."""
    try:
        return _attach_reply.decode(raw)
    except Exception as exc:
        return AttachReply(ok=False, code="internal", msg=f"attach reply does not fit: {exc}")
