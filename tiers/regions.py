"""Shared host-pool mappings handed to a daemon over AF_UNIX (SCM_RIGHTS).

A client connects to ``<tier>.fd.sock``, sends one ``register`` header with
its memfd attached and keeps the connection open.  The daemon maps the fd
once; transfers then name (region, offset, length).  When the connection
closes (engine exit or crash) the mapping is dropped, so no daemon pins a dead
engine's host pool.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from tiers import protocol as P
from tiers.buffers import populate

log = logging.getLogger("hicache.regions")

MAX_REGIONS = 256
def _populate(mapping: mmap.mmap) -> None:
    """Build the mapping's page tables once, off the loop thread and without the GIL.

    Otherwise the first batches through a fresh mapping run at minor-fault
    speed (0.3 instead of 2+ GB/s here).
    """
    try:
        populate(mapping)
    except (OSError, ValueError, TypeError):
        pass  # pages fault in on first use


@dataclass
class Region:
    region_id: int
    session: int
    size: int
    mapping: mmap.mmap
    view: memoryview
    conn: socket.socket


class RegionRegistry:
    def __init__(self, path: str):
        self.path = path
        self._listener: Optional[socket.socket] = None
        self._by_id: Dict[int, Region] = {}
        self._by_conn: Dict[int, Optional[Region]] = {}  # fd -> region (None until registered)
        self._conns: Dict[int, socket.socket] = {}
        # Store hooks: called with a region's view after mapping (an exception refuses
        # the region) and before unmapping; the remote tier registers it with its engine.
        self.on_map: Optional[Callable[[memoryview], None]] = None
        self.on_unmap: Optional[Callable[[memoryview], None]] = None

    def __len__(self) -> int:
        return len(self._by_id)

    def bind(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # created 0600: no window where another account could connect
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener

    def register(self, poller) -> None:
        import zmq
        poller.register(self._listener.fileno(), zmq.POLLIN)

    def get(self, region_id, session) -> Region:
        region = self._by_id.get(region_id) if isinstance(region_id, int) else None
        if region is None or region.session != session:
            raise P.ProtocolError("no_session", "unknown region; register the host pool again")
        return region

    def handle_events(self, events: dict, poller) -> None:
        import zmq
        if self._listener.fileno() in events:
            while True:
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    break
                if len(self._conns) >= MAX_REGIONS:
                    conn.close()
                    log.warning("refused a region connection: %d already open", MAX_REGIONS)
                    continue
                conn.settimeout(2.0)
                self._conns[conn.fileno()] = conn
                self._by_conn[conn.fileno()] = None
                poller.register(conn.fileno(), zmq.POLLIN)
        for fd in [fd for fd in self._conns if fd in events]:
            self._serve_conn(fd, poller)

    def _serve_conn(self, fd: int, poller) -> None:
        conn = self._conns[fd]
        if self._by_conn[fd] is not None:
            # A registered connection only ever speaks by closing.
            try:
                data = conn.recv(1, socket.MSG_DONTWAIT)
            except (BlockingIOError, socket.timeout):
                return
            except OSError:
                data = b""
            if not data:
                self._drop(fd, poller)
            return
        try:
            header, memfd = P.recv_register(conn)
        except (ConnectionResetError, OSError):
            self._drop(fd, poller)
            return
        except P.ProtocolError as exc:
            self._reply_and_drop(fd, poller, {"ok": False, "code": exc.code, "msg": exc.msg})
            return
        try:
            region = self._map(header, memfd, conn)
        except P.ProtocolError as exc:
            if memfd is not None:
                os.close(memfd)
            self._reply_and_drop(fd, poller, {"ok": False, "code": exc.code, "msg": exc.msg})
            return
        if self.on_map is not None:
            try:
                self.on_map(region.view)
            except Exception as exc:  # the store refused the mapping: the client falls back to frames
                log.warning("store refused a host pool region: %s", exc)
                region.view.release()
                region.mapping.close()
                self._reply_and_drop(fd, poller, {"ok": False, "code": "io_error", "msg": f"store refused the region: {exc}"})
                return
        self._by_conn[fd] = region
        self._by_id[region.region_id] = region
        try:
            P.send_framed(conn, {"v": P.PROTOCOL_VERSION, "ok": True, "region": region.region_id})
        except OSError:  # the client stopped waiting (its deadline passed): it will register again
            log.info("a host pool region's client left before the reply; unmapped")
            self._drop(fd, poller)
            return
        log.info("mapped a host pool region of %d bytes", region.size)

    def _map(self, header: dict, memfd: Optional[int], conn) -> Region:
        if header.get("v") != P.PROTOCOL_VERSION:
            raise P.ProtocolError("bad_version", f"protocol version {header.get('v')!r} is not supported")
        if memfd is None:
            raise P.ProtocolError("bad_request", "register carries no file descriptor")
        session, size = header.get("s"), header.get("size")
        if not isinstance(session, int) or not isinstance(size, int) or size <= 0:
            raise P.ProtocolError("bad_request", "register needs integer s and a positive size")
        actual = os.fstat(memfd).st_size
        if actual < size:
            raise P.ProtocolError("bad_request", f"fd holds {actual} bytes, fewer than the declared {size}")
        try:
            mapping = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise P.ProtocolError("bad_request", f"cannot map the fd: {exc}") from None
        finally:
            os.close(memfd)  # the mapping keeps the memory alive
        threading.Thread(target=_populate, args=(mapping,), name="populate", daemon=True).start()
        return Region(secrets.randbits(62), session, size, mapping, memoryview(mapping), conn)

    def _reply_and_drop(self, fd: int, poller, reply: dict) -> None:
        try:
            P.send_framed(self._conns[fd], {"v": P.PROTOCOL_VERSION, **reply})
        except OSError:
            pass
        self._drop(fd, poller)

    def _drop(self, fd: int, poller) -> None:
        conn = self._conns.pop(fd)
        region = self._by_conn.pop(fd, None)
        try:
            poller.unregister(fd)
        except KeyError:
            pass
        if region is not None:
            self._by_id.pop(region.region_id, None)
            self._unhook(region)
            try:
                region.view.release()
                region.mapping.close()
            except BufferError:
                # A transfer still holds a slice; the mapping goes when it is done.
                log.debug("region still in use at close")
            log.info("unmapped a host pool region of %d bytes (client went away)", region.size)
        conn.close()

    def _unhook(self, region: Region) -> None:
        if self.on_unmap is not None:
            try:
                self.on_unmap(region.view)
            except Exception as exc:
                log.warning("store failed to forget a host pool region: %s", exc)

    def close(self) -> None:
        for fd in list(self._conns):
            conn = self._conns.pop(fd)
            conn.close()
        for region in self._by_id.values():
            self._unhook(region)
            try:
                region.view.release()
                region.mapping.close()
            except BufferError:
                pass
        self._by_id.clear()
        if self._listener is not None:
            self._listener.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
