"""Engines attach to a daemon over AF_UNIX (SCM_RIGHTS): host pools in, the daemon's arena out.

A client connects to ``<tier>.fd.sock``, sends one attach header (its live
session, with its host-pool memfd when it has one) and keeps the connection
open.  The daemon maps the host pool read-only, once: it only ever reads
from it (writes), and reads it through the SIGBUS-guarded copy, because a
buggy engine may truncate it.  It answers with a read-only descriptor of its
arena (tiers/shm/arena.py), which the engine maps to copy leased pages out.
When the connection closes (engine exit or crash) the mapping is dropped, so
no daemon pins a dead engine's host pool.  A memfd is mapped once however many
connections attach it (its page tables once, not once a connection: 200
attaches of 1 GiB cost 401 MiB of them), and unmapped when its last
connection closes, off the loop thread (unmapping a large mapping takes
long).  The session named must be one the
connecting account's tenant opened (SO_PEERCRED), and only a tenant allowed
to (``map_arena``: the operator's accounts, or a tenant so configured) gets the
arena: the arena holds every namespace's pages.

Bounded against floods: at most MAX_CONNECTIONS open, a connection that has
not attached within ATTACH_TIMEOUT is closed, a host pool larger than
max_region_bytes is refused, and running out of descriptors (EMFILE) pauses
accepting instead of ending the daemon.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import zmq

from tiers.wire import messages as M
from tiers.shm.directory import PageDirectory
from tiers.wire import protocol as P
from tiers.shm.buffers import POPULATE_SLICE, address_of, populate
from tiers.node.endpoint import open_socket_file, private_dir
from tiers.logs import RateLimitedLog
from tiers.node.tenants import OPERATOR, Tenant, TenantTable

log = logging.getLogger("hicache.regions")
_warn = RateLimitedLog(log)

MAX_CONNECTIONS = 256
MAX_TENANT_CONNECTIONS = 64  # of them, one configured tenant's (the operator's engines may take them all)
ATTACH_TIMEOUT = 2.0  # seconds a connection may stay silent before attaching
ACCEPT_PAUSE = 0.2  # seconds accepting rests after running out of descriptors


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer_uid(conn: socket.socket) -> Optional[int]:
    """The connecting process's uid, as the kernel recorded it at connect (SO_PEERCRED)."""
    try:
        return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
    except OSError:
        return None


def _populate(mapping: mmap.mmap) -> None:
    """Build the mapping's page tables once, off the loop thread and without the GIL.

    Otherwise the first batches through a fresh mapping run at minor-fault
    speed (0.3 instead of 2+ GB/s here).
    """
    try:
        populate(mapping, write=False, step=POPULATE_SLICE)  # beside the loop and the I/O pool
    except (OSError, ValueError, TypeError):
        pass  # pages fault in on first use


def _resident(fd: int, size: int) -> bool:
    """Whether the memfd's memory is (nearly) all allocated: populating a sparse one would allocate it for us."""
    try:
        return os.fstat(fd).st_blocks * 512 >= size * 0.9
    except OSError:
        return False


@dataclass
class _Mapping:
    """One memfd's read-only mapping, shared by every region attached from it."""
    key: Tuple[int, int, int]  # the memfd's st_dev, st_ino, and the size mapped
    mapping: mmap.mmap
    view: memoryview
    base: int  # its address in this process
    users: int = 0


def _unmap(shared: _Mapping) -> None:
    try:
        shared.view.release()
        shared.mapping.close()
    except BufferError:  # a transfer still holds a slice; the mapping goes when it is done
        log.debug("region still in use at close")


@dataclass
class Region:
    region_id: int
    session: int
    size: int
    shared: _Mapping
    conn: socket.socket

    @property
    def view(self) -> memoryview:
        return self.shared.view

    @property
    def base(self) -> int:
        return self.shared.base


@dataclass
class _Conn:
    sock: socket.socket
    opened: float
    tenant: Tenant
    region: Optional[Region] = None
    attached: bool = False
    session: Optional[int] = None  # the session it attached for: it lives as long as that session


class RegionRegistry:
    def __init__(self, path: str, export_fd: Callable[[], int], export_id: int, export_size: int,
                 session_tenant: Callable[[Optional[int]], Optional[Tenant]], max_region_bytes: int,
                 tenants: Optional[TenantTable] = None, socket_gid: Optional[int] = None,
                 directory: Optional[PageDirectory] = None):
        self.path = path
        self._export_fd, self.export_id, self.export_size = export_fd, export_id, export_size
        self._directory = directory  # the arena's page directory, handed out with it (tiers/shm/directory.py)
        self._session_tenant = session_tenant  # the tenant that opened a live session (None: no such session)
        self.tenants = tenants or TenantTable()
        self.socket_gid = socket_gid
        self.max_region_bytes = max_region_bytes
        self._listener: Optional[socket.socket] = None
        self._listening = False
        self._resume_at = 0.0
        self._by_id: Dict[int, Region] = {}
        self._mappings: Dict[Tuple[int, int, int], _Mapping] = {}
        self._unmapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unmap")
        self._conns: Dict[int, _Conn] = {}
        self._per_tenant: Dict[str, int] = {}  # open connections of each configured tenant
        self.refused = 0
        self.expired = 0  # attached connections closed because their session was forgotten
        # Store hooks: called with a region's view after mapping (an exception refuses
        # the region) and before unmapping; the remote tier registers it with its engine.
        self.on_map: Optional[Callable[[memoryview], None]] = None
        self.on_unmap: Optional[Callable[[memoryview], None]] = None

    def __len__(self) -> int:
        return len(self._by_id)

    def bind(self) -> None:
        private_dir(os.path.dirname(self.path), self.socket_gid)
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # created 0600: no window where another account could connect
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        open_socket_file(self.path, self.socket_gid)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener

    def register(self, poller) -> None:
        poller.register(self._listener.fileno(), zmq.POLLIN)
        self._listening = True

    def get(self, region_id, session) -> Region:
        region = self._by_id.get(region_id) if isinstance(region_id, int) else None
        if region is None or region.session != session:
            raise P.ProtocolError("no_session", "unknown region; register the host pool again")
        return region

    def handle_events(self, events: dict, poller) -> None:
        if self._listening and self._listener.fileno() in events:
            self._accept(poller)
        for fd in [fd for fd in self._conns if fd in events]:
            self._serve_conn(fd, poller)

    def tick(self, poller) -> None:
        """Housekeeping: close connections that never attached, and those whose session the daemon forgot (a
        tenant's idle or surplus sessions, tiers/node/sessions.py: the client attaches again after its next
        hello); resume accepting after a pause."""
        now = time.monotonic()
        for fd, conn in list(self._conns.items()):
            if not conn.attached and now - conn.opened > ATTACH_TIMEOUT:
                self.refused += 1
                self._drop(fd, poller)
            elif conn.attached and self._session_tenant(conn.session) is None:
                self.expired += 1
                self._drop(fd, poller)
        if not self._listening and now >= self._resume_at:
            self.register(poller)

    def _accept(self, poller) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: attached engines keep being served; new ones wait.
                    _warn.warning("emfile", "cannot accept an engine's attach connection: %s; pausing %.1f s",
                                  exc.strerror, ACCEPT_PAUSE)
                    poller.unregister(self._listener.fileno())
                    self._listening = False
                    self._resume_at = time.monotonic() + ACCEPT_PAUSE
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            tenant = self.tenants.of_uid(_peer_uid(sock))
            if tenant is None:  # an account no tenant names: it holds no slot, not even for ATTACH_TIMEOUT
                sock.close()
                self.refused += 1
                continue
            mine = self._per_tenant.get(tenant.name, 0)
            if len(self._conns) >= MAX_CONNECTIONS or (tenant is not OPERATOR and mine >= MAX_TENANT_CONNECTIONS):
                sock.close()
                self.refused += 1
                _warn.warning("conns", "refused an attach connection of tenant %s: %d open (%d of it)",
                              tenant.name, len(self._conns), mine)
                continue
            sock.settimeout(2.0)
            self._per_tenant[tenant.name] = mine + 1
            self._conns[sock.fileno()] = _Conn(sock, time.monotonic(), tenant)
            poller.register(sock.fileno(), zmq.POLLIN)

    def _serve_conn(self, fd: int, poller) -> None:
        conn = self._conns[fd]
        if conn.attached:
            # An attached connection only ever speaks by closing.
            try:
                data = conn.sock.recv(1, socket.MSG_DONTWAIT)
            except (BlockingIOError, socket.timeout):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(fd, poller)
            return
        try:
            raw, memfd = P.recv_register(conn.sock)
        except (ConnectionResetError, OSError):
            self._drop(fd, poller)
            return
        except P.ProtocolError as exc:
            self._reply_and_drop(fd, poller, {"ok": False, "code": exc.code, "msg": exc.msg})
            return
        try:
            region, tenant, conn.session = self._map(raw, memfd, conn.sock, conn.tenant)
        except P.ProtocolError as exc:
            self.refused += 1
            self._reply_and_drop(fd, poller, {"ok": False, "code": exc.code, "msg": exc.msg})
            return
        if region is not None and region.shared.users == 0 and self.on_map is not None:  # a memfd new to us
            try:
                self.on_map(region.view)
            except Exception as exc:  # the store refused the mapping: the client falls back to frames
                log.warning("store refused a host pool region: %s", exc)
                _unmap(region.shared)
                self._reply_and_drop(fd, poller, {"ok": False, "code": "io_error", "msg": f"store refused the region: {exc}"})
                return
        conn.region, conn.attached = region, True
        if region is not None:
            region.shared.users += 1
            self._mappings[region.shared.key] = region.shared
            self._by_id[region.region_id] = region
        # The arena holds every namespace's pages: only a tenant trusted with them maps it (the others read
        # pages as frames, one copy more).
        export = self._export_fd() if tenant.map_arena else None
        listing = self._directory.export_fd() if export is not None and self._directory is not None else None
        reply = {"v": P.PROTOCOL_VERSION, "ok": True, "region": region.region_id if region is not None else 0}
        if export is not None:
            reply.update(arena=self.export_id, arena_size=self.export_size)
        if listing is not None:
            reply.update(directory=self._directory.size)
        fds = [f for f in (export, listing) if f is not None]
        try:
            P.send_framed(conn.sock, reply, fds=fds)
        except OSError:  # the client stopped waiting (its deadline passed): it will attach again
            log.info("an engine left before its attach reply")
            self._drop(fd, poller)
            return
        finally:
            for sent in fds:
                os.close(sent)
        if region is not None:
            log.info("mapped a host pool region of %d bytes", region.size)

    def _map(self, raw: bytes, memfd: Optional[int], conn, peer: Tenant) -> Tuple[Optional[Region], Tenant, int]:
        """The region a connection of tenant peer attaches (None: the arena only), the session's tenant and
        the session."""
        try:
            attach = M.decode_attach(raw)
            version, session, size = attach.v, attach.s, attach.size
            if type(version) is not int or version != P.PROTOCOL_VERSION:
                raise P.ProtocolError("bad_version", f"protocol version {version!r} is not supported")
            tenant = self._session_tenant(session)
            if tenant is None:
                raise P.ProtocolError("no_session", "attach needs a live session (send hello first)")
            if peer is not tenant:
                raise P.ProtocolError("forbidden", "a session attaches only from an account of its own tenant")
            if memfd is None:
                return None, tenant, session  # the arena only: pages travel as frames on the way in
            if size is None or size <= 0:
                raise P.ProtocolError("bad_request", "attach with a memfd needs a positive integer size")
            if size > self.max_region_bytes:
                raise P.ProtocolError("too_large", f"host pool of {size} bytes exceeds max_region_bytes "
                                                   f"{self.max_region_bytes}")
            st = os.fstat(memfd)
            if st.st_size < size:
                raise P.ProtocolError("bad_request", f"fd holds {st.st_size} bytes, fewer than the declared {size}")
            shared = self._mappings.get((st.st_dev, st.st_ino, size))
            if shared is None:
                try:
                    mapping = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                except (OSError, ValueError) as exc:
                    raise P.ProtocolError("bad_request", f"cannot map the fd: {exc}") from None
                if _resident(memfd, size):
                    threading.Thread(target=_populate, args=(mapping,), name="populate", daemon=True).start()
                view = memoryview(mapping)
                shared = _Mapping((st.st_dev, st.st_ino, size), mapping, view, address_of(view))
        finally:
            if memfd is not None:
                os.close(memfd)  # the mapping keeps the memory alive
        return Region(secrets.randbits(62), session, size, shared, conn), tenant, session

    def _reply_and_drop(self, fd: int, poller, reply: dict) -> None:
        try:
            P.send_framed(self._conns[fd].sock, {"v": P.PROTOCOL_VERSION, **reply})
        except OSError:
            pass
        self._drop(fd, poller)

    def _drop(self, fd: int, poller) -> None:
        conn = self._conns.pop(fd)
        left = self._per_tenant.get(conn.tenant.name, 1) - 1
        if left > 0:
            self._per_tenant[conn.tenant.name] = left
        else:
            self._per_tenant.pop(conn.tenant.name, None)
        try:
            poller.unregister(fd)
        except KeyError:
            pass
        region = conn.region
        if region is not None:
            self._by_id.pop(region.region_id, None)
            shared = region.shared
            shared.users -= 1
            if shared.users == 0:  # its last connection: unmapped on a thread of its own (munmap takes long)
                self._mappings.pop(shared.key, None)
                self._unmapper.submit(self._unhook_and_unmap, region)
                log.info("unmapping a host pool region of %d bytes (client went away)", region.size)
        conn.sock.close()

    def _unhook_and_unmap(self, region: Region) -> None:
        """The store forgets the region (the remote tier unregisters it from its engine: with RDMA, unpinning
        tens of GiB takes long, as munmap does), then it is unmapped; off the loop thread."""
        self._unhook(region)
        _unmap(region.shared)

    def _unhook(self, region: Region) -> None:
        if self.on_unmap is not None:
            try:
                self.on_unmap(region.view)
            except Exception as exc:
                log.warning("store failed to forget a host pool region: %s", exc)

    def close(self) -> None:
        for fd in list(self._conns):
            self._conns.pop(fd).sock.close()
        for region in self._by_id.values():
            if region.shared.key in self._mappings:
                del self._mappings[region.shared.key]
                self._unhook(region)
                _unmap(region.shared)
        self._by_id.clear()
        self._unmapper.shutdown(wait=True)
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
