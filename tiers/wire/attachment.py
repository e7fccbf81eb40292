"""A client's shared memory with its daemon: the host pool it hands over, the daemon's arena it maps.

Owned by TierClient (tiers/wire/client.py), which calls ``register`` after
every hello (a daemon that restarted forgets regions) under its own lock.
Pages then move by (offset, length) in those mappings instead of as frames:
the daemon copies a put out of the host pool; an engine copies a leased read
out of the arena, mapped read-only (tiers/wire/arena_map.py).
"""
from __future__ import annotations

import mmap
import os
import socket
from typing import Optional

from tiers.logs import RateLimitedLog
from tiers.wire import messages as M
from tiers.wire import protocol as P
from tiers.shm.directory import DirectoryView
from tiers.wire.arena_map import ArenaMap


class Attachment:
    """The host-pool memfd this client registers (if any) and the daemon arena it maps (when wanted)."""

    def __init__(self, name: str, map_arena: bool, warn: RateLimitedLog):
        self.name = name
        self.map_arena = map_arena  # engines copy leased reads out of the arena; daemons' clients need not
        self._warn = warn
        self._fd: Optional[int] = None
        self._size = 0
        self._conn: Optional[socket.socket] = None  # kept open: closing it tells the daemon to unmap
        self.region_id: Optional[int] = None
        self.arena: Optional[ArenaMap] = None

    @property
    def wanted(self) -> bool:
        """Whether a hello must be followed by a registration."""
        return self._fd is not None or self.map_arena

    def remember(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size

    def forget_region(self) -> None:
        """The session ended: its region id means nothing to the next one."""
        self.region_id = None

    def register(self, fd_socket: str, session: int, timeout: float) -> None:
        """Hand over the host pool (when there is one) and map the daemon's arena, through fd_socket."""
        self.region_id = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if not fd_socket:
            return
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        fds = []
        try:
            conn.connect(fd_socket)
            header = {"v": P.PROTOCOL_VERSION, "s": session, "size": self._size}
            if self._fd is not None:
                P.send_register(conn, self._fd, header)
            else:
                P.send_framed(conn, header)
            raw, fds = P.recv_framed_fds(conn, 2)  # the arena's descriptor, then its page directory's
            reply = M.decode_attach_reply(raw)
            if reply.ok and fds and self.map_arena:
                self._map_arena(fds[0], reply, fds[1] if len(fds) > 1 else None)
        except (OSError, ValueError, P.ProtocolError) as exc:
            conn.close()
            self._warn.warning(f"region:{self.name}", "tier %s: attach failed (%s); pages travel as frames",
                               self.name, exc)
            return
        finally:
            for fd in fds:
                os.close(fd)
        if not reply.ok:
            conn.close()
            self._warn.warning(f"region:{self.name}", "tier %s refused the host pool: %s", self.name, reply.msg)
            return
        conn.setblocking(False)  # daemon_alive peeks at it without waiting
        self._conn = conn
        self.region_id = reply.region or None

    def _map_arena(self, fd: int, reply: M.AttachReply, directory_fd: Optional[int]) -> None:
        arena_id, size = reply.arena, reply.arena_size
        if arena_id is None or size is None or size <= 0:
            return
        if self.arena is not None and self.arena.arena_id == arena_id:
            return  # the same daemon: the mapping we have is the right one
        if os.fstat(fd).st_size < size:
            raise ValueError("the daemon's arena is smaller than it says")
        # Read-only and sealed by the daemon against shrinking: copying from it can never fault.
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        # A prefaulted arena (DRAM) gets its page tables built now; a sparse one (staging) must not:
        # populating it would allocate all of it.
        resident = os.fstat(fd).st_blocks * 512 >= size * 0.9
        directory = self._map_directory(directory_fd, reply.directory, size) if directory_fd is not None else None
        old, self.arena = self.arena, ArenaMap(arena_id, mapping, populate_now=resident, directory=directory)
        if old is not None:
            old.close()

    def _map_directory(self, fd: int, size: Optional[int], arena_size: int) -> Optional[DirectoryView]:
        """The arena's page directory, mapped read-only (None, and reads ask the daemon, when unusable)."""
        if not size or size <= 0 or os.fstat(fd).st_size < size:
            return None
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            return DirectoryView(mapping, arena_size)
        except (ValueError, ImportError) as exc:
            mapping.close()
            self._warn.warning(f"directory:{self.name}", "tier %s: page directory unusable (%s); reads ask the "
                               "daemon", self.name, exc)
            return None

    def daemon_alive(self) -> bool:
        """Whether the daemon that handed the arena over still holds our attachment open (one non-blocking
        peek): a daemon that exited closed it, and its directory must not serve hits any more.  A frozen
        daemon still holds it."""
        conn = self._conn
        if conn is None:
            return False
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: open
        except OSError:
            return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
