"""The NVMe index saved at a clean shutdown and loaded at the next start, instead of a scan.

A scan of a million chunk names takes 15-30 s (one stat a file, more on a
cold disk); a node of tens of millions of chunks would be partly dark for
minutes after every restart.  At a clean close the store writes its index
to ``index.snapshot`` beside the data: a header, each namespace's hash and
name, the leaf directories that exist, then each chunk's row (32 bytes:
digest, sizes, reads) in eviction order, checksummed.  The next start reads
it and serves at once with the whole index and its order.

It is good for one start only: the file is removed before the store serves
anything, so a crash later leaves no snapshot and the next start scans (a
snapshot never speaks for writes made after it).  A bad snapshot (short,
wrong version or checksum, a digest twice) is removed with a warning and the
scan runs.  Only our store writes in the directory (it holds ``LOCK``); a
chunk file removed behind its back while it was down reads as a miss and is
forgotten, as it would be after a scan.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import List, Optional, Tuple

from tiers.stores.page_index import MAX_TENANTS, SAVED_ROW_BYTES
from tiers.stores.nvme import chunkfile as cf
from tiers.stores.nvme.layout import LeafDirs
from tiers.stores.nvme.ledger import Ledger

log = logging.getLogger("hicache.nvme")

NAME = "index.snapshot"
MAGIC = b"HCNVIDX1"
_HEAD = struct.Struct("<8sIIQQII")  # magic, version, order, rows, checksum, tenants, leaf bitmap bytes
_TENANT = struct.Struct("<QH")  # namespace hash, name length (0: not known), then the name's bytes
VERSION = 3  # 3: rows say where a page of a batch chunk lies (file, block), and keep no page size


def path_of(root: str) -> str:
    return os.path.join(root, NAME)


def save(root: str, ledger: Ledger, dirs: LeafDirs) -> Optional[int]:
    """Write the snapshot (temp file, fsync, rename, fsync the directory); the rows written, None when the
    ledger's order is not one the index keeps (a Python policy: the next start scans)."""
    if not ledger.native_order:
        return None
    path = path_of(root)
    tmp = path + ".tmp"
    with ledger.lock:
        tenants = ledger.tenants.table()  # (namespace hash, name) of each tenant number, in number order
    with open(tmp, "wb") as f:
        f.write(b"\0" * _HEAD.size)  # the header, once the rows and their checksum are known
        for ns_hash, name in tenants:
            raw = (name or "").encode()
            f.write(_TENANT.pack(ns_hash, len(raw)) + raw)
        f.write(dirs.to_bytes())
        f.flush()
        with ledger.lock:
            rows, checksum = ledger.index.save(f.fileno())
        f.seek(0)
        f.write(_HEAD.pack(MAGIC, VERSION, ledger.order_code, rows, checksum, len(tenants), len(dirs.to_bytes())))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    cf.fsync_dir(root)
    return rows


def load(root: str, ledger: Ledger, dirs: LeafDirs) -> Optional[int]:
    """Fill an empty ledger from the snapshot and remove it; the rows loaded, None when there is none or it
    is not sound (then the ledger is empty again and the caller scans)."""
    path = path_of(root)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        # Gone before anything is served: a crash from here on leaves no snapshot to trust.
        os.unlink(path)
        cf.fsync_dir(root)
        try:
            return _read(f, ledger, dirs)
        except (ValueError, struct.error, UnicodeDecodeError, OSError) as exc:
            ledger.reset()
            log.warning("%s: the index snapshot is not sound (%s); scanning the directory instead", root, exc)
            return None


def _read(f, ledger: Ledger, dirs: LeafDirs) -> int:
    magic, version, order, rows, checksum, n_tenants, n_bits = _HEAD.unpack(f.read(_HEAD.size))
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a version {VERSION} snapshot")
    if order != ledger.order_code:
        raise ValueError("written under another eviction policy")
    if n_tenants > MAX_TENANTS:
        raise ValueError(f"{n_tenants} namespaces listed")
    tenants = []
    for _ in range(n_tenants):
        ns_hash, length = _TENANT.unpack(f.read(_TENANT.size))
        name = f.read(length).decode() if length else None
        tenants.append((ns_hash, name))
    bits = f.read(n_bits)
    if len(bits) != n_bits:
        raise ValueError("short leaf directory table")
    dirs.load_bytes(bits)
    offset = f.tell()
    if os.fstat(f.fileno()).st_size - offset != rows * SAVED_ROW_BYTES:  # before a single row is allocated
        raise ValueError(f"the header says {rows} rows, the file holds another size")
    return _load_rows(ledger, f.fileno(), offset, rows, checksum, tenants)


def _load_rows(ledger: Ledger, fd: int, offset: int, rows: int, checksum: int,
               tenants: List[Tuple[int, Optional[str]]]) -> int:
    """Fill the empty ledger from a snapshot's rows at offset of fd (ValueError when they are not sound)."""
    with ledger.lock:
        if len(ledger.index) or ledger.tenants.by_hash:
            raise ValueError("load into an empty ledger only")
        for ns_hash, name in tenants:
            ledger.tenants.tenant(ns_hash, ledger.index, name)
        if len(ledger.tenants.by_hash) != len(tenants):
            raise ValueError("a namespace hash listed twice")
        os.lseek(fd, offset, os.SEEK_SET)
        loaded = ledger.index.load(fd, rows, checksum)
        for number, (count, nbytes) in ledger.index.totals().items():
            if number >= len(tenants):
                raise ValueError("a row of a namespace the snapshot does not list")
            ledger.tenants.numbered[number].bytes = nbytes
            ledger.used += nbytes
        ledger.tenants.regrouped()
        return loaded
