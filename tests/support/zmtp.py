"""A raw ZMTP 3.0 peer (NULL mechanism) over an ipc or tcp socket, not libzmq: it can send frames of a message it
never ends (libzmq's own sender holds an unfinished message back, so a DEALER cannot)."""
from __future__ import annotations

import socket
import struct


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


class RawZmtpPeer:
    def __init__(self, endpoint: str):
        if endpoint.startswith("tcp://"):
            host, port = endpoint[len("tcp://"):].rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=5)
            self.sock.settimeout(None)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(endpoint[len("ipc://"):])
        # Greeting: signature, version 3.0, mechanism NULL, as-server 0, filler.
        self.sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
        got = b""
        while len(got) < 64:
            chunk = self.sock.recv(64 - len(got))
            if not chunk:
                raise ConnectionError("closed during the greeting")
            got += chunk
        ready = b"\x05READY" + _property(b"Socket-Type", b"DEALER")
        self.sock.sendall(b"\x04" + bytes([len(ready)]) + ready)

    def frame(self, data: bytes, more: bool = True) -> None:
        """One frame of the current message (more: another follows)."""
        long_frame = len(data) > 255
        flags = (1 if more else 0) | (2 if long_frame else 0)
        size = struct.pack(">Q", len(data)) if long_frame else bytes([len(data)])
        self.sock.sendall(bytes([flags]) + size + data)

    def closed_by_peer(self) -> bool:
        """True when the daemon closed the connection: what it sent (its greeting) ends in end-of-file."""
        try:
            while True:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
                if not data:
                    return True
        except BlockingIOError:
            return False
        except OSError:  # reset: closed too
            return True

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked sending into a zero window
        except OSError:
            pass
        self.sock.close()
